"""The models one server serves: a ServedModel per model directory, read at start (its configuration and
languages, one ModelDir) and loaded on first use; Models routes a language pair to the model that
translates it, or to two chained through a pivot language, and keeps what is loaded under a memory cap,
unloading the least recently used model that no request is using.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aiayn.checkpoint import WEIGHTS, ModelDir
from aiayn.config import InferenceOptions, SearchConfig, ServeConfig
from aiayn.inference.search import Hypothesis
from aiayn.inference.translate import Translator
from aiayn.inference.warmup import Warmup
from aiayn.precision import translation_dtype
from aiayn.serving.worker import ApiError, Metrics, log

PIVOTS = ("en",)  # tried first as the language between two models, as LibreTranslate's Argos models pivot


@dataclass(eq=False)  # (the worker queues jobs by model: by identity)
class Loaded:
    """A model in memory: the PyTorch translator (its tokenizer, attention, and translation with engine
    torch), what translates (CTranslate2's translator with engine ctranslate2), its compile in the
    background and its scratch directory, if any."""

    name: str
    translator: Translator
    engine: Any  # translate_ids(ids, search) -> hypotheses: the translator, or CTranslate2's
    warmup: Warmup | None = None
    scratch: tempfile.TemporaryDirectory | None = None

    def translate_ids(self, ids: list[list[int]], search_config: SearchConfig) -> list[list[Hypothesis]]:
        return self.engine.translate_ids(ids, search_config)

    def close(self) -> None:
        if self.warmup is not None:
            self.warmup.stop()
        if self.scratch is not None:
            self.scratch.cleanup()


class ServedModel:
    """One model directory of the server: what it translates, and its state (unloaded, loaded, failed)."""

    def __init__(self, name: str, model_dir: ModelDir | None, charge: int, loaded: Loaded | None = None):
        self.name, self.model_dir, self.charge = name, model_dir, charge
        # None: unknown (a directory of an older version; or a translator handed to create_app)
        self.languages = model_dir.languages if model_dir is not None else None
        self.loaded = loaded
        self.reserved = False  # its room is taken while it loads
        self.error: str | None = None  # why it could not be loaded: it is refused, the others serve
        self.busy = 0  # requests using it now: it is not unloaded while any is
        self.last_used = 0.0  # time.monotonic()
        self.loading: asyncio.Future | None = None

    def pairs(self) -> tuple[tuple[str, str], ...]:
        return self.languages.pairs() if self.languages is not None else ()

    def prefix(self, target: str | None) -> str:
        """What goes in front of each source sentence: a multilingual model's target tag, else nothing."""
        if target is None or self.languages is None:
            return ""
        return self.languages.prefix(target)

    def state(self) -> str:
        return "failed" if self.error else "loaded" if self.loaded else "unloaded"


@dataclass(frozen=True)
class Hop:
    """One model of a route, and the language it is asked to write."""

    model: ServedModel
    target: str | None


class Models:
    """The server's models: routing by language pair, loading on first use, unloading under the cap."""

    def __init__(
        self,
        served: Sequence[ServedModel],
        load: Callable[[ServedModel], Loaded],
        cap: int,
        metrics: Metrics | None = None,  # (create_app gives its own)
        wait_s: float = 30.0,  # how long a model's first request waits for room (ServeConfig.timeout_s)
    ):
        if not served:
            raise ValueError("a server needs at least one model")
        names = [m.name for m in served]
        if len(set(names)) != len(names):
            raise ValueError(f"two model directories have one name: {sorted(names)}; serve them under others")
        self.served = list(served)
        self.by_name = {m.name: m for m in served}
        self.load, self.cap, self.wait_s = load, cap, wait_s
        self.metrics = metrics or Metrics()
        self.by_pair: dict[tuple[str, str], ServedModel] = {}
        for model in served:
            for pair in model.pairs():
                self.by_pair.setdefault(pair, model)  # the first directory given for a pair serves it
        self.room = asyncio.Condition()  # (created in the server's event loop: FastAPI's lifespan calls us)

    # --- Routing -------------------------------------------------------------------------------------------

    def sources(self) -> set[str]:
        return {s for s, _ in self.by_pair} | {s for s, _ in self.pivoted()}

    def targets(self, source: str) -> list[str]:
        """The languages `source` translates into, directly or through a pivot."""
        return sorted(
            {t for s, t in self.by_pair if s == source} | {t for s, t in self.pivoted() if s == source}
        )

    def pivoted(self) -> set[tuple[str, str]]:
        """Pairs no model translates but two chain into."""
        pairs = set()
        for s, p in self.by_pair:
            for p2, t in self.by_pair:
                if p == p2 and s != t and (s, t) not in self.by_pair:
                    pairs.add((s, t))
        return pairs

    def languages(self) -> set[str]:
        return {code for pair in self.by_pair for code in pair}

    def route(self, source: str, target: str) -> list[Hop]:
        """The model for source -> target, or the two that chain through a pivot language (English first);
        an ApiError(400) when there is none."""
        direct = self.by_pair.get((source, target))
        if direct is not None:
            return [Hop(direct, target)]
        middles = [p for s, p in self.by_pair if s == source and (p, target) in self.by_pair]
        if middles:
            pivot = next((p for p in PIVOTS if p in middles), sorted(middles)[0])
            return [Hop(self.by_pair[(source, pivot)], pivot), Hop(self.by_pair[(pivot, target)], target)]
        raise ApiError(400, "unknown_pair", f"no model translates {source} into {target}; GET /languages lists "
                       "the pairs")  # fmt: skip

    def named(self, name: str | None) -> ServedModel:
        """A model by its directory's name; None: the server's only model."""
        if name is None:
            if len(self.served) == 1:
                return self.served[0]
            raise ApiError(422, "invalid_request", f"this server has {len(self.served)} models: name one "
                           f"(model: {', '.join(self.by_name)}) or the languages (source, target)")  # fmt: skip
        if name not in self.by_name:
            raise ApiError(404, "unknown_model", f"no model {name!r}; /info lists the models")
        return self.by_name[name]

    # --- Loading and unloading -------------------------------------------------------------------------

    def used(self) -> int:
        # a model that loads holds its weights twice for a moment: the file's tensors and the model's
        return sum(m.charge for m in self.served if m.loaded is not None) + sum(
            2 * m.charge for m in self.served if m.reserved
        )

    @contextlib.asynccontextmanager
    async def using(self, model: ServedModel) -> AsyncIterator[Loaded]:
        """The model loaded (loading it, and unloading others to make room, if need be), not unloaded while
        the block runs."""
        model.busy += 1
        try:
            loaded = await self.ensure(model)
            yield loaded
        finally:
            model.busy -= 1
            model.last_used = time.monotonic()
            async with self.room:
                self.room.notify_all()

    async def ensure(self, model: ServedModel) -> Loaded:
        if model.error is not None:
            raise ApiError(503, "model_failed", f"model {model.name} cannot be loaded: {model.error}")
        if model.loaded is not None:
            return model.loaded
        if model.loading is None:  # the first request loads it; the others wait for that load
            model.loading = asyncio.ensure_future(self._load(model))
        try:
            return await asyncio.shield(model.loading)
        finally:
            if model.loading is not None and model.loading.done():
                model.loading = None

    async def _load(self, model: ServedModel) -> Loaded:
        loop = asyncio.get_running_loop()
        if 2 * model.charge > self.cap:
            model.error = (
                f"it needs {model.charge >> 20} MiB, twice that while it loads, and the models' memory is capped "
                f"at {self.cap >> 20} MiB (--max-memory-mb)"
            )
            log.warning("model %s refused: %s", model.name, model.error)
            raise ApiError(503, "model_failed", f"model {model.name} cannot be loaded: {model.error}")
        # room for it: unload the least recently used idle models, or wait for one to become idle, as long as
        # a request may wait (the models in memory may stay in use for longer: a 503 to retry, then)
        deadline = loop.time() + self.wait_s
        async with self.room:
            while self.used() + 2 * model.charge > self.cap:
                idle = [m for m in self.served if m.loaded is not None and m.busy == 0 and m is not model]
                if idle:
                    victim = min(idle, key=lambda m: m.last_used)
                    loaded, victim.loaded = victim.loaded, None
                    await loop.run_in_executor(None, self._unload, loaded)
                    self.metrics.evictions.labels(victim.name).inc()
                    log.warning("model %s unloaded to make room for %s", victim.name, model.name)
                elif loop.time() >= deadline:
                    self.metrics.failures.labels("no_room").inc()
                    raise ApiError(503, "no_room", f"model {model.name} waits for memory: the models in memory "
                                   f"(--max-memory-mb {self.cap >> 20}) are all in use", {"Retry-After": "1"})  # fmt: skip
                else:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.room.wait(), deadline - loop.time())
            model.reserved = True
        try:
            loaded = await loop.run_in_executor(None, self.load, model)
        except (ValueError, OSError, RuntimeError) as e:
            model.error = str(e)
            log.warning("model %s refused: %s", model.name, e)
            raise ApiError(503, "model_failed", f"model {model.name} cannot be loaded: {e}") from None
        finally:
            model.reserved = False
            async with self.room:  # what it held while loading is free (or it failed): waiters look again
                self.room.notify_all()
        model.loaded = loaded
        if loaded.warmup is not None:
            loaded.warmup.start()
        self.metrics.loads.labels(model.name).inc()
        self.metrics.follow(model.name, loaded.warmup)
        self._gauges()
        return loaded

    def _unload(self, loaded: Loaded) -> None:
        self.metrics.forget(loaded.name, loaded.warmup)
        loaded.close()
        del loaded
        release_memory()
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.loaded.set(sum(m.loaded is not None for m in self.served))
        self.metrics.memory.set(self.used())

    def start(self) -> None:
        """At the server's start: the compiles of the models loaded before it begin."""
        for model in self.served:
            if model.loaded is not None:
                self.metrics.follow(model.name, model.loaded.warmup)
                if model.loaded.warmup is not None:
                    model.loaded.warmup.start()
        self._gauges()

    def preload(self) -> None:
        """Load every model now, in order, while they fit the cap (a server of one model: before its
        port answers, as its errors are then the command's)."""
        for model in self.served:
            if self.used() + 2 * model.charge <= self.cap and model.loaded is None:
                model.loaded = self.load(model)

    def stop(self) -> None:
        """At the server's end: the compiles in the background end, scratch directories go."""
        for model in self.served:
            if model.loaded is not None:
                model.loaded.close()


def release_memory() -> None:
    """Hand freed memory back to the system: glibc keeps freed blocks of a process's heap for reuse, so an
    unloaded model's weights would stay in the server's resident memory without malloc_trim."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def default_cap() -> int:
    """Half the machine's memory: the rest for the process itself, the batches and whatever else runs."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def charge_of(model_dir: ModelDir, options: InferenceOptions) -> int:
    """What a loaded model counts against the cap: its weights as stored (fp32), twice with CTranslate2
    (its own copy beside the PyTorch model that draws attention)."""
    size = (model_dir.path / WEIGHTS).stat().st_size
    return size * 2 if options.engine == "ctranslate2" else size


def loader(
    options: InferenceOptions, config: ServeConfig, compile_workers: int
) -> Callable[[ServedModel], Loaded]:
    """How a server loads a model: the translator in its options' format, CTranslate2's beside it with
    that engine, and the compile of its default search's graphs in the background with compile."""

    def load(model: ServedModel) -> Loaded:
        search = replace(model.model_dir.search, beam_size=config.beam_size)
        if options.engine == "ctranslate2" and search.length_penalty != "average":
            search = replace(search, length_penalty="average")  # CTranslate2 has only that one
            log.warning("%s, --engine ctranslate2: beams use the average length penalty, score / |Y|^alpha",
                        model.name)  # fmt: skip
        translator = Translator.load(model.model_dir, search, options)
        return prepared(model.name, translator, options, config, compile_workers)

    return load


def prepared(name: str, translator: Translator, options: InferenceOptions, config: ServeConfig,
             compile_workers: int) -> Loaded:  # fmt: skip
    """A loaded translator made ready to serve: its engine, and the compile of its graphs in the
    background (not started)."""
    if options.engine == "ctranslate2":  # the exported model translates; attention stays with PyTorch
        from aiayn.interop.ctranslate2 import CTranslate2Translator, export_ctranslate2

        compute = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int8": "int8"}
        kind = translation_dtype(options.dtype, translator.device)
        scratch = tempfile.TemporaryDirectory(prefix="aiayn-ct2-")
        assert translator.source is not None
        export_ctranslate2(translator.source[0], Path(scratch.name) / "ct2")
        engine = CTranslate2Translator(
            Path(scratch.name) / "ct2", translator.search_config, device=translator.device.type,
            compute_type=compute[kind], threads=options.threads or 0,
        )  # fmt: skip
        return Loaded(name, translator, engine, scratch=scratch)
    warmup = None
    if translator.compiled is not None:
        default = replace(translator.search_config, beam_size=config.beam_size)
        warmup = translator.compile_in_background(
            default, config.batch_sentences, log.warning, compile_workers
        )
    return Loaded(name, translator, translator, warmup)
