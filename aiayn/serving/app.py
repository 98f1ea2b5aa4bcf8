"""The HTTP API of `aiayn serve` (FastAPI): /translate, /attention, /health, /info, /metrics and the page.
Every error is one JSON shape with a machine-readable type: {"error": {"type": ..., "message": ...}}; 4xx
for the client's mistakes, 503 for overload, never a traceback. The model runs in the worker (worker.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException

import aiayn
from aiayn.config import SearchConfig, ServeConfig
from aiayn.inference.search import Hypothesis
from aiayn.inference.translate import Translator
from aiayn.inference.warmup import Warmup
from aiayn.precision import translation_dtype
from aiayn.serving.worker import STARTING, STOPPED, ApiError, Call, Line, Metrics, Pending, Worker, log
from aiayn.tokenizer import BOS_ID

STATIC = Path(__file__).parent / "static"
SECURITY_HEADERS = MappingProxyType(
    {
        "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",  # no inline script, no framing
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "no-referrer",
    }
)
# --- Requests ----------------------------------------------------------------------------------------


class TranslateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | list[str]
    beam_size: int | None = Field(default=None, ge=1)
    n_best: int = Field(default=1, ge=1)


class AttentionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str


@dataclass
class Service:
    """Everything a request handler needs: the model's translator and the worker that runs it."""

    translator: Translator  # the PyTorch model: attention always, translation with engine "torch"
    config: ServeConfig
    worker: Worker
    metrics: Metrics
    info: dict[str, Any]
    warmup: Warmup | None = None  # the compile of the decoding graphs in the background, if there is one
    closing: bool = False

    def ready(self) -> bool:
        """Whether /health says ok: the worker is taking jobs, and where the server was told to wait for
        its compiled graphs (ready_when_compiled), they are in."""
        if self.warmup is not None and self.config.ready_when_compiled:
            return self.warmup.progress.state in ("done", "failed")
        return True


def create_app(
    translator: Translator,
    config: ServeConfig | None = None,
    *,
    engine: Any = None,
    threads: int | None = None,
    api_key: str | None = None,
    cors_origins: tuple[str, ...] = (),
    engine_name: str = "torch",
    compile_workers: int = 2,
) -> FastAPI:
    """The FastAPI app around a Translator. engine: another translator for /translate (CTranslate2's,
    with the same translate_ids), the Translator itself when None."""
    config = config or ServeConfig()
    metrics = Metrics()
    translate = (engine or translator).translate_ids
    # compiled decoding: the graphs of the default search, for every class of batch the worker makes, are
    # compiled (or loaded from the store) by worker processes in the background while batches decode
    # eagerly; each class moves to its graphs when they are in. Another search decodes eagerly, unless an
    # earlier --compile stored its graphs.
    warmup = None
    if engine is None and translator.compiled is not None:
        default = replace(translator.search_config, beam_size=config.beam_size)
        warmup = translator.compile_in_background(
            default, config.batch_sentences, log.warning, compile_workers
        )
    worker = Worker(translate, config, metrics, threads)
    info = describe_service(translator, config, engine_name)
    service = Service(translator, config, worker, metrics, info, warmup)
    metrics.follow(warmup)
    app = FastAPI(title="aiayn", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_middleware(Edge, metrics=metrics, api_key=api_key)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])  # fmt: skip
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(Exception, bug)  # a bug: logged by the server, never shown to the client
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_api_route("/translate", translate_endpoint, methods=["POST"])
    app.add_api_route("/attention", attention_endpoint, methods=["POST"])
    for path, endpoint in (
        ("/health", health),
        ("/info", info_endpoint),
        ("/metrics", metrics_endpoint),
        ("/", page),
    ):
        app.add_api_route(path, endpoint, methods=["GET"])
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def describe_service(translator: Translator, config: ServeConfig, engine_name: str) -> dict[str, Any]:
    """What /info says: the version, the engine, device and number format, the model's shape, the default
    search and the limits."""
    model = translator.model
    return {
        "version": aiayn.__version__,
        "engine": engine_name,
        "device": str(translator.device),
        "dtype": translation_dtype(translator.dtype, translator.device),
        "model": {
            "parameters": sum(p.numel() for p in translator.model.parameters()),
            **{
                k: getattr(model.config, k)
                for k in (
                    "d_model",
                    "d_ff",
                    "n_heads",
                    "n_encoder_layers",
                    "n_decoder_layers",
                    "src_vocab_size",
                    "tgt_vocab_size",
                    "norm",
                    "positions",
                )
            },
        },  # fmt: skip
        "search": {
            "beam_size": config.beam_size,
            "alpha": translator.search_config.alpha,
            "length_penalty": translator.search_config.length_penalty,
        },
        "limits": {k: v for k, v in vars(config).items() if k.startswith(("max_", "timeout", "batch_"))},
    }


# --- The handlers: each finds the app's Service in request.app.state ------------------------------------


def service_of(request: Request) -> Service:
    return request.app.state.service


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    service = app.state.service
    service.worker.start()
    if service.warmup is not None:
        service.warmup.start()
    yield
    service.closing = True  # new requests get 503; those queued are answered
    loop = asyncio.get_running_loop()
    if service.warmup is not None:  # first, and at once: the workers' compiles are of no use now
        await loop.run_in_executor(None, service.warmup.stop)
    await loop.run_in_executor(None, service.worker.stop, service.config.timeout_s)


async def api_error(request: Request, e: ApiError) -> JSONResponse:
    return error_response(e, service_of(request).metrics)


async def bug(request: Request, e: Exception) -> JSONResponse:
    return error_response(ApiError(500, "internal", "internal error"), service_of(request).metrics)


async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
    return error_response(ApiError(e.status_code, kind, str(e.detail)), service_of(request).metrics)


async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    return error_response(ApiError(422, "invalid_request", describe(e.errors())), service_of(request).metrics)


async def translate_endpoint(request: Request) -> Response:
    service = service_of(request)
    config, translator = service.config, service.translator
    body = await parse(request, TranslateRequest, service)
    texts = [body.text] if isinstance(body.text, str) else body.text
    if len(texts) > config.max_texts:
        raise ApiError(
            413, "too_many_texts", f"{len(texts)} texts in one request; the limit is {config.max_texts}"
        )
    search = search_config(body, service)
    lines, jobs = [], []
    pending = new_pending(request, service, lines)
    for t, text in enumerate(texts):
        check_text(text, service, f"text {t + 1}")
        for line in text.split("\n"):
            ids = translator.tokenizer.encode_src([line])[0]
            check_tokens(ids, service, f"text {t + 1}")
            lines.append(t)
            jobs.append(Line(ids, search, pending, len(jobs), time.monotonic()))
    pending.lines = len(jobs)
    if not jobs:
        return JSONResponse({"translations": []})
    results = await wait(request, pending, lambda: service.worker.submit(jobs), service)
    return translation_response(results, lines, len(texts), body.n_best, translator, pending.batch_size)


async def attention_endpoint(request: Request) -> Response:
    service = service_of(request)
    translator = service.translator
    body = await parse(request, AttentionRequest, service)
    if "\n" in body.text.strip() or not body.text.strip():
        raise ApiError(400, "invalid_request", "/attention takes one sentence: one non-empty line")
    check_text(body.text, service, "text")
    ids = translator.tokenizer.encode_src([body.text])[0]
    check_tokens(ids, service, "text")
    pending = new_pending(request, service, [0])
    job = Call(lambda: attention(translator, ids), pending)
    return JSONResponse(await wait(request, pending, lambda: service.worker.submit([job]), service))


async def health(request: Request) -> Response:
    service = service_of(request)
    if not service.worker.alive:
        raise ApiError(503, "unavailable", STOPPED)
    if not service.ready():
        raise ApiError(503, "starting", STARTING, {"Retry-After": "5"})
    if service.closing:
        raise ApiError(503, "shutting_down", "the server is shutting down")
    return JSONResponse({"status": "ok"})


async def info_endpoint(request: Request) -> Response:
    service = service_of(request)
    if service.warmup is None:
        return JSONResponse(service.info)
    return JSONResponse({**service.info, "compiled": service.warmup.progress.as_dict()})


async def metrics_endpoint(request: Request) -> Response:
    return Response(generate_latest(service_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def page(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", media_type="text/html")


class Edge:
    """ASGI middleware at the edge of the app: the API key, security headers, request metrics. (Plain
    ASGI: Starlette's BaseHTTPMiddleware would hide a client's disconnect from the endpoints.)"""

    def __init__(self, app: Any, metrics: Metrics, api_key: str | None):
        self.app, self.metrics, self.api_key = app, metrics, api_key

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        start, status = time.perf_counter(), [500]
        headers = Headers(scope=scope)
        body_done = [not ("content-length" in headers or "transfer-encoding" in headers)]

        async def receive_tracked() -> dict:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done[0] = True
            return message

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                if not body_done[0]:  # an early answer (401, 413, ...): read what the client still sends
                    await drain(receive_tracked, body_done)
                status[0] = message["status"]
                MutableHeaders(scope=message).update(SECURITY_HEADERS)
            await send(message)

        try:
            if self.api_key and endpoint in PROTECTED and not authorized(headers, self.api_key):
                error = ApiError(401, "unauthorized", "a valid API key is needed: Authorization: Bearer KEY",
                                 {"WWW-Authenticate": "Bearer"})  # fmt: skip
                await error_response(error, self.metrics)(scope, receive_tracked, send_with_headers)
            else:
                await self.app(scope, receive_tracked, send_with_headers)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)


# An answer sent before the request's body was read (a key refused, a body too large) is sent after
# reading the rest of the body, up to these bounds: a server that answers and closes with the body
# unread resets the connection, and a client still sending it (urllib, requests: no 100-continue) gets
# "connection reset" instead of the answer. Past the bounds the answer goes out anyway.
DRAIN_BYTES = 64 << 20
DRAIN_SECONDS = 10.0


async def drain(receive: Callable, body_done: list[bool]) -> None:
    """Read and drop the rest of a request's body, within DRAIN_BYTES and DRAIN_SECONDS."""

    async def read() -> None:
        seen = 0
        while not body_done[0] and seen <= DRAIN_BYTES:
            seen += len((await receive()).get("body", b""))

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(read(), DRAIN_SECONDS)


ENDPOINTS = ("/translate", "/attention", "/health", "/info", "/metrics", "/")
PROTECTED = ("/translate", "/attention", "/info", "/metrics")


def authorized(headers: Headers, api_key: str) -> bool:
    given = headers.get("authorization", "")
    return given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), api_key.encode())


def error_response(e: ApiError, metrics: Metrics) -> JSONResponse:
    if e.status != 503:  # (overload and timeout count themselves where they happen)
        metrics.failures.labels(e.kind).inc()
    return JSONResponse({"error": {"type": e.kind, "message": e.message}}, e.status, headers=e.headers)


def describe(errors: list[dict[str, Any]]) -> str:
    """pydantic's errors as one line: where and what."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg', 'invalid')}"
        for e in errors
    )


async def parse(request: Request, model: type[BaseModel], service: Service) -> Any:
    """The JSON body, within the size limit, as `model` (unknown fields refused)."""
    if service.closing:
        raise ApiError(503, "shutting_down", "the server is shutting down", {"Retry-After": "1"})
    limit = service.config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "too_large", f"the request body has {declared} bytes; the limit is {limit}")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, "too_large", f"the request body has more than {limit} bytes")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise ApiError(422, "invalid_request", describe(e.errors())) from None


def search_config(body: TranslateRequest, service: Service) -> SearchConfig:
    config = service.config
    beam = body.beam_size or config.beam_size
    if beam > config.max_beam or body.n_best > config.max_beam:
        raise ApiError(422, "invalid_request", f"beam_size and n_best are at most {config.max_beam}")
    return replace(service.translator.search_config, beam_size=beam).with_n_best(body.n_best)


def check_text(text: str, service: Service, what: str) -> None:
    limit = service.config.max_chars
    if len(text) > limit:
        raise ApiError(413, "too_long", f"{what} has {len(text)} characters; the limit is {limit}")


def check_tokens(ids: list[int], service: Service, what: str) -> None:
    limit = service.config.max_tokens
    if len(ids) - 1 > limit:
        raise ApiError(413, "too_long", f"a line of {what} has {len(ids) - 1} tokens; the limit is {limit}")


def new_pending(request: Request, service: Service, lines: list[int]) -> Pending:
    loop = asyncio.get_running_loop()
    return Pending(len(lines), time.monotonic() + service.config.timeout_s, loop.create_future(), loop)


async def wait(request: Request, pending: Pending, submit: Callable[[], None], service: Service) -> Any:
    """Queue the request's work and wait for its answer, its deadline, or its client to go."""
    submit()
    watcher = asyncio.create_task(gone(request))
    try:
        done, _ = await asyncio.wait(
            {pending.done, watcher}, timeout=service.config.timeout_s + 1, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        watcher.cancel()
    if pending.done in done:
        return pending.done.result()  # an ApiError raised by the worker comes out here
    pending.gone = True  # the worker drops what is left of it
    if watcher in done:
        return Response(status_code=499)  # nobody is listening; nginx's code for it
    service.metrics.failures.labels("timeout").inc()
    raise ApiError(503, "timeout", "the request timed out", {"Retry-After": "1"})


async def gone(request: Request) -> None:
    """Returns when the client disconnects: once the body is read, the next ASGI message is the
    disconnect (no polling: 64 waiting requests polling 20 times a second took a quarter of the
    event loop's time)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def translation_response(
    results: Any, lines: list[int], n_texts: int, n_best: int, translator: Translator, batch_size: int
) -> Response:
    if isinstance(results, Response):
        return results
    decode = translator.tokenizer.decode_tgt
    per_text: list[list[list[Hypothesis]]] = [[] for _ in range(n_texts)]
    for index, text in enumerate(lines):
        per_text[text].append(results[index])
    translations, alternatives = [], []
    for hyps_of_lines in per_text:
        translations.append("\n".join(decode([h[0].tokens for h in hyps_of_lines])))
        if n_best > 1:  # the k-th alternative of a text: the k-th of each of its lines
            k_max = min(len(h) for h in hyps_of_lines)
            alternatives.append([
                {"text": "\n".join(decode([h[k].tokens for h in hyps_of_lines])),
                 "score": sum(h[k].score for h in hyps_of_lines)}
                for k in range(k_max)
            ])  # fmt: skip
    payload: dict[str, Any] = {"translations": translations}
    if n_best > 1:
        payload["n_best"] = alternatives
    return JSONResponse(payload, headers={"X-Batch-Size": str(batch_size)})


def attention(translator: Translator, ids: list[int]) -> dict[str, Any]:
    """Greedy translation of one sentence and the attention of every layer and head over it."""
    tokens, maps = translator.attention(ids)
    tgt_in = [BOS_ID, *tokens]
    tokenizer = translator.tokenizer
    return {
        "source_tokens": tokenizer.labels(ids, "src"),
        "target_tokens": tokenizer.labels(tgt_in, "tgt"),
        "translation": tokenizer.decode_tgt([tokens])[0],
        **{kind: [layer[0].float().cpu().tolist() for layer in layers] for kind, layers in maps.items()},
    }
