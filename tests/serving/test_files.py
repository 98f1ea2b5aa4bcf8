"""LibreTranslate's /translate_file and /download_file: a .docx, an .odt, a .pptx, subtitles, a text file and
an HTML page built here with each format's own library, sent as LibreTranslate's clients send them (a
multipart form), fetched back through the URL the answer gives, and read again with the same library:
the structure and styles as they were (headings, bold, tables, timings), each paragraph's text equal to the
model's translation of it, and the errors in LibreTranslate's words."""

import io
import shutil

import pytest
from fastapi.testclient import TestClient

from aiayn.checkpoint import Languages, save_languages
from aiayn.config import InferenceOptions, SearchConfig, ServeConfig
from aiayn.inference.translate import Translator
from aiayn.serving.app import create_app
from aiayn.serving.server import read_models

docx = pytest.importorskip("docx")
pptx = pytest.importorskip("pptx")
odf = pytest.importorskip("odf")
srt = pytest.importorskip("srt")

HEADING = "The small dogs see a red bird."
BOLD = "A happy child found this key."
CELLS = ["My old horse likes the river.", "Some happy children found this green key."]
GREEDY = SearchConfig(beam_size=1)


@pytest.fixture(scope="module")
def model_dir(served_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("files") / "en-de"
    shutil.copytree(served_model, directory, ignore=shutil.ignore_patterns("checkpoints", "data", "*.log"))
    save_languages(Languages(("en",), ("de",)), directory / "languages.json")
    return directory


@pytest.fixture(scope="module")
def expected(model_dir):
    translator = Translator.load(model_dir, GREEDY, dtype="fp32", device="cpu")
    return dict(zip([HEADING, BOLD, *CELLS], translator.translate([HEADING, BOLD, *CELLS])))


def client_of(model_dir, **limits) -> TestClient:
    options = InferenceOptions(device="cpu", dtype="fp32", compile=False)
    config = ServeConfig(beam_size=1, **limits)
    return TestClient(create_app(read_models([model_dir], config, options), config, options=options))


@pytest.fixture(scope="module")
def client(model_dir):
    with client_of(model_dir) as c:
        yield c


def translated_file(client, name: str, data: bytes, source: str = "en") -> bytes:
    answer = client.post(
        "/translate_file", data={"source": source, "target": "de"}, files={"file": (name, data)}
    )
    assert answer.status_code == 200, answer.text
    url = answer.json()["translatedFileUrl"]
    stem, extension = name.rsplit(".", 1)
    assert url.startswith("http://testserver/download_file/") and url.endswith(f".{stem}_de.{extension}")
    download = client.get(url)
    assert download.status_code == 200
    assert f'filename="{stem}_de.{extension}"' in download.headers["content-disposition"]
    return download.content


def test_a_docx_keeps_its_heading_bold_and_table(client, expected):
    document = docx.Document()
    document.add_heading(HEADING, level=1)
    paragraph = document.add_paragraph()
    paragraph.add_run(BOLD).bold = True
    table = document.add_table(rows=1, cols=2)
    for cell, text in zip(table.rows[0].cells, CELLS):
        cell.text = text
    data = io.BytesIO()
    document.save(data)
    out = docx.Document(io.BytesIO(translated_file(client, "report.docx", data.getvalue())))
    heading, bold = out.paragraphs[0], out.paragraphs[1]
    assert heading.style.name == "Heading 1" and heading.text == expected[HEADING]
    assert bold.text == expected[BOLD] and [r.bold for r in bold.runs] == [True]
    assert len(out.tables) == 1 and len(out.tables[0].rows) == 1 and len(out.tables[0].columns) == 2
    assert [c.text for c in out.tables[0].rows[0].cells] == [expected[t] for t in CELLS]


def test_an_odt_keeps_its_heading_bold_span_and_table(client, expected):
    from odf import table, teletype, text
    from odf.opendocument import OpenDocumentText
    from odf.style import Style, TextProperties

    document = OpenDocumentText()
    strong = Style(name="Strong", family="text")
    strong.addElement(TextProperties(fontweight="bold"))
    document.automaticstyles.addElement(strong)
    document.text.addElement(text.H(outlinelevel=1, text=HEADING))
    paragraph = text.P()
    paragraph.addElement(text.Span(stylename=strong, text=BOLD))
    document.text.addElement(paragraph)
    grid = table.Table(name="Grid")
    grid.addElement(table.TableColumn(numbercolumnsrepeated=2))
    row = table.TableRow()
    for value in CELLS:
        cell = table.TableCell()
        cell.addElement(text.P(text=value))
        row.addElement(cell)
    grid.addElement(row)
    document.text.addElement(grid)
    data = io.BytesIO()
    document.write(data)
    from odf.opendocument import load

    out = load(io.BytesIO(translated_file(client, "report.odt", data.getvalue())))
    headings = out.getElementsByType(text.H)
    assert [teletype.extractText(h) for h in headings] == [expected[HEADING]]
    spans = out.getElementsByType(text.Span)
    assert [teletype.extractText(s) for s in spans] == [expected[BOLD]]
    assert spans[0].getAttribute("stylename") == "Strong"
    cells = out.getElementsByType(table.TableCell)
    assert [teletype.extractText(c) for c in cells] == [expected[t] for t in CELLS]
    assert len(out.getElementsByType(table.TableRow)) == 1


def test_a_pptx_keeps_its_title_and_table(client, expected):
    presentation = pptx.Presentation()
    slide = presentation.slides.add_slide(presentation.slide_layouts[5])  # title only
    slide.shapes.title.text = HEADING
    shape = slide.shapes.add_table(1, 2, 0, 0, 100, 100)
    for cell, value in zip(shape.table.rows[0].cells, CELLS):
        cell.text = value
    data = io.BytesIO()
    presentation.save(data)
    out = pptx.Presentation(io.BytesIO(translated_file(client, "deck.pptx", data.getvalue())))
    shapes = list(out.slides[0].shapes)
    assert shapes[0].text_frame.text == expected[HEADING]
    assert [c.text for c in shapes[1].table.rows[0].cells] == [expected[t] for t in CELLS]


def test_subtitles_keep_their_numbers_and_timings(client, expected):
    from datetime import timedelta

    subtitles = [
        srt.Subtitle(7, timedelta(seconds=1), timedelta(seconds=2.5), HEADING),
        srt.Subtitle(8, timedelta(seconds=3), timedelta(seconds=4), f"{CELLS[0]}\n{CELLS[1]}"),
    ]
    out = list(
        srt.parse(
            translated_file(client, "film.srt", srt.compose(subtitles, reindex=False).encode()).decode()
        )
    )
    assert [(s.index, s.start, s.end) for s in out] == [(s.index, s.start, s.end) for s in subtitles]
    assert [s.content for s in out] == [expected[HEADING], f"{expected[CELLS[0]]}\n{expected[CELLS[1]]}"]


def test_text_and_html_files_and_a_detected_source(client, expected):
    text = f"{HEADING}\n\n{BOLD}\n"
    out = translated_file(client, "notes.txt", text.encode(), source="auto").decode()
    assert out == f"{expected[HEADING]}\n\n{expected[BOLD]}\n"
    page = f"<html><body><h1>{HEADING}</h1><p><b>{BOLD}</b></p></body></html>"
    out = translated_file(client, "page.html", page.encode()).decode()
    assert out == f"<html><body><h1>{expected[HEADING]}</h1><p><b>{expected[BOLD]}</b></p></body></html>"


def test_file_errors_are_libretranslates(model_dir, client):
    def error(answer, status: int) -> str:
        assert answer.status_code == status, answer.text
        assert set(answer.json()) == {"error"} and isinstance(answer.json()["error"], str)
        return answer.json()["error"]

    form = {"source": "en", "target": "de"}
    post = lambda **kw: client.post("/translate_file", **kw)  # noqa: E731
    assert error(post(data=form), 400) == "Invalid request: missing file parameter"
    assert error(post(data={"target": "de"}, files={"file": ("a.txt", b"x")}), 400) == (
        "Invalid request: missing source parameter"
    )
    assert (
        error(post(data=form, files={"file": ("a.pdf", b"x")}), 400)
        == "Invalid request: file format not supported"
    )
    assert "cannot be read" in error(post(data=form, files={"file": ("a.docx", b"not a zip")}), 400)
    assert (
        error(post(data={**form, "target": "xx"}, files={"file": ("a.txt", b"x")}), 400)
        == "xx is not supported"
    )
    assert error(client.get("/download_file/nothere.a.txt"), 404)
    assert error(client.get("/download_file/..secret"), 400) == "Invalid filename"
    assert (
        error(client.post("/suggest", data={"q": "a", "s": "b"}), 403)
        == "Suggestions are disabled on this server."
    )
    settings = client.get("/frontend/settings").json()
    assert settings["filesTranslation"] is True and ".docx" in settings["supportedFilesFormat"]
    with client_of(model_dir, files_translation=False, max_body_bytes=5000) as off:
        assert error(off.post("/translate_file", data=form, files={"file": ("a.txt", b"x")}), 403) == (
            "Files translation are disabled on this server."
        )
        assert off.get("/frontend/settings").json()["supportedFilesFormat"] == []
    with client_of(model_dir, max_body_bytes=5000) as small:
        assert error(small.post("/translate_file", data=form, files={"file": ("a.txt", b"x" * 6000)}), 413)


def test_spec_describes_the_api(client):
    spec = client.get("/spec").json()
    assert "/translate_file" in spec["paths"] and "/translate" in spec["paths"]
