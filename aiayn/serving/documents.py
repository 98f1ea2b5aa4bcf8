"""Documents as LibreTranslate's API sends them, plain text or HTML, cut into the sentences a model
translates and put back together around their translations with everything else kept as it was."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html.parser import HTMLParser

from bs4 import BeautifulSoup, Doctype, NavigableString
from bs4.dammit import EntitySubstitution
from bs4.formatter import HTMLFormatter
from sentence_splitter import SentenceSplitter, SentenceSplitterException

# Elements whose text is not prose: program text, preformatted text.
UNTRANSLATED = frozenset({"script", "style", "code", "pre"})
# Elements that have no end tag (an end tag written for one is ignored by browsers, and by bs4).
VOID = frozenset(
    {"area", "base", "br", "col", "embed", "hr", "img", "input", "keygen", "link", "meta", "param", "source",
     "track", "wbr"}
)  # fmt: skip
# Elements whose end tag HTML lets a writer leave out: an end tag of an element around them closes them.
OPTIONAL_END = frozenset(
    {"html", "head", "body", "p", "li", "dt", "dd", "rt", "rp", "optgroup", "option", "colgroup", "caption",
     "thead", "tbody", "tfoot", "tr", "td", "th"}
)  # fmt: skip


@dataclass(frozen=True)
class Document:
    """A text cut into the pieces a model translates (sentences) and what lies around them, kept as it was."""

    sentences: tuple[str, ...]  # what to translate, in order; never empty, never only whitespace
    gaps: tuple[str, ...]  # what lies before, between and after the sentences: one more than sentences
    markup: bool = False  # the gaps are serialized HTML, so a translation's &, < and > are escaped

    def __post_init__(self) -> None:
        assert len(self.gaps) == len(self.sentences) + 1, (len(self.gaps), len(self.sentences))

    def join(self, translations: Sequence[str]) -> str:
        """The text (or markup) back, each sentence replaced by its translation."""
        if len(translations) != len(self.sentences):
            raise ValueError(
                f"{len(translations)} translations for a document of {len(self.sentences)} sentences"
            )
        escape = _escape if self.markup else str
        parts = [self.gaps[0]]
        for translation, gap in zip(translations, self.gaps[1:]):
            parts += [escape(translation), gap]
        return "".join(parts)


def split_text(text: str, language: str) -> Document:
    """Plain text cut into sentences. Lines are paragraphs: a sentence never runs over a line break, so
    blank lines, "\\r\\n" and every space around and between sentences stay where they were."""
    spans = []
    for line in re.finditer(r"[^\r\n]+", text):
        spans += [(line.start() + a, line.start() + b) for a, b in _sentence_spans(line.group(), language)]
    return _document(text, spans)


def split_html(markup: str, language: str) -> Document:
    """HTML cut into the sentences of its text nodes, outside script, style, code, pre and what is marked
    translate="no". A sentence stays within its text node (a tag inside one cuts it): the model translates
    plain sentences, which carry no tags through to their translation. Raises ValueError when an end tag
    closes no open element or crosses one (see _check_nesting)."""
    _check_nesting(markup)
    soup = BeautifulSoup(markup, "html.parser")
    for node in [node for node in soup.descendants if type(node) is Doctype]:
        node.replace_with(_Doctype(str(node)))
    # Each sentence is marked in the tree by a character the document does not hold (looked for in the
    # serialized tree, where a character written as an entity in the markup is itself); the serialized
    # tree, cut at the marks, is the document's gaps.
    serialized = soup.decode(formatter=_FORMATTER)
    mark = next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in serialized)  # the private use area
    nodes = [node for node in soup.descendants if type(node) is NavigableString and _translatable(node)]
    sentences = []
    for node in nodes:
        text, spans = str(node), _sentence_spans(str(node), language)
        if spans:
            sentences += [text[a:b] for a, b in spans]
            ends = [0, *(i for a, b in spans for i in (a, b)), len(text)]
            node.replace_with(NavigableString(mark.join(text[a:b] for a, b in zip(ends[::2], ends[1::2]))))
    gaps = soup.decode(formatter=_FORMATTER).split(mark)
    return Document(tuple(sentences), tuple(gaps), markup=True)


def _document(text: str, spans: list[tuple[int, int]]) -> Document:
    """The document of text whose sentences lie at spans (in order, apart)."""
    ends = [0, *(i for a, b in spans for i in (a, b)), len(text)]
    gaps = tuple(text[a:b] for a, b in zip(ends[::2], ends[1::2]))
    return Document(tuple(text[a:b] for a, b in spans), gaps)


def _sentence_spans(text: str, language: str) -> list[tuple[int, int]]:
    """Where each sentence of text lies, from its first character that is not a space to its last. The
    splitter sees every run of whitespace as one space (a tab, a no-break space or, in HTML, a line
    break between words is a space to it) and may move spaces, but keeps every other character in order:
    counting those finds each sentence in text exactly. A splitter that lost or moved a character would
    leave the line one sentence."""
    if not text or text.isspace():
        return []
    where = [i for i, c in enumerate(text) if not c.isspace()]
    sentences = _splitter(language)(re.sub(r"\s+", " ", text))
    if "".join("".join(sentences).split()) != "".join(text[i] for i in where):
        return [(where[0], where[-1] + 1)]
    spans, k = [], 0
    for sentence in sentences:
        n = sum(not c.isspace() for c in sentence)
        if n:
            spans.append((where[k], where[k + n - 1] + 1))
            k += n
    return spans


# Languages written without a mark at the end of a sentence, a space between sentences instead (Thai, Lao,
# Khmer): there, a space ends one.
SPACE_ENDS_SENTENCE = frozenset({"th", "lo", "km"})


@functools.lru_cache(maxsize=64)
def _splitter(language: str) -> Callable[[str], list[str]]:
    """The sentence splitter of a language, built once. Moses' rules (sentence_splitter) where it has them,
    chosen by benchmarks/bench_text.py: of the splitters it measures that never raise or lose a character
    on odd lines, this one splits the most paragraphs exactly (pysbd, a little ahead on the hard
    paragraphs, did both, and a lost character cannot be joined back). For the languages Moses has no rules
    for, pysbd's where it has them (Chinese and Japanese, which end a sentence with 。！？ and no space;
    Arabic, Persian and Urdu with ؟; Hindi and Marathi with the danda; Armenian, Amharic, Burmese, ...);
    Thai, Lao and Khmer at their spaces; any other language gets Moses' English rules: a period, ? or !
    before a capital still ends a sentence, only the abbreviations are English."""
    code = language.replace("_", "-").split("-")[0].lower()
    if code in SPACE_ENDS_SENTENCE:
        return str.split
    try:
        return SentenceSplitter(language=code).split
    except SentenceSplitterException:  # its way of saying it has no rules for the language
        pass
    import pysbd
    from pysbd.languages import LANGUAGE_CODES

    if code in LANGUAGE_CODES:
        return pysbd.Segmenter(language=code, clean=False).segment
    return _splitter("en")


def pieces(text: str, tokens: Callable[[str], int], limit: int) -> list[tuple[str, str]]:
    """A sentence longer than a model reads (tokens(text) > limit) cut into pieces of at most limit tokens,
    each with what followed it in text (a space, or nothing): where a clause ends (, ; : and their
    full-width forms), else at a space, else between two characters, nearest the middle each time, so
    that the pieces are as long as each other. Joined with what followed each, the pieces are text."""
    if tokens(text) <= limit or len(text) < 2:
        return [(text, "")]
    middle = len(text) / 2
    for pattern in (r"[,;:，；：、]\s*", r"\s+", r"(?<=.)(?=.)"):
        cuts = [m for m in re.finditer(pattern, text) if 0 < m.end() < len(text)]
        if cuts:
            cut = min(cuts, key=lambda m: abs(m.end() - middle))
            break
    end = cut.end()
    head = text[:end].rstrip()
    *before, (last, _) = pieces(head, tokens, limit)
    return [*before, (last, text[len(head) : end]), *pieces(text[end:], tokens, limit)]


def _translatable(node: NavigableString) -> bool:
    """Whether a text node is prose to translate: not only whitespace, not inside script, style, code or
    pre, and not under translate="no" (HTML's own mark; the nearest element that says decides)."""
    if node.isspace() or any(parent.name in UNTRANSLATED for parent in node.parents):
        return False
    said = next(
        (parent["translate"] for parent in node.parents if parent.get("translate") is not None), "yes"
    )
    return said.strip().lower() != "no"


def _escape(text: str) -> str:
    """Text as HTML: &, < and > as entities, and a no-break space as &nbsp; so that it stays visible."""
    return EntitySubstitution.substitute_xml(text).replace("\xa0", "&nbsp;")


class _Doctype(Doctype):
    """A doctype written as it was read: bs4 writes a line break after one, a text node the input lacked."""

    SUFFIX = ">"


# HTML out (<br>, not <br/>), entities only where text needs them
_FORMATTER = HTMLFormatter(entity_substitution=_escape, void_element_close_prefix=None)


class _Nesting(HTMLParser):
    """The check that end tags nest, on the stdlib's parser (which knows where each tag is). Unclosed
    elements at the end are accepted, as browsers accept them."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.open: list[tuple[str, str]] = []  # (tag, where it was opened), innermost last

    def where(self) -> str:
        line, offset = self.getpos()
        return f"line {line}, column {offset + 1}"

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag not in VOID:
            self.open.append((tag, self.where()))

    def handle_startendtag(self, tag: str, attrs) -> None:
        pass  # <x/> opens nothing: bs4 reads it as an empty element too

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        if tag not in (name for name, _ in self.open):
            raise ValueError(f"malformed HTML: </{tag}> at {self.where()} closes no open element")
        while (inner := self.open.pop())[0] != tag:
            if inner[0] not in OPTIONAL_END:
                raise ValueError(
                    f"malformed HTML: </{tag}> at {self.where()} crosses <{inner[0]}> opened at {inner[1]}"
                )


def _check_nesting(markup: str) -> None:
    parser = _Nesting()
    parser.feed(markup)
    parser.close()
