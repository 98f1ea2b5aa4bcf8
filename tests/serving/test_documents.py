"""Documents cut into sentences and joined back (aiayn.serving.documents), and the detection of their
language (aiayn.serving.languages): plain text joins back to itself byte for byte, HTML to a tree
bs4 reads the same as the input's, and detection names the languages of sentences known to be in them."""

import gzip
import random
import re

import pytest
from bs4 import BeautifulSoup, NavigableString
from conftest import MULTI30K

from aiayn.serving.documents import Document, pieces, split_html, split_text
from aiayn.serving.languages import detect, language_name

TRICKY = [
    "",
    " ",
    "\n",
    "\r\n\r\n",
    " \t \n  ",
    "One sentence.",
    "  Leading and trailing.  ",
    "Two  spaces.  Between   sentences.",
    "A tab.\tThen another.\t",
    "Windows lines.\r\nSecond line.\r\n\r\nAfter a blank line.\r\n",
    "Dr. Smith paid $3.5 million. He left at 5 p.m. on Friday.",
    'She asked: "Why?" Nobody answered... Then it rained.',
    "Wait... what? Yes! Really?!",
    "No punctuation at all",
    "Numbers 3.5 and 1. 2. 3. in a row. Fine.",
    "\u00a0Non-breaking\u00a0spaces.\u00a0Here.\u00a0",
    "Ein Satz, z. B. dieser. Am 1. Mai kam er. Er lief 3,5 km.",
    "M. Dupont est là. « Bonjour ! » dit-il. Etc.",
    "...",
    "?! .",
    "Line one\nline two.\n\n\nline three. Four.",
]


def pieces_of(text: str, rng: random.Random) -> str:
    """A random text of the pieces that make splitting hard."""
    pieces = ["Dr.", "etc.", "z. B.", "3.5", "...", "?", "!", ".", " ", "  ", "\t", "\n", "\r\n", "\u00a0",
              '"', "«", "»", "„", "“", "(", ")", "Word", "word", "Mai", "1."]  # fmt: skip
    return text.join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))


def check_text(text: str, language: str) -> Document:
    document = split_text(text, language)
    assert document.join(document.sentences) == text
    assert all(s and s == s.strip() and "\n" not in s and "\r" not in s for s in document.sentences)
    assert all(gap.isspace() or gap == "" for gap in document.gaps)  # every other character is in a sentence
    offset = 0
    for sentence in document.sentences:  # in order, apart
        offset = text.index(sentence, offset) + len(sentence)
    return document


@pytest.mark.parametrize("language", ["en", "de", "fr", "xx"])
def test_text_joins_back_exactly(language):
    for text in TRICKY:
        check_text(text, language)
    rng = random.Random(language)
    for _ in range(300):
        check_text(pieces_of("", rng), language)


def test_a_paragraph_gives_one_piece_per_sentence_in_order_and_joins_with_its_spacing():
    text = (
        "  Dr. Smith arrived at 10 a.m. on Monday.  He brought 3.5 kg of apples!\tWas it enough?\r\n\r\nNo. "
    )
    document = split_text(text, "en")
    assert document.sentences == (
        "Dr. Smith arrived at 10 a.m. on Monday.",
        "He brought 3.5 kg of apples!",
        "Was it enough?",
        "No.",
    )
    assert document.join(["A.", "B!", "C?", "D."]) == "  A.  B!\tC?\r\n\r\nD. "


def test_german_and_french_rules():
    assert split_text("Dr. Müller kam am 1. Mai nach Berlin. Er lief z. B. 3,5 km.", "de").sentences == (
        "Dr. Müller kam am 1. Mai nach Berlin.",
        "Er lief z. B. 3,5 km.",
    )
    assert split_text(
        "M. Dupont est arrivé. Il a apporté des pommes, etc. pour le repas.", "fr"
    ).sentences == (
        "M. Dupont est arrivé.",
        "Il a apporté des pommes, etc. pour le repas.",
    )


@pytest.mark.skipif(not (MULTI30K / "val.en.gz").is_file(), reason="needs ../shared/data/multi30k")
@pytest.mark.parametrize("language", ["en", "de", "fr"])
def test_paragraphs_of_multi30k_lines_split_into_their_lines(language):
    with gzip.open(MULTI30K / f"val.{language}.gz", "rt", encoding="utf-8") as f:
        lines = [line.strip() for _, line in zip(range(200), f) if re.search(r"[.!?]$", line.strip())]
    for i in range(0, len(lines), 4):
        assert split_text(" ".join(lines[i : i + 4]), language).sentences == tuple(lines[i : i + 4])


@pytest.mark.parametrize(
    ("language", "sentences", "gap"),
    [
        ("zh", ["我喜欢狗。", "你呢？", "他们在公园里跑步！", "最后一句"], ""),
        ("ja", ["犬が走る。", "猫は寝ている！"], ""),
        ("hi", ["मैं घर जा रहा हूँ।", "तुम कहाँ हो?", "ठीक है"], " "),
        ("ar", ["أنا ذاهب إلى البيت.", "أين أنت؟", "حسنا"], " "),
        ("th", ["ฉันชอบสุนัข", "คุณล่ะ", "พวกเขาวิ่งในสวน"], " "),
    ],
)
def test_scripts_without_moses_rules_split_at_their_own_marks(language, sentences, gap):
    """Chinese and Japanese end a sentence with 。！？ and no space, Hindi with the danda, Arabic with ؟,
    Thai with a space: English rules (a mark before a capital) would leave each paragraph one sentence."""
    text = gap.join(sentences)
    assert list(check_text(text, language).sentences) == sentences
    long = gap.join(sentences[:-1] * 40)  # a paragraph of several hundred characters
    assert list(check_text(long, language).sentences) == sentences[:-1] * 40


def test_a_sentence_over_the_limit_is_cut_in_pieces_that_join_back():
    """Where a clause ends, else at a space, else anywhere, nearest the middle: every piece within the
    limit, joined with what followed each it is the sentence."""
    words = lambda text: len(text.split())  # noqa: E731 (a count of tokens: words)
    sentence = ", ".join(" ".join(f"w{i}-{j}" for j in range(7)) for i in range(60))  # 420 words
    cut = pieces(sentence, words, 256)
    assert len(cut) > 1 and all(words(p) <= 256 for p, _ in cut)
    assert "".join(p + after for p, after in cut) == sentence
    assert all(p.endswith(",") for p, _ in cut[:-1])  # at clauses
    chars = lambda text: len(text)  # noqa: E731 (a script without spaces: a token a character)
    chinese = "狗" * 400
    cut = pieces(chinese, chars, 256)
    assert all(len(p) <= 256 for p, _ in cut) and "".join(p + a for p, a in cut) == chinese
    assert pieces("short", words, 256) == [("short", "")]


def test_join_wants_one_translation_per_sentence():
    with pytest.raises(ValueError, match="1 translations for a document of 2 sentences"):
        split_text("One. Two.", "en").join(["Eins."])


# --- HTML ---------------------------------------------------------------------------------------------

SKIPPED = {"script", "style", "code", "pre"}


def tree(node, translate=lambda text: text) -> tuple:
    """bs4's reading of a node as nested tuples: tag, attributes, children; text as (its class, text),
    `translate` applied to the text of prose (written here apart from the module's own rule)."""
    if isinstance(node, NavigableString):
        prose = type(node) is NavigableString and not any(p.name in SKIPPED for p in node.parents)
        return type(node).__name__, translate(str(node)) if prose else str(node)
    attributes = tuple(sorted((k, " ".join(v) if isinstance(v, list) else v) for k, v in node.attrs.items()))
    return node.name, attributes, tuple(tree(child, translate) for child in node.children)


def parsed(markup: str, translate=lambda text: text) -> tuple:
    return tree(BeautifulSoup(markup, "html.parser"), translate)


HTML = [
    "",
    "Just text. Two sentences.",
    "<p>A <b>big <i>red</i> dog</b> runs. It barks.</p>",
    '<!DOCTYPE html><html lang="en"><head><title>Fish &amp; chips</title><meta charset="utf-8">'
    "<style>p > b { color: red; }</style><script>if (a < b && c) { x = '</p>'; }</script></head>\r\n"
    '<body><!-- a comment. Two. --><p class="x y" title=\'Tom &amp; "Jerry"\' data-n=3>'
    "Fish &amp; chips&nbsp;cost &lt;5 &eacute;euros. Really?</p><br><img src=a.png alt='A dog.'>"
    "<pre>Keep &lt;p&gt;.  This.</pre><code>x = 1. y = 2.</code>\n  <ul><li>One. Two.<li>Three.</ul>"
    "<svg><path d='M0 0'/></svg><p>Unclosed paragraph. Fine.</body></html>",
    "<div>\n  Leading space.   <span> Inner. </span>\n\tTrailing.  \n</div>",
    "<table><tr><td>1. Mai.<td>3.5 km.</table><p>One<p>Two",
    "<p>&#xE000;private use &#169; &amp;amp; &lt;b&gt;not a tag&lt;/b&gt;. Done.</p>",
]


@pytest.mark.parametrize("markup", HTML)
def test_html_joins_back_to_the_same_tree(markup):
    document = split_html(markup, "en")
    assert all(s and s == s.strip() for s in document.sentences)
    assert parsed(document.join(document.sentences)) == parsed(markup)
    # a translation that changes every sentence changes exactly the prose, and nothing else
    assert parsed(document.join([s.upper() for s in document.sentences])) == parsed(markup, str.upper)


def test_nested_inline_tags_give_the_text_of_each_node():
    document = split_html("<p>A <b>big <i>red</i> dog</b> runs. It barks.</p>", "en")
    assert document.sentences == ("A", "big", "red", "dog", "runs.", "It barks.")
    out = document.join(["Ein", "großer", "roter", "Hund", "rennt.", "Er bellt."])
    assert out == "<p>Ein <b>großer <i>roter</i> Hund</b> rennt. Er bellt.</p>"


def test_entities_attributes_comments_and_code_are_kept():
    markup = (
        "<!-- Do not. Translate. --><p title='A &amp; B. C.' data-x='1 &lt; 2'>Tom &amp; Jerry&nbsp;run &lt;fast&gt;."
        " Caf&eacute;?</p><script>var s = 'No. No.';</script><style>a{}</style><pre>Code. Here.</pre>"
    )
    document = split_html(markup, "en")
    assert document.sentences == ("Tom & Jerry\u00a0run <fast>.", "Café?")
    out = document.join(["Tom & Jerry\u00a0rennen <schnell>.", "Café?"])
    assert out == (
        '<!-- Do not. Translate. --><p data-x="1 &lt; 2" title="A &amp; B. C.">Tom &amp; Jerry&nbsp;rennen'
        " &lt;schnell&gt;. Café?</p><script>var s = 'No. No.';</script><style>a{}</style><pre>Code. Here.</pre>"
    )


def test_translate_no_is_kept():
    document = split_html(
        '<p translate="no">Brand. Name.</p><div translate=no><p translate=yes>Hi.</p></div>', "en"
    )
    assert document.sentences == ("Hi.",)


@pytest.mark.parametrize(
    "markup, message",
    [
        (
            "<p><b><i>x</b></i></p>",
            r"^malformed HTML: </b> at line 1, column 11 crosses <i> opened at line 1, column 7$",
        ),
        (
            "<div>\n<p>text</p>\n  </span></div>",
            r"^malformed HTML: </span> at line 3, column 3 closes no open element$",
        ),
        ("<b>one\n <p>two</b></p>", r"^malformed HTML: </p> at line 2, column 12 closes no open element$"),
    ],
)
def test_malformed_html_names_the_tag_and_where(markup, message):
    with pytest.raises(ValueError, match=message):
        split_html(markup, "en")


@pytest.mark.parametrize(
    "markup",
    [
        "<ul><li>One.<li>Two.</ul>",  # optional end tags left out
        "<table><tr><td>1<td>2<tr><td>3</table>",
        "<dl><dt>Term<dd>Definition.</dl><select><option>A<option>B</select>",
        "<div><b>unclosed at the end",
        "<p>line<br></br>break <img src=x></img></p>",  # end tags of void elements, which browsers ignore
        "<svg><circle r='1'/></svg><div/>text",
    ],
)
def test_html_browsers_accept_is_accepted(markup):
    document = split_html(markup, "en")
    assert parsed(document.join(document.sentences)) == parsed(markup)


# --- Languages ----------------------------------------------------------------------------------------

SENTENCES = {
    "en": "The children were playing in the garden while their parents cooked dinner.",
    "de": "Die Kinder spielten im Garten, während ihre Eltern das Abendessen kochten.",
    "fr": "Les enfants jouaient dans le jardin pendant que leurs parents préparaient le dîner.",
}


@pytest.mark.parametrize("language", ["en", "de", "fr"])
def test_detect_among_the_languages_served(language):
    found = detect(SENTENCES[language], {"en", "de", "fr"})
    assert found[0][0] == language
    assert {code for code, _ in found} <= {"en", "de", "fr"}
    confidences = [c for _, c in found]
    assert confidences == sorted(confidences, reverse=True) and 50 < confidences[0] <= 100
    assert sum(confidences) <= 100 + 1e-6


def test_detect_answers_only_languages_it_is_given():
    found = detect(SENTENCES["de"], ["en", "fr"])
    assert {code for code, _ in found} <= {"en", "fr"}
    assert detect(SENTENCES["de"], ["de"]) == [("de", 100.0)]


@pytest.mark.skipif(not (MULTI30K / "val.en.gz").is_file(), reason="needs ../shared/data/multi30k")
@pytest.mark.parametrize("language", ["en", "de", "fr"])
def test_detect_multi30k_lines(language):
    with gzip.open(MULTI30K / f"val.{language}.gz", "rt", encoding="utf-8") as f:
        lines = [line.strip() for _, line in zip(range(100), f)]
    right = sum(detect(line, ("en", "de", "fr"))[0][0] == language for line in lines)
    assert right >= 98, right


@pytest.mark.parametrize("text", ["", "   ", "12345", "3.5 + 4 = 7.5 ?!", "你好，世界"])
def test_undetectable_text_raises(text):
    with pytest.raises(ValueError, match="^cannot detect the language of "):
        detect(text, ["en", "de", "fr"])


def test_language_names():
    assert [language_name(code) for code in ("en", "de", "fr", "pt-BR")] == [
        "English",
        "German",
        "French",
        "Portuguese (Brazil)",
    ]
    assert language_name("xx") == "xx" and language_name("") == ""
