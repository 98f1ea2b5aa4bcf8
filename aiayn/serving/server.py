"""`aiayn serve`: a REST API around one model, with batching across requests, Prometheus metrics, and
a page that shows attention (FastAPI, served by uvicorn).

One process, one model, one worker thread that makes every model call: requests are cut into lines,
queued, and the worker translates what is waiting as one batch (up to a token budget and a line count,
waiting a few milliseconds when the queue is short), then answers each request. A line whose client
has gone or whose deadline has passed is dropped untranslated. The queue is bounded: past it, a request
is answered 503 with Retry-After at once. Every error is one JSON shape with a machine-readable type:
{"error": {"type": ..., "message": ...}}; 4xx for the client's mistakes, 503 for overload, never a
traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException

from aiayn.checkpoint import load_search
from aiayn.config import SearchConfig, ServeConfig
from aiayn.inference.search import Hypothesis
from aiayn.inference.translate import Translator
from aiayn.precision import resolve_dtype
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
log = logging.getLogger("aiayn.serving.server")


class ApiError(Exception):
    """An answer other than 200: its status, machine-readable type and message."""

    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.headers = status, kind, message, headers or {}


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
class Pending:
    """One /translate request in the worker's hands: its lines' hypotheses as they come."""

    lines: int
    deadline: float  # time.monotonic()
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop
    results: dict[int, list[Hypothesis]] = field(default_factory=dict)
    batch_size: int = 0  # the largest batch one of its lines rode in
    gone: bool = False  # the client disconnected

    def settle(self, outcome: Any) -> None:
        """Hand a result (or an ApiError) to the waiting request, from any thread, once."""

        def set_it() -> None:
            if not self.done.done():
                if isinstance(outcome, BaseException):
                    self.done.set_exception(outcome)
                else:
                    self.done.set_result(outcome)

        self.loop.call_soon_threadsafe(set_it)


@dataclass
class Line:
    """One line to translate: the worker's unit of batching."""

    ids: list[int]  # source ids, EOS-terminated
    search: SearchConfig
    pending: Pending
    index: int  # which line of the request
    queued: float  # time.monotonic() when it was queued


@dataclass
class Call:
    """Any other model call (attention): run by the worker in its turn."""

    run: Callable[[], Any]
    pending: Pending


STOP = object()
# What a model call may raise that is not a bug of the server: an input it cannot take (ValueError),
# or the machine (out of memory, a CUDA error: RuntimeError).
MODEL_FAILURES = (ValueError, RuntimeError)


def model_failure(e: Exception, metrics: Metrics) -> ApiError:
    if isinstance(e, ValueError):
        metrics.failures.labels("invalid_request").inc()
        return ApiError(422, "invalid_request", str(e))
    log.error("model call failed: %s", e)
    metrics.failures.labels("internal").inc()
    return ApiError(500, "internal", f"the model call failed ({type(e).__name__})")


# --- The worker ----------------------------------------------------------------------------------------


STOPPED = "the model worker stopped; see the server's log"
STARTING = (
    "the model is compiling its decoding graphs (the server's console shows how far); try again shortly"
)


class Worker:
    """The one thread that calls the model: lines batched across requests, and other calls in turn."""

    def __init__(self, translate: Callable[[list[list[int]], SearchConfig], list[list[Hypothesis]]],
                 config: ServeConfig, metrics: Metrics, threads: int | None,
                 warm_up: Callable[[], None] | None = None):  # fmt: skip
        self.translate, self.config, self.metrics, self.threads = translate, config, metrics, threads
        self.warm_up = warm_up  # what runs before the first job: compiling the decoding graphs
        self.ready = threading.Event()  # set once warm_up is done: /health says ok, jobs are taken
        self.queue: queue.Queue = queue.Queue()
        self.waiting = 0  # lines queued and not yet taken: what the queue limit counts
        self.lock = threading.Lock()
        self.backlog: deque = deque()  # taken from the queue but left for the next batch
        self.thread = threading.Thread(target=self.run, name="aiayn-model", daemon=True)
        self.alive = True
        self.current: list[Line | Call] = []  # what the worker has in hand

    def start(self) -> None:
        if self.warm_up is None:  # ready at once: no request can find it starting
            self.ready.set()
        self.thread.start()

    def submit(self, jobs: list[Line | Call]) -> None:
        """Queue all of a request's jobs, or none of them (503 when the queue would overflow)."""
        if not self.alive:
            raise ApiError(503, "unavailable", STOPPED)
        if not self.ready.is_set():
            raise ApiError(503, "starting", STARTING, {"Retry-After": "5"})
        with self.lock:
            if self.waiting + len(jobs) > self.config.max_queue:
                self.metrics.failures.labels("overload").inc()
                raise ApiError(
                    503, "overloaded", f"{self.waiting} lines are waiting (the limit is {self.config.max_queue})",
                    {"Retry-After": "1"},
                )  # fmt: skip
            self.waiting += len(jobs)
            self.metrics.queue.set(self.waiting)
        for job in jobs:
            self.queue.put(job)

    def stop(self, timeout: float) -> None:
        """Answer what is queued, then end; what is still not answered after `timeout` gets 503."""
        self.queue.put(STOP)
        self.thread.join(timeout)

    def take(self, block: bool, timeout: float | None = None) -> Any:
        if self.backlog:
            return self.backlog.popleft()
        job = self.queue.get(block, timeout)
        if isinstance(job, (Line, Call)):
            with self.lock:
                self.waiting -= 1
                self.metrics.queue.set(self.waiting)
        return job

    def run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            if self.warm_up is not None:
                self.warm_up()
            self.ready.set()
            while True:
                job = self.take(block=True)
                if job is STOP:
                    self.drain()
                    return
                self.current = [job] if isinstance(job, Call) else self.gather(job)
                if isinstance(job, Call):
                    self.call(job)
                else:
                    self.translate_batch(self.current)
                self.current = []
        finally:  # ended by a bug: no request may wait for a worker that is gone
            self.alive = False
            error = ApiError(503, "unavailable", STOPPED)
            for job in self.current:
                job.pending.settle(error)
            self.fail_all(error)

    def fail_all(self, error: ApiError) -> None:
        while True:
            try:
                job = self.take(block=False)
            except queue.Empty:
                return
            if isinstance(job, (Line, Call)):
                job.pending.settle(error)

    def gather(self, first: Line) -> list[Line]:
        """Lines for one batch: the first and what is waiting, within the token budget, the line count
        and the number of requests, waiting up to batch_wait_ms for more while the batch is small."""
        config = self.config
        batch, requests = [first], {id(first.pending)}
        tokens = len(first.ids) * first.search.beam_size
        until = time.monotonic() + config.batch_wait_ms / 1000
        while len(batch) < config.batch_sentences:
            try:
                job = self.take(block=True, timeout=max(0.0, until - time.monotonic()))
            except queue.Empty:
                break
            if not isinstance(job, Line):  # a call or STOP: after this batch
                self.backlog.appendleft(job)
                break
            cost = len(job.ids) * job.search.beam_size
            new_request = id(job.pending) not in requests
            if tokens + cost > config.batch_tokens or (
                new_request and config.max_batch_requests and len(requests) >= config.max_batch_requests
            ):
                self.backlog.appendleft(job)
                break
            batch.append(job)
            requests.add(id(job.pending))
            tokens += cost
        return batch

    def translate_batch(self, batch: list[Line]) -> None:
        now = time.monotonic()
        live = []
        for line in batch:  # a client that has gone, or a deadline passed: not translated
            if line.pending.gone:
                self.metrics.failures.labels("disconnected").inc()
            elif now > line.pending.deadline:
                line.pending.settle(
                    ApiError(503, "timeout", "the request timed out before it was translated")
                )
            else:
                live.append(line)
                self.metrics.queue_seconds.observe(now - line.queued)
        if not live:
            return
        self.metrics.batch_sentences.observe(len(live))
        by_search: dict[SearchConfig, list[Line]] = {}
        for line in live:
            by_search.setdefault(line.search, []).append(line)
        try:
            for search, lines in by_search.items():
                for line, hyps in zip(lines, self.translate([line.ids for line in lines], search)):
                    line.pending.results[line.index] = hyps
        except MODEL_FAILURES as e:
            for line in live:
                line.pending.settle(model_failure(e, self.metrics))
            return
        for line in live:
            pending = line.pending
            pending.batch_size = max(pending.batch_size, len(live))
            if len(pending.results) == pending.lines:
                pending.settle(pending.results)

    def call(self, job: Call) -> None:
        if job.pending.gone:
            return
        try:
            result = job.run()
        except MODEL_FAILURES as e:
            job.pending.settle(model_failure(e, self.metrics))
        else:
            job.pending.settle(result)

    def drain(self) -> None:
        """At shutdown: answer everything still queued."""
        while True:
            try:
                job = self.take(block=False)
            except queue.Empty:
                return
            if isinstance(job, Call):
                self.call(job)
            elif isinstance(job, Line):
                self.translate_batch(self.gather(job))


# --- Metrics ---------------------------------------------------------------------------------------


class Metrics:
    """Prometheus metrics of one app, in a registry of its own (never labelled by client address)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("aiayn_requests", "HTTP requests", ["endpoint", "code"], registry=r)
        self.latency = Histogram("aiayn_request_seconds", "Request latency", ["endpoint"], registry=r)
        self.queue_seconds = Histogram("aiayn_queue_seconds", "Time a line waited for its batch", registry=r)
        buckets = (1, 2, 4, 8, 16, 32, 64, 128, 256)
        self.batch_sentences = Histogram(
            "aiayn_batch_lines", "Lines translated in one batch", buckets=buckets, registry=r
        )
        self.failures = Counter(
            "aiayn_failures", "Requests not answered 200, by reason", ["reason"], registry=r
        )
        self.queue = Gauge("aiayn_queue_lines", "Lines waiting to be translated", registry=r)


# --- The app ---------------------------------------------------------------------------------------


@dataclass
class Service:
    """Everything a request handler needs: the model's translator and the worker that runs it."""

    translator: Translator  # the PyTorch model: attention always, translation with engine "torch"
    config: ServeConfig
    worker: Worker
    metrics: Metrics
    info: dict[str, Any]
    closing: bool = False


def create_app(
    translator: Translator,
    config: ServeConfig | None = None,
    *,
    engine: Any = None,
    threads: int | None = None,
    api_key: str | None = None,
    cors_origins: tuple[str, ...] = (),
    engine_name: str = "torch",
) -> FastAPI:
    """The FastAPI app around a Translator. engine: another translator for /translate (CTranslate2's,
    with the same translate_ids), the Translator itself when None."""
    config = config or ServeConfig()
    metrics = Metrics()
    translate = (engine or translator).translate_ids
    # --compile: the graphs of the default search, for every batch size the worker makes, are compiled (or
    # loaded from the store) before /health says ok; a request with another beam compiles its own at first
    default = replace(translator.search_config, beam_size=config.beam_size)
    warm_up = None
    if engine is None and translator.compiled is not None:
        warm_up = lambda: translator.warm_up(default, config.batch_sentences, log.warning)  # noqa: E731
    worker = Worker(translate, config, metrics, threads, warm_up)
    model = translator.model
    info = {
        "version": metadata.version("aiayn"),
        "engine": engine_name,
        "device": str(translator.device),
        "dtype": resolve_dtype(translator.dtype, translator.device),
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
    service = Service(translator, config, worker, metrics, info)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        service.closing = True  # new requests get 503; those queued are answered
        await asyncio.get_running_loop().run_in_executor(None, worker.stop, config.timeout_s)

    app = FastAPI(title="aiayn", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_middleware(Edge, metrics=metrics, api_key=api_key)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])  # fmt: skip

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e, metrics)

    @app.exception_handler(Exception)  # a bug: logged by the server, never shown to the client
    async def bug(request: Request, e: Exception) -> JSONResponse:
        return error_response(ApiError(500, "internal", "internal error"), metrics)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return error_response(ApiError(e.status_code, kind, str(e.detail)), metrics)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(ApiError(422, "invalid_request", describe(e.errors())), metrics)

    @app.post("/translate")
    async def translate_endpoint(request: Request) -> Response:
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
        results = await wait(request, pending, lambda: worker.submit(jobs), service)
        return translation_response(results, lines, len(texts), body.n_best, translator, pending.batch_size)

    @app.post("/attention")
    async def attention_endpoint(request: Request) -> Response:
        body = await parse(request, AttentionRequest, service)
        if "\n" in body.text.strip() or not body.text.strip():
            raise ApiError(400, "invalid_request", "/attention takes one sentence: one non-empty line")
        check_text(body.text, service, "text")
        ids = translator.tokenizer.encode_src([body.text])[0]
        check_tokens(ids, service, "text")
        pending = new_pending(request, service, [0])
        result = await wait(request, pending, lambda: worker.submit([Call(lambda: attention(translator, ids), pending)]),
                            service)  # fmt: skip
        return JSONResponse(result)

    @app.get("/health")
    async def health() -> Response:
        if not worker.alive:
            raise ApiError(503, "unavailable", STOPPED)
        if not worker.ready.is_set():
            raise ApiError(503, "starting", STARTING, {"Retry-After": "5"})
        if service.closing:
            raise ApiError(503, "shutting_down", "the server is shutting down")
        return JSONResponse({"status": "ok"})

    @app.get("/info")
    async def info_endpoint() -> Response:
        return JSONResponse(service.info)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/")
    async def page() -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


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

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                MutableHeaders(scope=message).update(SECURITY_HEADERS)
            await send(message)

        try:
            if self.api_key and endpoint in PROTECTED and not authorized(Headers(scope=scope), self.api_key):
                error = ApiError(401, "unauthorized", "a valid API key is needed: Authorization: Bearer KEY",
                                 {"WWW-Authenticate": "Bearer"})  # fmt: skip
                await error_response(error, self.metrics)(scope, receive, send_with_headers)
            else:
                await self.app(scope, receive, send_with_headers)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)


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


def serve(
    model_dir: str | Path,
    config: ServeConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    device: str = "auto",
    dtype: str = "auto",
    threads: int | None = None,
    engine: str = "torch",
    api_key: str | None = None,
    cors_origins: tuple[str, ...] = (),
    compile: bool = False,
    shortlist: bool = False,
) -> None:
    """Load the model and serve it until Ctrl-C or SIGTERM (then what is queued is answered first)."""
    import tempfile

    import uvicorn

    from aiayn.precision import resolve_device

    listener = listen(host, port)  # before the model loads: a port in use is said at once
    search = replace(load_search(model_dir), beam_size=config.beam_size)  # alpha, penalty: the model's
    if engine == "ctranslate2" and search.length_penalty != "average":  # CTranslate2 has only that one
        search = replace(search, length_penalty="average")
        log.warning("--engine ctranslate2: beams use the average length penalty, score / |Y|^alpha")
    try:
        translator = Translator.load(
            model_dir,
            search,
            dtype=dtype,
            device=resolve_device(device),
            compile=compile,
            shortlist=shortlist,
        )
    except BaseException:
        listener.close()
        raise
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("serving on %s without --api-key: anyone who can reach this port can use it", host)
    with listener, tempfile.TemporaryDirectory(prefix="aiayn-ct2-") as scratch:
        other = None
        if engine == "ctranslate2":  # the exported model translates; attention stays with PyTorch
            try:
                from aiayn.interop.ctranslate2 import CTranslate2Translator, export_ctranslate2
            except ImportError:
                raise ValueError(
                    "--engine ctranslate2 needs the ctranslate2 package: pip install ctranslate2"
                ) from None
            compute = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "int8"}
            kind = resolve_dtype(dtype, translator.device)
            export_ctranslate2(model_dir, Path(scratch) / "ct2")
            other = CTranslate2Translator(
                Path(scratch) / "ct2", search, device=translator.device.type, compute_type=compute[kind],
                threads=threads or 0,
            )  # fmt: skip
        app = create_app(
            translator, config, engine=other, threads=threads, api_key=api_key, cors_origins=cors_origins,
            engine_name=engine,
        )  # fmt: skip
        # Everything loaded so far (torch, the model, CTranslate2's converters: a quarter of a million
        # objects) lives as long as the server: out of the cyclic GC's sight, whose full collections over
        # it paused the event loop under load (/health's worst latency in benchmarks/bench_serve.py).
        gc.collect()
        gc.freeze()
        settings = uvicorn.Config(
            app, log_level="warning", timeout_graceful_shutdown=int(config.timeout_s) + 5
        )
        uvicorn.Server(settings).run(sockets=[listener])


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening, or a ValueError that names the address."""
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on connections of a socket that says so, and
    # without it Nagle's algorithm and delayed ACKs add about 40 ms to every response.
    listener = socket.socket(
        socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        listener.bind((host, port))
        listener.listen(2048)
    except OSError as e:
        listener.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return listener


__all__ = ["create_app", "serve", "ApiError"]
