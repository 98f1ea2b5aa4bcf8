"""The HTTP API of `aiayn serve` (FastAPI): aiayn's own /translate (a body with `text`), /attention,
/health, /info, /metrics and the page, beside LibreTranslate's API (libre.py) at the paths its clients call.
aiayn's errors are one JSON shape with a machine-readable type: {"error": {"type": ..., "message": ...}};
4xx for the client's mistakes, 503 for overload, never a traceback. The models are models.py's, run by the
worker (worker.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
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
from aiayn.config import InferenceOptions, ServeConfig
from aiayn.inference.translate import Translator
from aiayn.precision import translation_dtype
from aiayn.serving import libre
from aiayn.serving.models import Loaded, Models, ServedModel, prepared
from aiayn.serving.service import (
    Gone,
    Service,
    authorized,
    check_text,
    check_tokens,
    new_pending,
    read_body,
    route,
    service_of,
    through,
    wait,
)  # fmt: skip
from aiayn.serving.worker import STARTING, STOPPED, ApiError, Call, Metrics, Worker, log
from aiayn.tokenizer import BOS_ID

STATIC = Path(__file__).parent / "static"
# CORS: every origin on every route, as LibreTranslate answers (web pages and browser extensions served
# from elsewhere call it); `--cors-origin` narrows it. Preflights are cached for LibreTranslate's 20 days.
ANY_ORIGIN = ("*",)
CORS_MAX_AGE = 20 * 24 * 3600
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
    model: str | None = None  # a model by its directory's name; or the languages:
    source: str | None = None
    target: str | None = None


class AttentionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str
    model: str | None = None
    source: str | None = None
    target: str | None = None


def create_app(
    served: Translator | Models,
    config: ServeConfig | None = None,
    *,
    engine: Any = None,
    threads: int | None = None,
    api_key: str | None = None,
    cors_origins: tuple[str, ...] = ANY_ORIGIN,
    engine_name: str = "torch",
    compile_workers: int = 2,
    options: InferenceOptions | None = None,
) -> FastAPI:
    """The FastAPI app around the server's Models (server.py builds them), or around one Translator:
    then `engine` translates for it when given (CTranslate2's, with the same translate_ids), and its
    graphs compile in the background when it decodes compiled."""
    config = config or ServeConfig()
    metrics = Metrics()
    if isinstance(served, Translator):
        translator = served
        options = options or InferenceOptions(device=str(translator.device), dtype=translator.dtype,
                                              engine="ctranslate2" if engine is not None else "torch")  # fmt: skip
        loaded = (
            Loaded("model", translator, engine) if engine is not None
            else prepared("model", translator, options, config, compile_workers)
        )  # fmt: skip
        served = Models([ServedModel("model", None, 0, loaded)], lambda model: loaded, 1, metrics)
    served.metrics = metrics
    options = options or InferenceOptions()
    worker = Worker(config, metrics, threads)
    info = describe_server(served, config, engine_name, options)
    service = Service(served, config, worker, metrics, info, api_key)
    app = FastAPI(title="aiayn", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_middleware(Edge, metrics=metrics, api_key=api_key)
    if cors_origins:  # outermost: its headers go on every answer, the Edge's errors included
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], expose_headers=["X-Batch-Size"],
                           max_age=CORS_MAX_AGE)  # fmt: skip
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(Exception, bug)  # a bug: logged by the server, never shown to the client
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Gone, client_gone)
    app.add_api_route("/translate", translate_endpoint, methods=["POST"])
    app.add_api_route("/attention", attention_endpoint, methods=["POST"])
    app.add_api_route("/detect", libre.detect_endpoint, methods=["POST"])
    app.add_api_route("/translate_file", libre.translate_file_endpoint, methods=["POST"])
    app.add_api_route("/download_file/{filename}", libre.download_file_endpoint, methods=["GET"],
                      name="download_file")  # fmt: skip
    app.add_api_route("/suggest", libre.suggest_endpoint, methods=["POST"])
    app.add_api_route("/spec", libre.spec_endpoint, methods=["GET"])
    app.state.files = libre.TranslatedFiles()
    for path, endpoint in (
        ("/health", health),
        ("/info", info_endpoint),
        ("/metrics", metrics_endpoint),
        ("/languages", libre.languages_endpoint),
        ("/frontend/settings", libre.settings_endpoint),
        ("/", page),
    ):
        app.add_api_route(path, endpoint, methods=["GET"])
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


def describe_server(models: Models, config: ServeConfig, engine_name: str, options: InferenceOptions) -> dict:
    """What /info says of the server: the version, the engine, device and number format, the limits."""
    first = next((m.loaded.translator for m in models.served if m.loaded is not None), None)
    if first is not None:
        device, dtype = first.device, translation_dtype(first.dtype, first.device)
    else:
        from aiayn.precision import resolve_device

        device = resolve_device(options.device)
        dtype = translation_dtype(options.dtype, device)
    return {
        "version": aiayn.__version__,
        "engine": engine_name,
        "device": str(device),
        "dtype": dtype,
        "limits": {k: v for k, v in vars(config).items() if k.startswith(("max_", "timeout", "batch_"))},
    }


SHAPE = ("d_model", "d_ff", "n_heads", "n_encoder_layers", "n_decoder_layers", "src_vocab_size",
         "tgt_vocab_size", "norm", "positions")  # fmt: skip


def describe_model(model: ServedModel, config: ServeConfig) -> dict[str, Any]:
    """What /info says of a model: its name, languages, state, shape, default search and compile."""
    loaded = model.loaded
    translator = loaded.translator if loaded is not None else None
    model_config = (
        translator.model.config if translator is not None else model.model_dir.config  # type: ignore[union-attr]
    )
    search = translator.search_config if translator is not None else model.model_dir.search  # type: ignore[union-attr]
    languages = model.languages
    described: dict[str, Any] = {
        "name": model.name,
        "languages": None
        if languages is None
        else {"source": list(languages.source), "target": list(languages.target)},  # fmt: skip
        "state": model.state(),
        "memory_mb": round(model.charge / (1 << 20), 1),
        "model": {k: getattr(model_config, k) for k in SHAPE},
        "search": {
            "beam_size": config.beam_size,
            "alpha": search.alpha,
            "length_penalty": search.length_penalty,
        },
    }
    if translator is not None:
        described["model"]["parameters"] = sum(p.numel() for p in translator.model.parameters())
    if model.error is not None:
        described["error"] = model.error
    if loaded is not None and loaded.warmup is not None:
        described["compiled"] = loaded.warmup.progress.as_dict()
    return described


# --- The handlers: each finds the app's Service in request.app.state ------------------------------------


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    service = app.state.service
    service.worker.start()
    service.models.start()
    if len(service.models.languages()) > 1:  # a server of many languages: its detector built meanwhile
        asyncio.get_running_loop().run_in_executor(None, libre.warm_detector, service.models)
    yield
    service.closing = True  # new requests get 503; those queued are answered
    loop = asyncio.get_running_loop()
    # first, and at once: the compiles in the background are of no use now
    await loop.run_in_executor(None, service.models.stop)
    await loop.run_in_executor(None, service.worker.stop, service.config.timeout_s)
    app.state.files.close()


async def api_error(request: Request, e: ApiError) -> JSONResponse:
    return error_response(e, service_of(request).metrics, libre.speaks_libre(request.scope))


async def bug(request: Request, e: Exception) -> JSONResponse:
    log.error("a bug answered 500: %r", e, exc_info=e)
    error = ApiError(500, "internal", "internal error")
    return error_response(error, service_of(request).metrics, libre.speaks_libre(request.scope))


async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
    error = ApiError(e.status_code, kind, str(e.detail))
    return error_response(error, service_of(request).metrics, libre.speaks_libre(request.scope))


async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    return error_response(ApiError(422, "invalid_request", describe(e.errors())), service_of(request).metrics)


async def client_gone(request: Request, e: Gone) -> Response:
    return e.response


async def translate_endpoint(request: Request) -> Response:
    """aiayn's own request (a JSON body with `text`: each line translated as it is), or LibreTranslate's
    (`q`, as JSON, a form or the query string: documents split into sentences)."""
    service = service_of(request)
    body = await read_body(request, service)
    if not libre.is_libre(request, body):
        return await own_translate(request, service, body)
    return await libre.translate(request, service, body)


async def own_translate(request: Request, service: Service, raw: bytes) -> Response:
    config = service.config
    check_key(request, service)
    body = validated(raw, TranslateRequest)
    texts = [body.text] if isinstance(body.text, str) else body.text
    service.charge(request, len(texts))
    if len(texts) > config.max_texts:
        raise ApiError(
            413, "too_many_texts", f"{len(texts)} texts in one request; the limit is {config.max_texts}"
        )
    for t, text in enumerate(texts):
        check_text(text, service, f"text {t + 1}")
    lines, sentences = [], []
    for t, text in enumerate(texts):
        for line in text.split("\n"):
            lines.append(t)
            sentences.append(line)
    hops = route(service, body.model, body.source, body.target)
    results, batch_size = await through(request, service, hops, sentences, body.beam_size, body.n_best)
    per_text: list[list[list[tuple[str, float]]]] = [[] for _ in texts]
    for index, text in enumerate(lines):
        per_text[text].append(results[index])
    translations, alternatives = [], []
    for of_lines in per_text:
        translations.append("\n".join(n_best[0][0] for n_best in of_lines))
        if body.n_best > 1:  # the k-th alternative of a text: the k-th of each of its lines
            k_max = min(len(n_best) for n_best in of_lines)
            alternatives.append([
                {"text": "\n".join(n_best[k][0] for n_best in of_lines),
                 "score": sum(n_best[k][1] for n_best in of_lines)}
                for k in range(k_max)
            ])  # fmt: skip
    payload: dict[str, Any] = {"translations": translations}
    if body.n_best > 1:
        payload["n_best"] = alternatives
    if len(hops) > 1:
        payload["pivot"] = hops[0].target
    return JSONResponse(payload, headers={"X-Batch-Size": str(batch_size)})


async def attention_endpoint(request: Request) -> Response:
    service = service_of(request)
    body = validated(await read_body(request, service), AttentionRequest)
    service.charge(request)
    if "\n" in body.text.strip() or not body.text.strip():
        raise ApiError(400, "invalid_request", "/attention takes one sentence: one non-empty line")
    check_text(body.text, service, "text")
    hops = route(service, body.model, body.source, body.target)
    if len(hops) > 1:
        raise ApiError(
            400, "invalid_request", "attention is of one model: no model translates this pair alone"
        )
    hop = hops[0]
    async with service.models.using(hop.model) as loaded:
        translator = loaded.translator
        ids = translator.tokenizer.encode_src([hop.model.prefix(hop.target) + body.text])[0]
        check_tokens(ids, service, "text")
        pending = new_pending(request, service, 1)
        job = Call(lambda: attention(translator, ids), pending, loaded)
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
    """The server, and each of its models; a server of one model also says that model's at the top."""
    service = service_of(request)
    models = [describe_model(m, service.config) for m in service.models.served]
    info = {**service.info, "models": models}
    if len(models) == 1:
        info.update({k: v for k, v in models[0].items() if k in ("model", "search", "compiled")})
    return JSONResponse(info)


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
            # /translate and /detect: a key in the Authorization header is checked here, before the body
            # is read; LibreTranslate's in the body, by the handler
            guarded = endpoint in PROTECTED or (endpoint in BODY_KEYS and "authorization" in headers)
            if self.api_key and guarded and not authorized(headers, self.api_key):
                error = ApiError(401, "unauthorized", "a valid API key is needed: Authorization: Bearer KEY",
                                 {"WWW-Authenticate": "Bearer"})  # fmt: skip
                answer = error_response(error, self.metrics, libre.speaks_libre(scope))
                await answer(scope, receive_tracked, send_with_headers)
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


ENDPOINTS = ("/translate", "/attention", "/detect", "/languages", "/frontend/settings", "/health", "/info", "/metrics",
             "/translate_file", "/suggest", "/spec", "/")  # fmt: skip
# (/translate and /detect check their keys themselves: LibreTranslate's clients send theirs in the body)
PROTECTED = ("/attention", "/info", "/metrics")
BODY_KEYS = ("/translate", "/detect", "/translate_file")


def error_response(e: ApiError, metrics: Metrics, libre_shape: bool = False) -> JSONResponse:
    """aiayn's error shape, or LibreTranslate's for a request of its API (libre.speaks_libre)."""
    if e.status != 503:  # (overload and timeout count themselves where they happen)
        metrics.failures.labels(e.kind).inc()
    if libre_shape:
        return libre.answer(e)
    return JSONResponse({"error": {"type": e.kind, "message": e.message}}, e.status, headers=e.headers)


def describe(errors: list[dict[str, Any]]) -> str:
    """pydantic's errors as one line: where and what."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg', 'invalid')}"
        for e in errors
    )


def validated(body: bytes, model: type[BaseModel]) -> Any:
    """A JSON body as `model` (unknown fields refused)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise ApiError(422, "invalid_request", describe(e.errors())) from None


def check_key(request: Request, service: Service) -> None:
    """aiayn's own requests give the key as Authorization: Bearer KEY (LibreTranslate's, in api_key)."""
    if service.api_key and not authorized(request.headers, service.api_key):
        raise ApiError(401, "unauthorized", "a valid API key is needed: Authorization: Bearer KEY",
                       {"WWW-Authenticate": "Bearer"})  # fmt: skip


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
