"""Documents in files, as LibreTranslate's /translate_file takes them: the paragraphs of a file read with
the well-kept library of its format, and the file written back with each paragraph's translation in
place, everything else (styles, tables, headings, slides, timings, markup) as it was.

A paragraph is translated whole (split into its sentences like any text), so its translation equals
`aiayn translate` of its text; its characters' styles cannot follow word by word through a translation,
so the translation takes the style of the paragraph's first piece of text (a run, a span) and the other
pieces are emptied: a paragraph in one style keeps it exactly, a paragraph of mixed styles takes its
first one. HTML goes through the HTML route instead, which keeps every tag.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

# The formats and what reads each: .txt and .html need nothing beyond the serve extra.
FORMATS = (".txt", ".html", ".docx", ".odt", ".odp", ".pptx", ".srt")


@dataclass
class Slot:
    """One paragraph of a file: its text, and where its translation goes."""

    text: str
    put: Callable[[str], None]


@dataclass
class Opened:
    """A file read: its paragraphs, in order, and how to write it once they are translated."""

    slots: list[Slot]
    save: Callable[[], bytes]
    markup: bool = False  # the one "paragraph" is an HTML document (libre.py translates it as html)


def open_file(data: bytes, extension: str) -> Opened:
    """The paragraphs of a file of one of FORMATS; ValueError where it is not one, or cannot be read."""
    reader = READERS.get(extension.lower())
    if reader is None:
        raise ValueError("file format not supported")
    try:
        return reader(data)
    except ValueError:
        raise
    except Exception as e:  # each library has its own errors for a damaged file
        raise ValueError(f"the {extension} file cannot be read ({type(e).__name__}: {e})") from None


def _text(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"the file is not UTF-8 text (byte {e.start})") from None


def _whole(data: bytes, markup: bool) -> Opened:
    """A text file (or an HTML page) is one document: its lines are paragraphs, its spacing kept."""
    out: list[str] = []
    text = _text(data)
    return Opened([Slot(text, out.append)], lambda: "".join(out).encode("utf-8"), markup)


def _runs(runs: list[Any]) -> Callable[[str], None]:
    """Put a translation in the first run that has text and empty the others (docx and pptx runs)."""

    def put(translation: str) -> None:
        first = next(run for run in runs if run.text)
        for run in runs:
            run.text = translation if run is first else ""

    return put


def _saver(write: Callable[[io.BytesIO], Any]) -> Callable[[], bytes]:
    """A file's bytes from its library's way of writing it to a file object."""

    def save() -> bytes:
        out = io.BytesIO()
        write(out)
        return out.getvalue()

    return save


def _docx(data: bytes) -> Opened:
    import docx

    document = docx.Document(io.BytesIO(data))

    def paragraphs(container: Any) -> Iterator[Any]:
        yield from container.paragraphs
        for table in getattr(container, "tables", []):
            for row in table.rows:
                for cell in row.cells:
                    yield from paragraphs(cell)

    containers: list[Any] = [document]
    for section in document.sections:
        containers += [section.header, section.footer]
    slots, seen = [], set()
    for container in containers:
        for paragraph in paragraphs(container):
            # a merged cell is the same paragraph under each of its grid cells: translated once
            # the text of its runs (a hyperlink's text is not one of them: it stays as it was)
            text = "".join(run.text for run in paragraph.runs)
            if id(paragraph._p) in seen or not text.strip():
                continue
            seen.add(id(paragraph._p))
            slots.append(Slot(text, _runs(paragraph.runs)))

    return Opened(slots, _saver(document.save))


def _pptx(data: bytes) -> Opened:
    from pptx import Presentation

    presentation = Presentation(io.BytesIO(data))

    def frames(shapes: Any) -> Iterator[Any]:
        for shape in shapes:
            if shape.has_text_frame:
                yield shape.text_frame
            if getattr(shape, "has_table", False) and shape.has_table:
                for row in shape.table.rows:
                    for cell in row.cells:
                        yield cell.text_frame
            if hasattr(shape, "shapes"):  # a group
                yield from frames(shape.shapes)

    slots = []
    for slide in presentation.slides:
        for frame in frames(slide.shapes):
            for paragraph in frame.paragraphs:
                text = "".join(run.text for run in paragraph.runs)
                if text.strip():
                    slots.append(Slot(text, _runs(list(paragraph.runs))))

    return Opened(slots, _saver(presentation.save))


def _odf(data: bytes) -> Opened:
    """OpenDocument text (.odt) and presentations (.odp): every paragraph and heading (text:p, text:h),
    in tables and frames too; a paragraph's text is what odfpy's teletype reads of it."""
    from odf import teletype, text
    from odf.element import Text
    from odf.namespaces import TEXTNS
    from odf.opendocument import load

    document = load(io.BytesIO(data))

    def pieces(element: Any) -> Iterator[Any]:
        """The text nodes of a paragraph, outside nested paragraphs (a note's body is its own)."""
        for child in element.childNodes:
            if isinstance(child, Text):
                yield child
            elif child.qname not in ((TEXTNS, "p"), (TEXTNS, "h"), (TEXTNS, "note")):
                yield from pieces(child)

    def put_into(element: Any) -> Callable[[str], None]:
        def put(translation: str) -> None:
            nodes = list(pieces(element))
            for i, node in enumerate(nodes):
                node.data = translation if i == 0 else ""
            if not nodes:
                element.addText(translation)

        return put

    slots = []
    for kind in (text.H, text.P):
        for element in document.getElementsByType(kind):
            content = teletype.extractText(element)
            if content.strip() and any(True for _ in pieces(element)):
                slots.append(Slot(content, put_into(element)))

    return Opened(slots, _saver(document.write))


def _srt(data: bytes) -> Opened:
    """Subtitles: each one's text a document (its lines kept), its number and timing as they were."""
    import srt

    try:
        subtitles = list(srt.parse(_text(data)))
    except srt.SRTParseError as e:
        raise ValueError(f"the subtitles cannot be read: {e}") from None

    def put_into(subtitle: Any) -> Callable[[str], None]:
        def put(translation: str) -> None:
            subtitle.content = translation

        return put

    slots = [Slot(s.content, put_into(s)) for s in subtitles if s.content.strip()]
    return Opened(slots, lambda: srt.compose(subtitles, reindex=False).encode("utf-8"))


READERS: Mapping[str, Callable[[bytes], Opened]] = MappingProxyType(
    {
        ".txt": lambda data: _whole(data, markup=False),
        ".html": lambda data: _whole(data, markup=True),
        ".docx": _docx,
        ".odt": _odf,
        ".odp": _odf,
        ".pptx": _pptx,
        ".srt": _srt,
    }
)
