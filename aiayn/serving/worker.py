"""The one thread that calls the models in `aiayn serve`, and what it works on: requests cut into
sentences, batched per model across requests up to a token budget and a line count (waiting a few
milliseconds when a model's queue is short), the models taken in turn, other model calls (attention) in
their model's turn, a bounded queue, and the server's metrics. A line whose client has gone or whose
deadline has passed is dropped untranslated.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from aiayn.config import SearchConfig, ServeConfig
from aiayn.inference.search import Hypothesis
from aiayn.inference.warmup import Warmup

log = logging.getLogger("aiayn.serving")


class ApiError(Exception):
    """An answer other than 200: its status, machine-readable type and message."""

    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.headers = status, kind, message, headers or {}


class Translates(Protocol):
    """What a job's model offers the worker: the translator's (or CTranslate2's) translate_ids."""

    name: str

    def translate_ids(self, ids: list[list[int]], search_config: SearchConfig) -> list[list[Hypothesis]]: ...


@dataclass
class Pending:
    """One request's work in the worker's hands: its lines' hypotheses as they come."""

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
    """One line (a sentence) to translate with one model: the worker's unit of batching."""

    ids: list[int]  # source ids, EOS-terminated
    search: SearchConfig
    pending: Pending
    index: int  # which line of the request
    queued: float  # time.monotonic() when it was queued
    model: Translates


@dataclass
class Call:
    """Any other model call (attention): run by the worker in its model's turn."""

    run: Callable[[], Any]
    pending: Pending
    model: Any = None  # whose turn it waits for (None: a turn of its own)


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
    "the server answers, but waits for its compiled graphs before it says ready (--ready-when-compiled; "
    "/info says how far they are)"
)


class Worker:
    """The one thread that calls the models: each model's lines batched across requests, the models with
    work taken in turn (fair: a model waits at most one batch of each other model), other calls in their
    model's turn. One thread for all models, as the machine's cores are the models' to share: two threads
    would each run PyTorch's threads on the same cores."""

    def __init__(self, config: ServeConfig, metrics: Metrics, threads: int | None):
        self.config, self.metrics, self.threads = config, metrics, threads
        self.lock = threading.Condition()
        # jobs by model, the dict's order the turns': a model's queue goes to the back when it has its
        # turn, and leaves when it is empty (an unloaded model leaves nothing behind)
        self.queues: dict[Any, deque] = {}
        self.waiting = 0  # jobs queued and not yet taken: what the queue limit counts
        self.stopping = False
        self.thread = threading.Thread(target=self.run, name="aiayn-model", daemon=True)
        self.alive = True
        self.current: list[Line | Call] = []  # what the worker has in hand

    def start(self) -> None:
        self.thread.start()

    def submit(self, jobs: list[Line | Call]) -> None:
        """Queue all of a request's jobs, or none of them (503 when the queue would overflow)."""
        if not self.alive:
            raise ApiError(503, "unavailable", STOPPED)
        with self.lock:
            if self.waiting + len(jobs) > self.config.max_queue:
                self.metrics.failures.labels("overload").inc()
                raise ApiError(
                    503, "overloaded", f"{self.waiting} lines are waiting (the limit is {self.config.max_queue})",
                    {"Retry-After": "1"},
                )  # fmt: skip
            for job in jobs:
                self.queues.setdefault(job.model, deque()).append(job)
            self._count(len(jobs))
            self.lock.notify()

    def stop(self, timeout: float) -> None:
        """Answer what is queued, then end; what is still not answered after `timeout` gets 503."""
        with self.lock:
            self.stopping = True
            self.lock.notify()
        self.thread.join(timeout)

    def _count(self, change: int) -> None:  # (under the lock)
        self.waiting += change
        self.metrics.queue.set(self.waiting)

    def _pop(self, model: Any) -> Line | Call:  # (under the lock; the model's queue is not empty)
        queue = self.queues[model]
        job = queue.popleft()
        if not queue:
            del self.queues[model]
        self._count(-1)
        return job

    def take(self, block: bool) -> Any:
        """The next model's first job, that model going to the back of the turns; STOP once stopping with
        nothing queued; None when nothing is queued and not block."""
        with self.lock:
            while not self.queues:
                if self.stopping:
                    return STOP
                if not block:
                    return None
                self.lock.wait()
            model = next(iter(self.queues))
            self.queues[model] = self.queues.pop(model)
            return self._pop(model)

    def more(self, model: Any, until: float) -> Line | Call | None:
        """The model's next job, waiting for one until `until` (time.monotonic()), or None."""
        with self.lock:
            while model not in self.queues:
                left = until - time.monotonic()
                if left <= 0 or self.stopping:
                    return None
                self.lock.wait(left)
            return self._pop(model)

    def put_back(self, job: Line | Call) -> None:
        """A job taken for a batch it did not fit: first of its model's queue again."""
        with self.lock:
            if job.model in self.queues:
                self.queues[job.model].appendleft(job)
            else:
                self.queues[job.model] = deque([job])
            self._count(1)

    def run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            while True:
                job = self.take(block=True)
                if job is STOP:
                    return
                self.current = [job] if isinstance(job, Call) else self.gather(job)
                if isinstance(job, Call):
                    self.call(job)
                else:
                    self.translate_batch(self.current)
                self.current = []
        finally:  # ended by a bug, or stopped: no request may wait for a worker that is gone
            self.alive = False
            error = ApiError(503, "unavailable", STOPPED)
            for job in self.current:
                job.pending.settle(error)
            self.fail_all(error)

    def fail_all(self, error: ApiError) -> None:
        while (job := self.take(block=False)) not in (None, STOP):
            job.pending.settle(error)

    def gather(self, first: Line) -> list[Line]:
        """Lines of first's model for one batch: the first and what is waiting, within the token budget,
        the line count and the number of requests, waiting up to batch_wait_ms for more while the batch
        is small."""
        config = self.config
        batch, requests = [first], {id(first.pending)}
        tokens = len(first.ids) * first.search.beam_size
        until = time.monotonic() + config.batch_wait_ms / 1000
        while len(batch) < config.batch_sentences:
            job = self.more(first.model, until)
            if job is None:
                break
            if not isinstance(job, Line):  # a call: after this batch
                self.put_back(job)
                break
            cost = len(job.ids) * job.search.beam_size
            new_request = id(job.pending) not in requests
            if tokens + cost > config.batch_tokens or (
                new_request and config.max_batch_requests and len(requests) >= config.max_batch_requests
            ):
                self.put_back(job)
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
        model = live[0].model
        self.metrics.batch_sentences.observe(len(live))
        self.metrics.lines.labels(model.name).inc(len(live))
        by_search: dict[SearchConfig, list[Line]] = {}
        for line in live:
            by_search.setdefault(line.search, []).append(line)
        try:
            for search, lines in by_search.items():
                for line, hyps in zip(lines, model.translate_ids([line.ids for line in lines], search)):
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
        self.lines = Counter("aiayn_lines", "Lines (sentences) translated, by model", ["model"], registry=r)
        self.loaded = Gauge("aiayn_models_loaded", "Models in memory", registry=r)
        self.memory = Gauge(
            "aiayn_models_bytes", "What the models in memory count against the cap", registry=r
        )
        self.loads = Counter("aiayn_model_loads", "Models loaded, by model", ["model"], registry=r)
        self.evictions = Counter("aiayn_model_evictions", "Models unloaded to make room, by model", ["model"],
                                 registry=r)  # fmt: skip
        self.graphs = Gauge("aiayn_compile_graphs", "Decoding graphs compiled in the background: done, total",
                            ["model", "state"], registry=r)  # fmt: skip
        self.compiled = Gauge("aiayn_compiled_batches", "Whether a class of batches (by sentences) decodes "
                              "compiled", ["model", "batches"], registry=r)  # fmt: skip

    def follow(self, model: str, warmup: Warmup | None) -> None:
        """Gauges of a model's compile in the background (warmup.py), where there is one: its graphs done
        and in all, and which classes of batches decode compiled."""
        if warmup is None:
            return
        progress = warmup.progress
        self.graphs.labels(model, "done").set_function(
            lambda: sum(g.seconds is not None for g in progress.graphs.values())
        )
        self.graphs.labels(model, "total").set_function(lambda: len(progress.graphs))
        for cls in warmup.sizes:
            self.compiled.labels(model, cls).set_function(lambda cls=cls: cls in progress.ready)

    def forget(self, model: str, warmup: Warmup | None) -> None:
        """A model unloaded: its compile's gauges go."""
        if warmup is None:
            return
        for state in ("done", "total"):
            self.graphs.remove(model, state)
        for cls in warmup.sizes:
            self.compiled.remove(model, cls)
