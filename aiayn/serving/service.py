"""What a request handler needs from the server, whichever API it answers (app.py's own, libre.py's
LibreTranslate): the Service, the request's body within its limits, and sentences through the models of a
route, batched by the worker with other requests' and awaited until their answer, deadline or client's end.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.datastructures import Headers

from aiayn.config import ServeConfig
from aiayn.serving.documents import pieces
from aiayn.serving.models import Hop, Models
from aiayn.serving.worker import ApiError, Line, Metrics, Pending, Worker


class RateLimit:
    """LibreTranslate's --req-limit: requests a client address may make in a moving minute, a request of
    N texts costing N, counted by the `limits` library (what LibreTranslate's Flask-Limiter counts with)."""

    def __init__(self, per_minute: int):
        from limits import RateLimitItemPerMinute, storage, strategies

        self.item = RateLimitItemPerMinute(per_minute)
        self.limiter = strategies.MovingWindowRateLimiter(storage.MemoryStorage())

    def check(self, request: Request, cost: int = 1) -> None:
        client = request.client.host if request.client else "unknown"
        if not self.limiter.hit(self.item, client, cost=max(1, cost)):
            raise ApiError(429, "rate_limited", f"Slowdown: {self.item}", {"Retry-After": "60"})


@dataclass
class Service:
    """Everything a request handler needs: the models, the worker that runs them, the server's limits."""

    models: Models
    config: ServeConfig
    worker: Worker
    metrics: Metrics
    info: dict[str, Any]  # what /info says of the server; of each model, describe_model
    api_key: str | None = None
    closing: bool = False
    rate: RateLimit | None = None  # --req-limit

    def __post_init__(self) -> None:
        if self.config.req_limit and self.rate is None:
            self.rate = RateLimit(self.config.req_limit)

    def charge(self, request: Request, cost: int = 1) -> None:
        """Count a request against its client's --req-limit (a 429 past it)."""
        if self.rate is not None:
            self.rate.check(request, cost)

    def ready(self) -> bool:
        """Whether /health says ok: the worker is taking jobs, and where the server was told to wait for
        its compiled graphs (ready_when_compiled), those of the models in memory are in."""
        if self.config.ready_when_compiled:
            warmups = [m.loaded.warmup for m in self.models.served if m.loaded and m.loaded.warmup]
            return all(w.progress.state in ("done", "failed") for w in warmups)
        return True


def service_of(request: Request) -> Service:
    return request.app.state.service


async def read_body(request: Request, service: Service) -> bytes:
    """The request's body, within the size limit."""
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
    return body


def authorized(headers: Headers, api_key: str) -> bool:
    given = headers.get("authorization", "")
    return given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), api_key.encode())


def check_text(text: str, service: Service, what: str) -> None:
    limit = service.config.max_chars
    if len(text) > limit:
        raise ApiError(413, "too_long", f"{what} has {len(text)} characters; the limit is {limit}")


def check_tokens(ids: list[int], service: Service, what: str) -> None:
    limit = service.config.max_tokens
    if len(ids) - 1 > limit:
        raise ApiError(413, "too_long", f"{what} has {len(ids) - 1} tokens; the limit is {limit}")


def new_pending(request: Request, service: Service, lines: int) -> Pending:
    loop = asyncio.get_running_loop()
    return Pending(lines, time.monotonic() + service.config.timeout_s, loop.create_future(), loop)


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


def route(service: Service, name: str | None, source: str | None, target: str | None) -> list[Hop]:
    """The models a request goes through: one named, the one (or two, through a pivot) of its languages,
    or the server's only model."""
    if name is not None or (source is None and target is None):
        model = service.models.named(name)
        languages = model.languages
        if languages is None or not languages.tags:  # one target: nothing to choose
            return [Hop(model, None)]
        if target is not None and target not in languages.tags:
            raise ApiError(422, "invalid_request", f"model {model.name} does not write {target}: it translates "
                           f"{languages.describe()}")  # fmt: skip
        return [Hop(model, target)]
    if source is None or target is None:
        raise ApiError(422, "invalid_request", "name both languages, source and target, or neither")
    return service.models.route(source, target)


async def through(
    request: Request,
    service: Service,
    hops: list[Hop],
    sentences: list[str],
    beam: int | None,
    n_best: int,
    unit: str = "line",
    cut_long: bool = False,
) -> tuple[list[list[tuple[str, float]]], int]:
    """Sentences through a route's models, each model's lines batched by the worker with other requests':
    the n-best (text, score) of each sentence from the last model, the best of each model before it
    feeding the next; and the largest batch a line rode in. A sentence over --max-tokens is a 413, or with
    cut_long (LibreTranslate's texts) is cut into pieces within it (documents.pieces), each translated
    and the best of each joined: its n-best is that one."""
    config = service.config
    beam = beam or config.beam_size
    if beam > config.max_beam or n_best > config.max_beam:
        raise ApiError(422, "invalid_request", f"beam_size and n_best are at most {config.max_beam}")
    texts, results, batch_size = sentences, [[("", 0.0)] for _ in sentences], 0
    for k, hop in enumerate(hops):
        last = k == len(hops) - 1
        async with service.models.using(hop.model) as loaded:
            translator = loaded.translator
            search = replace(translator.search_config, beam_size=beam).with_n_best(n_best if last else 1)
            prefix = hop.model.prefix(hop.target)
            encode = translator.tokenizer.encode_src
            ids = encode([prefix + t if t.strip() else t for t in texts])
            cut = [[(t, "")] for t in texts]  # each text's pieces, with what followed each
            if cut_long:  # only the sentences over the limit are cut, and only their pieces encoded again
                tokens = lambda piece, encode=encode, prefix=prefix: len(encode([prefix + piece])[0]) - 1  # noqa: E731 (no EOS)
                for i in [i for i, line in enumerate(ids) if len(line) - 1 > config.max_tokens]:
                    cut[i] = pieces(texts[i], tokens, config.max_tokens)
                ids = [line for i, of_text in enumerate(cut)
                       for line in (encode([prefix + p for p, _ in of_text]) if len(of_text) > 1 else [ids[i]])]  # fmt: skip
            for i, line in enumerate(ids):
                check_tokens(line, service, f"{unit} {i + 1} of the request")
            pending = new_pending(request, service, len(ids))
            jobs = [Line(line, search, pending, i, time.monotonic(), loaded) for i, line in enumerate(ids)]
            if not jobs:
                return [], 0
            found = await wait(request, pending, lambda jobs=jobs: service.worker.submit(jobs), service)
            if isinstance(found, Response):  # the client has gone
                raise Gone(found)
            decode = translator.tokenizer.decode_tgt
            per_line = [
                list(zip(decode([h.tokens for h in found[i]]), [h.score for h in found[i]]))
                for i in range(len(ids))
            ]
            results, start = [], 0
            for of_text in cut:
                mine, start = per_line[start : start + len(of_text)], start + len(of_text)
                if len(mine) == 1:
                    results.append(mine[0])
                else:  # a sentence in pieces: the best of each, joined as the pieces were
                    joined = "".join(n_best[0][0] + after for n_best, (_, after) in zip(mine, of_text))
                    results.append([(joined, sum(n_best[0][1] for n_best in mine))])
            batch_size = max(batch_size, pending.batch_size)
        texts = [n_best[0][0] for n_best in results]
    return results, batch_size


class Gone(Exception):
    """The client went away while its request was translated: nobody to answer."""

    def __init__(self, response: Response):
        self.response = response
