"""LibreTranslate's API, at the paths and in the shapes its clients (libretranslatepy, deep-translator,
browser extensions) use: POST /translate with q (a text or a list), source (a code or "auto"), target,
format (text or html), alternatives and api_key; GET /languages; POST /detect. Parameters come as JSON, as
a form (urlencoded or multipart) or in the query string, as LibreTranslate's Flask `request.values` reads
them; errors are {"error": message} with its status codes (400 for the request, 403 for a key, 500).
Texts are documents: split into sentences (documents.py), translated through the models of their pair
(models.py: one, or two through a pivot), joined back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.datastructures import Headers
from starlette.formparsers import FormParser, MultiPartParser

from aiayn.files import atomic_write
from aiayn.serving.documents import Document, split_html, split_text
from aiayn.serving.file_formats import FORMATS, open_file
from aiayn.serving.languages import detect, language_name
from aiayn.serving.models import Models
from aiayn.serving.service import Gone, Service, authorized, read_body, service_of, through
from aiayn.serving.worker import ApiError

FORMS = ("application/x-www-form-urlencoded", "multipart/form-data")
LIBRE_KEYS = frozenset({"q", "source", "target", "format", "alternatives", "api_key"})


def is_libre(request: Request, body: bytes) -> bool:
    """Whether a /translate request is LibreTranslate's: a form, a query string with q, or a JSON body
    with its parameters and without aiayn's `text` (a body missing q is then told so in its words)."""
    kind = content_type(request.headers)
    if kind in FORMS or "q" in request.query_params:
        return True
    try:
        value = json.loads(body) if body else None
    except ValueError:
        return False
    return isinstance(value, dict) and "text" not in value and not LIBRE_KEYS.isdisjoint(value)


# LibreTranslate's own routes: every answer there, an error of the server's edge too (a key, a body too
# large, a route's wrong method, a bug), is in its shape, which its web page and clients read
ROUTES = (
    "/detect",
    "/languages",
    "/frontend/settings",
    "/translate_file",
    "/download_file",
    "/suggest",
    "/spec",
)


def speaks_libre(scope: dict) -> bool:
    """Whether an answer to this request (its ASGI scope) is in LibreTranslate's shape: on its routes, and
    on /translate when the parameters come as a form or in the query string (a JSON body is told apart
    by is_libre once it is read; an error before that is in aiayn's shape)."""
    path = scope.get("path", "")
    if path in ROUTES or path.startswith("/download_file/"):
        return True
    if path != "/translate":
        return False
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return content_type(Headers(scope=scope)) in FORMS or "q" in query


def content_type(headers: Headers) -> str:
    return headers.get("content-type", "").split(";")[0].strip().lower()


class LibreError(Exception):
    """An answer in LibreTranslate's shape."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def answer(error: LibreError | ApiError) -> JSONResponse:
    """LibreTranslate's error shape. aiayn's statuses for a request it cannot take (a text or list over its
    limits, 413; 422) are LibreTranslate's 400, as a model it has not (404); a body over --max-body-bytes
    keeps its 413 (LibreTranslate's server answers one too), a route's wrong method its 405, an unknown
    download its 404; overload and timeouts keep their 503 and Retry-After."""
    kind = getattr(error, "kind", None)
    mapped = (
        error.status in (413, 422) and kind != "too_large" or (error.status == 404 and kind != "not_found")
    )
    status = 400 if mapped else error.status
    headers = error.headers if isinstance(error, ApiError) else {}
    return JSONResponse(
        {"error": error.message}, status, headers=headers
    )  # (429: "Slowdown: ...", its words)


async def values_of(request: Request, body: bytes) -> dict[str, Any]:
    """The request's parameters: the query string's, overridden by the body's (JSON or form)."""
    values: dict[str, Any] = dict(request.query_params)
    kind = content_type(request.headers)
    if kind in FORMS:

        async def stream():  # the body, already read within the size limit
            yield body

        parser = FormParser if kind == FORMS[0] else MultiPartParser
        try:
            form = await parser(request.headers, stream()).parse()
        except Exception as e:  # python-multipart's errors have no common base
            raise LibreError(400, f"Invalid request: the form cannot be read ({e})") from None
        values.update({k: v for k, v in form.items() if isinstance(v, str)})
        # a form's text normalised to LF, as LibreTranslate does before it counts characters
        if isinstance(values.get("q"), str):
            values["q"] = "\n".join(values["q"].splitlines())
    elif body:
        try:
            parsed = json.loads(body)
        except ValueError:
            raise LibreError(400, "Invalid JSON format") from None
        if not isinstance(parsed, dict):
            raise LibreError(400, "Invalid JSON format")
        values.update(parsed)
    return values


def check_key(request: Request, service: Service, values: dict[str, Any]) -> None:
    """With --api-key, LibreTranslate's api_key parameter (or aiayn's Authorization header) must hold it:
    a wrong key is 403 as LibreTranslate's, a missing one 400 with its words."""
    if not service.api_key:
        return
    given = values.get("api_key")
    if given is None and authorized(request.headers, service.api_key):
        return
    if not given:
        raise LibreError(400, "Please contact the server operator to get an API key")
    if not (isinstance(given, str) and given == service.api_key):
        raise LibreError(403, "Invalid API key")


def not_supported(code: str) -> LibreError:
    return LibreError(400, f"{code} is not supported")


async def translate(request: Request, service: Service, body: bytes) -> Response:
    try:
        return await translate_values(request, service, await values_of(request, body))
    except (LibreError, ApiError) as e:
        if isinstance(e, ApiError) and e.status != 503:
            service.metrics.failures.labels(e.kind).inc()
        return answer(e)
    except Gone as e:
        return e.response


async def translate_values(request: Request, service: Service, values: dict[str, Any]) -> Response:
    check_key(request, service, values)
    q, source, target = values.get("q"), values.get("source"), values.get("target")
    for name, value in (("q", q), ("source", source), ("target", target)):
        if not value:
            raise LibreError(400, f"Invalid request: missing {name} parameter")
    if not (isinstance(q, str) or (isinstance(q, list) and all(isinstance(t, str) for t in q))):
        raise LibreError(400, "Invalid request: q must be a text or a list of texts")
    if not isinstance(source, str) or not isinstance(target, str):
        raise LibreError(400, "Invalid request: source and target are language codes")
    try:
        alternatives = max(0, int(values.get("alternatives", 0)))
    except (TypeError, ValueError):
        raise LibreError(400, "Invalid request: alternatives parameter is not a number") from None
    config = service.config
    if alternatives + 1 > config.max_beam:
        raise LibreError(400, f"Invalid request: alternatives parameter must be <= {config.max_beam - 1}")
    batch = isinstance(q, list)
    texts: list[str] = q if batch else [q]  # type: ignore[assignment]
    service.charge(request, len(texts))  # (LibreTranslate's cost of a request: its texts)
    if len(texts) > config.max_texts:
        raise LibreError(
            400, f"Invalid request: request ({len(texts)}) exceeds text limit ({config.max_texts})"
        )
    for text in texts:
        if len(text) > config.max_chars:
            raise LibreError(
                400, f"Invalid request: request ({len(text)}) exceeds text limit ({config.max_chars})"
            )
    text_format = values.get("format") or "text"
    if text_format not in ("text", "html"):
        raise LibreError(400, f"{text_format} format is not supported")
    plain = texts if text_format == "text" else [text_of_html(t) for t in texts]
    source, target, detected = await pair(service, source, target, plain)
    if source == target:  # LibreTranslate's identity translation: every text as it came
        return JSONResponse(identity(texts if batch else texts[0], detected, alternatives))
    n_best = alternatives + 1 if text_format == "text" else 1  # (html has no alternatives, as LibreTranslate)
    hops = service.models.route(source, target)
    documents, results, batch_size = await translated(
        request, service, hops, texts, text_format, source, n_best
    )
    outputs, alts = [], []
    for document, mine in by_document(documents, results):
        main = document.join([n_best[0][0] for n_best in mine])
        outputs.append(main)
        alts.append([] if text_format == "html" else alternatives_of(document, mine, main, alternatives))
    result: dict[str, Any] = {"translatedText": outputs if batch else outputs[0]}
    if detected is not None:
        result["detectedLanguage"] = [detected] * len(texts) if batch else detected
    if alternatives > 0:
        result["alternatives"] = alts if batch else alts[0]
    if len(hops) > 1:
        result["pivot"] = hops[0].target  # (not LibreTranslate's: it says nothing of its pivots)
    return JSONResponse(result, headers={"X-Batch-Size": str(batch_size)})


async def pair(
    service: Service, source: str, target: str, plain: list[str]
) -> tuple[str, str, dict[str, Any] | None]:
    """The source and target as the server names them, the source detected in the plain texts where it is
    "auto" (with what was detected); a language not served, or a pair no model reaches, is a 400."""
    models = service.models
    served = models.languages()
    source, target = served_code(source, served), served_code(target, served)
    detected = None
    if source == "auto":
        detected = await detected_language("\n".join(plain), models, target)
        source = detected["language"]
    if source not in served:
        raise not_supported(source)
    if target not in served:
        raise not_supported(target)
    if source != target and target not in models.targets(source):
        raise LibreError(400, f"{language_name(target)} ({target}) is not available as a target language from "
                         f"{language_name(source)} ({source})")  # fmt: skip
    return source, target, detected


async def translated(
    request: Request,
    service: Service,
    hops: list,
    texts: list[str],
    text_format: str,
    source: str,
    n_best: int,
) -> tuple[list[Document], list[list[tuple[str, float]]], int]:
    """Texts as documents (text or html) split into sentences, and each sentence's n-best translations
    through the hops, with the batch size they rode in. A sentence without a letter (a number, an emoji,
    a dash) comes back as it is, as LibreTranslate returns a text of emoji: a model has nothing to
    translate there, and would make something up."""
    split = split_html if text_format == "html" else split_text
    try:
        documents = [split(text, source) for text in texts]
    except ValueError as e:
        raise LibreError(400, f"Invalid request: {e}") from None
    sentences = [s for document in documents for s in document.sentences]
    words = [s for s in sentences if any(c.isalpha() for c in s)]
    found, batch_size = (
        await through(request, service, hops, words, None, n_best, "sentence", cut_long=True)
        if words
        else ([], 0)
    )
    translated_words = iter(found)
    results = [next(translated_words) if any(c.isalpha() for c in s) else [(s, 0.0)] for s in sentences]
    return documents, results, batch_size


def by_document(documents: list[Document], results: list) -> Iterator[tuple[Document, list]]:
    """Each document with the n-best lists of its sentences (results holds all documents' in order)."""
    start = 0
    for document in documents:
        yield document, results[start : start + len(document.sentences)]
        start += len(document.sentences)


def served_code(code: str, served: Collection[str]) -> str:
    """A language code as a client writes it, as the server names it: LibreTranslate reads codes in any
    case and takes a script's or a region's code (zh-Hans, zh-Hant, pt-BR) for a model of it; here one
    that no model names goes to the language's own code (zh, pt) where a model has that. Any other code
    is returned lower-cased, for the caller's "not supported"."""
    lowered = code.strip().lower()
    by_lower = {c.lower(): c for c in served}
    if lowered in by_lower or lowered == "auto":
        return by_lower.get(lowered, lowered)
    base = lowered.replace("_", "-").split("-")[0]
    return by_lower.get(base, lowered)


def identity(q: str | list[str], detected: dict[str, Any] | None, alternatives: int) -> dict[str, Any]:
    """The answer to a request whose source is its target (given, or detected): the text itself."""
    result: dict[str, Any] = {"translatedText": q}
    if detected is not None:
        result["detectedLanguage"] = [detected] * len(q) if isinstance(q, list) else detected
    if alternatives > 0:
        result["alternatives"] = [[] for _ in q] if isinstance(q, list) else []
    return result


def text_of_html(markup: str) -> str:
    """What a page says, for telling its language: its tags' names and attributes are not its language."""
    from bs4 import BeautifulSoup

    return BeautifulSoup(markup, "html.parser").get_text(" ")


def alternatives_of(
    document: Document, n_bests: list[list[tuple[str, float]]], main: str, count: int
) -> list[str]:
    """The k-th alternative of a document: the k-th hypothesis of each of its sentences (the best where a
    sentence has fewer), without repeats or the main translation, as LibreTranslate filters them."""
    seen, found = {main, ""}, []
    for k in range(1, count + 1):
        text = document.join([n_best[min(k, len(n_best) - 1)][0] for n_best in n_bests])
        if text not in seen:
            seen.add(text)
            found.append(text)
    return found


async def detected_language(text: str, models: Models, target: str) -> dict[str, Any]:
    """The language of text, among those served, that is best and is the target or translates into it
    (else the best: then the pair's error says why). One detector of all the languages served answers
    every request, rather than one a target (each holds its languages' models in memory). A text without
    a letter (emoji, numbers) has no language: LibreTranslate answers English with confidence 0 and
    returns the text, which the pipeline does for every sentence without a letter; here English where it
    reaches the target, else the first language served that does."""
    reaches = lambda code: code == target or target in models.targets(code)  # noqa: E731
    if not any(c.isalpha() for c in text):
        code = next((c for c in ["en", *sorted(models.languages())] if reaches(c)), "en")
        return {"confidence": 0.0, "language": code}
    found = await detected(text, models)
    code, confidence = next(((c, p) for c, p in found if reaches(c)), found[0])
    return {"confidence": confidence, "language": code}


async def detected(text: str, models: Models) -> list[tuple[str, float]]:
    """detect() among the languages served, off the event loop; what it cannot tell is a 400."""
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(None, detect, text, models.languages())
    except ValueError as e:
        raise LibreError(400, str(e)) from None


def warm_detector(models: Models) -> None:
    """Build the detector of the languages served before a first source=auto or /detect waits for it."""
    with contextlib.suppress(ValueError):
        detect("warm", models.languages())


async def detect_endpoint(request: Request) -> Response:
    """LibreTranslate's /detect: the (at most DETECTED) languages q may be in, among those served, best
    first, with whole-number confidences; q a text or a list of texts, whose candidates are merged (each
    language's mean confidence over the texts, ranked by its confidence weighted by the texts' lengths).
    No character limit, as LibreTranslate's (the body's limit holds). Text without a letter: English,
    confidence 0, as LibreTranslate."""
    service = service_of(request)
    try:
        values = await values_of(request, await read_body(request, service))
        check_key(request, service, values)
        service.charge(request)
        q = values.get("q")
        if not q:
            raise LibreError(400, "Invalid request: missing q parameter")
        if not (isinstance(q, str) or (isinstance(q, list) and all(isinstance(t, str) for t in q))):
            raise LibreError(400, "Invalid request: q must be a text or a list of texts")
        texts = [q] if isinstance(q, str) else [t for t in q if t]
        found = [await detected(t, service.models) if any(c.isalpha() for c in t) else [] for t in texts]
    except (LibreError, ApiError) as e:
        return answer(e)
    return JSONResponse(merged(texts, found))


DETECTED = 3  # the languages /detect names at most, as LibreTranslate


def merged(texts: list[str], found: list[list[tuple[str, float]]]) -> list[dict[str, Any]]:
    """The candidates of each text, DETECTED best each, merged over the texts (detect_endpoint)."""
    confidences: dict[str, list[float]] = {}
    weights: dict[str, float] = {}
    for text, candidates in zip(texts, found):
        for code, confidence in candidates[:DETECTED]:
            confidences.setdefault(code, []).append(confidence)
            weights[code] = weights.get(code, 0.0) + confidence * len(text)
    if not confidences:
        return [{"confidence": 0.0, "language": "en"}]
    ranked = sorted(confidences, key=lambda code: -weights[code])[:DETECTED]
    return [
        {"confidence": float(round(sum(confidences[c]) / len(confidences[c]))), "language": c} for c in ranked
    ]


async def languages_endpoint(request: Request) -> Response:
    """LibreTranslate's /languages: every language served, its English name and what it translates into
    (through a pivot too)."""
    models = service_of(request).models
    return JSONResponse([
        {"code": code, "name": language_name(code), "targets": models.targets(code)}
        for code in sorted(models.languages())
    ])  # fmt: skip


async def settings_endpoint(request: Request) -> Response:
    """LibreTranslate's /frontend/settings, which its web page and some clients read first: the limit of
    characters, whether a key is needed, what is not offered (suggestions, files), the default pair."""
    service = service_of(request)
    targets = sorted({t for s in service.models.sources() for t in service.models.targets(s)})
    target = "en" if "en" in targets else (targets[0] if targets else "en")
    return JSONResponse({
        "charLimit": service.config.max_chars,
        "frontendTimeout": 500,  # (LibreTranslate's default: how long its page waits after typing, in ms)
        "apiKeys": bool(service.api_key),
        "keyRequired": bool(service.api_key),
        "suggestions": False,
        "filesTranslation": service.config.files_translation,
        "supportedFilesFormat": list(FORMATS) if service.config.files_translation else [],
        "language": {
            "source": {"code": "auto", "name": "Auto Detect"},
            "target": {"code": target, "name": language_name(target)},
        },
    })  # fmt: skip


# --- Files: /translate_file and /download_file ---------------------------------------------------------

FILES_DISABLED = "Files translation are disabled on this server."
FILE_LIFETIME_S = 30 * 60  # how long a translated file waits for its download (LibreTranslate's)
FILE_CHUNK = 256  # a file's sentences go to the worker this many at a time: a long file never fills its queue


class TranslatedFiles:
    """The translated files /download_file serves, in a directory of the server's own, each kept
    FILE_LIFETIME_S after it was written; the directory goes with the server (close)."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="aiayn-files-"))

    def keep(self, name: str, data: bytes) -> str:
        """Store a translated file; the name /download_file knows it by (a random prefix, then name)."""
        self.forget_old()
        filename = f"{uuid.uuid4().hex}.{name}"
        atomic_write(self.directory / filename, lambda tmp: tmp.write_bytes(data))
        return filename

    def find(self, filename: str) -> Path:
        if "/" in filename or "\\" in filename or filename.startswith(".") or "." not in filename:
            raise LibreError(400, "Invalid filename")
        path = self.directory / filename
        if not path.is_file() or time.time() - path.stat().st_mtime > FILE_LIFETIME_S:
            raise ApiError(404, "not_found", f"no file {filename} (a translated file is kept 30 minutes)")
        return path

    def forget_old(self) -> None:
        for path in self.directory.iterdir():
            with contextlib.suppress(OSError):
                if time.time() - path.stat().st_mtime > FILE_LIFETIME_S:
                    path.unlink()

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


async def translate_file_endpoint(request: Request) -> Response:
    """LibreTranslate's /translate_file: a multipart form with `file` (one of file_formats.FORMATS), `source`
    (or "auto"), `target` and `api_key`; answers {"translatedFileUrl": the /download_file URL}. The file is
    limited by --max-body-bytes; each paragraph is translated whole (file_formats.py)."""
    service = service_of(request)
    try:
        if not service.config.files_translation:
            raise LibreError(403, FILES_DISABLED)
        values, upload = await file_form(request, service)
        check_key(request, service, values)
        service.charge(request)
        source, target = values.get("source"), values.get("target")
        for name, value in (("file", upload), ("source", source), ("target", target)):
            if not value:
                raise LibreError(400, f"Invalid request: missing {name} parameter")
        filename = Path(upload.filename or "").name  # type: ignore[union-attr]
        stem, extension = os.path.splitext(filename)
        if not stem:
            raise LibreError(400, "Invalid request: empty file")
        if extension.lower() not in FORMATS:
            raise LibreError(400, "Invalid request: file format not supported")
        try:
            opened = open_file(await upload.read(), extension)  # type: ignore[union-attr]
        except ValueError as e:
            raise LibreError(400, f"Invalid request: {e}") from None
        texts = [slot.text for slot in opened.slots]
        text_format = "html" if opened.markup else "text"
        plain = texts if text_format == "text" else [text_of_html(t) for t in texts]
        # a file's language told from its start, as LibreTranslate's (4,096 characters)
        source, target, _ = await pair(service, str(source), str(target), ["\n".join(plain)[:4096]])
        outputs = (
            texts
            if source == target
            else await translated_texts(request, service, texts, text_format, source, target)
        )
        for slot, output in zip(opened.slots, outputs):
            slot.put(output)
        name = request.app.state.files.keep(f"{stem}_{target}{extension}", opened.save())
    except (LibreError, ApiError) as e:
        return answer(e)
    except Gone as e:
        return e.response
    return JSONResponse({"translatedFileUrl": str(request.url_for("download_file", filename=name))})


async def translated_texts(
    request: Request, service: Service, texts: list[str], text_format: str, source: str, target: str
) -> list[str]:
    """Each text (a file's paragraph) translated whole, FILE_CHUNK sentences at a time."""
    hops = service.models.route(source, target)
    outputs: list[str] = []
    chunk: list[str] = []
    counted = 0
    for i, text in enumerate(texts):
        chunk.append(text)
        counted += max(1, len(text) // 80)  # about a sentence every 80 characters
        if counted >= FILE_CHUNK or i == len(texts) - 1:
            documents, results, _ = await translated(request, service, hops, chunk, text_format, source, 1)
            outputs += [
                d.join([n_best[0][0] for n_best in mine]) for d, mine in by_document(documents, results)
            ]
            chunk, counted = [], 0
    return outputs


async def file_form(request: Request, service: Service) -> tuple[dict[str, Any], Any]:
    """The multipart form of /translate_file, within the body's limit: its text fields and its file."""
    body = await read_body(request, service)
    if content_type(request.headers) != "multipart/form-data":
        raise LibreError(400, "Invalid request: missing file parameter")

    async def stream():  # the body, already read within the size limit
        yield body

    try:
        form = await MultiPartParser(request.headers, stream()).parse()
    except Exception as e:  # python-multipart's errors have no common base
        raise LibreError(400, f"Invalid request: the form cannot be read ({e})") from None
    values = dict(request.query_params)
    values.update({k: v for k, v in form.items() if isinstance(v, str)})
    upload = form.get("file")
    return values, None if isinstance(upload, str) else upload


async def download_file_endpoint(request: Request, filename: str) -> Response:
    """LibreTranslate's /download_file/NAME: a file /translate_file translated, as an attachment named
    without its random prefix."""
    service = service_of(request)
    try:
        if not service.config.files_translation:
            raise LibreError(400, FILES_DISABLED)
        path = request.app.state.files.find(filename)
    except (LibreError, ApiError) as e:
        return answer(e)
    return FileResponse(path, filename=filename.split(".", 1)[1], media_type="application/octet-stream")


async def suggest_endpoint(request: Request) -> Response:
    """LibreTranslate's /suggest, as it answers with suggestions off (its default): aiayn keeps none."""
    return answer(LibreError(403, "Suggestions are disabled on this server."))


async def spec_endpoint(request: Request) -> Response:
    """LibreTranslate's /spec: the API's description (FastAPI's OpenAPI document of this server)."""
    return JSONResponse(request.app.openapi())
