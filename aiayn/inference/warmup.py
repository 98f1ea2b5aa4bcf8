"""Compiling a translator's graphs in worker processes, at a low priority, while it decodes eagerly: what
`aiayn serve` does at start, so that it answers from the moment the model is loaded and each row class of
batches (static_cache.row_class) moves to its compiled graphs once they are all in.

A worker (`python -m aiayn.inference.warmup_worker`) loads the model directory with the translator's options,
so its graphs get the same names in the store (graph_store.fingerprint, checked), and runs one batch of each
row class with each search: first eagerly, meeting every graph the batches need in order (the plan),
then compiling its share, every W-th graph of W workers (it runs the others eagerly, only to go on).
It writes a JSON line to its events pipe for the plan and for each graph it has stored; the translator's
process loads each graph from the store as it comes (CompiledDecoder.adopt) and opens each class to its
batches when all the class's graphs are in. The workers run at a low priority (nice), in their own
process group, which stop() ends: a package is written atomically, so none is ever half there.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from aiayn.config import InferenceOptions, SearchConfig
from aiayn.files import atomic_write
from aiayn.inference import compiler
from aiayn.inference.compiled import CompiledDecoder
from aiayn.inference.static_cache import TRACED_SENTENCES
from aiayn.tokenizer import EOS_ID

# The sentences of the batch each row class is compiled with: the rows its graphs are traced for
# (TRACED_SENTENCES), since inductor takes an example's sizes as the usual ones where it lays out and
# shares out loops among threads: the many class's graphs compiled with a batch of 8 decoded a file's
# batches of hundreds of sentences a third slower than with 32 or with hundreds (benchmarks/bench_real.py,
# AMD EPYC Zen 3, greedy). The many class before the few: a graph both share (compiled.shared_class) is
# then compiled with the many's batch.
SENTENCES = MappingProxyType({"one": 1, "many": TRACED_SENTENCES["many"], "few": 2})
NICE = 10  # the workers' niceness: the process that answers requests comes first
LINE_TOKENS = 16  # a warm-up line's source tokens, about a Multi30k sentence's
PLAN_STEPS = 2  # how far past its source's length a planning search decodes a line (warm_up_batches)


def classes_up_to(sentences: int) -> dict[str, int]:
    """The row classes of batches of up to `sentences` sentences, each with the sentences of its warm-up
    batch."""
    return {cls: n for cls, n in SENTENCES.items() if n <= sentences}


def plan(translator: Any, searches: list[SearchConfig], sizes: dict[str, int]) -> dict[tuple, set[str]]:
    """The graphs the warm-up batches of translator's compiled decoder meet, in the order met, each with
    the classes whose batches need it: the batches run eagerly, nothing is compiled."""
    decoder = translator.compiled
    compiles, decoder.compiles = decoder.compiles, lambda key: False
    needs: dict[tuple, set[str]] = {}
    try:
        for cls, run in warm_up_batches(translator, searches, sizes, planning=True):
            decoder.calls = []
            run()
            for key in decoder.calls:
                needs.setdefault(key, set()).add(cls)
    finally:
        decoder.calls, decoder.compiles = None, compiles
    return needs


def plan_as_json(needs: dict[tuple, set[str]]) -> list:
    """A plan as JSON (plan_from_json reads it back)."""
    return [[list(key), sorted(classes)] for key, classes in needs.items()]


def plan_from_json(value: list) -> dict[tuple, set[str]]:
    """A plan back from JSON (plan_as_json)."""
    return {_key(key): set(classes) for key, classes in value}


def plan_path(decoder: CompiledDecoder, searches: list[SearchConfig], sizes: dict[str, int]) -> Path:
    """Where the store keeps the plan of a warm-up (the model's fingerprint, its searches and classes),
    written once every graph of it is in: a later start that finds them all stored loads them itself,
    without a worker process (whose start, a PyTorch import and a model's load, cost a warm server most
    of 30 s before full speed), and `--compile` skips its planning pass."""
    what = json.dumps([[asdict(s) for s in searches], sizes], sort_keys=True)
    digest = hashlib.blake2b(what.encode(), digest_size=8).hexdigest()
    return Path(decoder.store) / f"plan-{decoder.model_fingerprint()}-{digest}.json"


def stored_plan(
    decoder: CompiledDecoder, searches: list[SearchConfig], sizes: dict[str, int]
) -> dict[tuple, set[str]] | None:
    """The plan an earlier start stored, where every graph of it is in the store; else None."""
    try:
        needs = plan_from_json(json.loads(plan_path(decoder, searches, sizes).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None
    return needs if needs and all(decoder.package_path(key).is_file() for key in needs) else None


def store_plan(
    decoder: CompiledDecoder,
    searches: list[SearchConfig],
    sizes: dict[str, int],
    needs: dict[tuple, set[str]],
) -> None:
    """Keep a plan whose graphs are all in the store, for stored_plan (a store that cannot be written to
    keeps none: the next start plans again)."""
    text = json.dumps(plan_as_json(needs))
    with contextlib.suppress(OSError):
        atomic_write(plan_path(decoder, searches, sizes), lambda tmp: tmp.write_text(text))


def share(needs: dict[tuple, set[str]], worker: int, workers: int) -> Callable[[tuple], bool]:
    """Worker `worker`'s share of the plan's graphs: every `workers`-th, in the order met (a graph the
    plan did not meet is worker 0's)."""
    position = {key: i for i, key in enumerate(needs)}
    return lambda key: position.get(key, 0) % workers == worker


def compile_share(
    translator: Any,
    searches: list[SearchConfig],
    sizes: dict[str, int],
    worker: int,
    workers: int,
    send: Callable[[dict], None],
    needs: dict[tuple, set[str]] | None = None,
) -> None:
    """Worker `worker`'s part of a warm-up, in a worker process or in the translator's own: the plan (needs,
    where the process that started the warm-up made it), sent first, then its share of the graphs, each
    sent once it is stored."""
    decoder = translator.compiled
    if decoder.store is not None:
        compiler.prepare(translator.device)  # beside the plan's eager decoding and the tracing
    if needs is None:
        needs = plan(translator, searches, sizes)
    send({"plan": plan_as_json(needs)})
    saved = decoder.compiles, decoder.on_compiled, decoder.builds_at_once
    decoder.compiles = share(needs, worker, workers)
    decoder.on_compiled = lambda key, path, seconds: send(
        {"graph": list(key), "path": str(path), "seconds": round(seconds, 1)}
    )
    decoder.builds_at_once = workers == 1  # else the other workers use the other cores
    mine = [key for key in needs if decoder.compiles(key)]
    try:
        for _, run in warm_up_batches(translator, searches, sizes):
            if all(decoder.holds(key) for key in mine):
                break  # the rest would only decode eagerly
            run()
    finally:
        decoder.compiles, decoder.on_compiled, decoder.builds_at_once = saved


@dataclass
class Graph:
    """A graph of the plan: its key, the classes that need it, and once stored, its seconds."""

    key: tuple
    classes: set[str]
    seconds: float | None = None  # compiling it, in the worker
    worker: int = 0


@dataclass
class Progress:
    """How far a warm-up is: what /info and /metrics say of it, and the console's lines."""

    state: str = "starting"  # starting, compiling, done, failed, stopped
    graphs: dict[tuple, Graph] = field(default_factory=dict)  # the plan, in the order met
    ready: list[str] = field(default_factory=list)  # the row classes that decode compiled
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        done = [g for g in self.graphs.values() if g.seconds is not None]
        return {
            "state": self.state,
            "ready": list(self.ready),
            "graphs_done": len(done),
            "graphs_total": len(self.graphs) or None,
            "seconds": round((self.finished or time.monotonic()) - self.started, 1),
            "compile_seconds": round(sum(g.seconds for g in done), 1),  # type: ignore[misc]
            "graphs": [
                {
                    "graph": describe(g.key),
                    "classes": sorted(g.classes),
                    "seconds": g.seconds,
                    "worker": g.worker,
                }
                for g in self.graphs.values()
            ],
            **({"error": self.error} if self.error else {}),
        }


def describe(key: tuple) -> str:
    """A graph's key as a person reads it: "step, few sentences, 4 rows a sentence"."""
    name, rest = key[0], key[1:]
    if name == "memory":
        return f"encoder, {_sentences(rest[0])}"
    if name == "step":
        return f"decoding step, {_sentences(rest[0])}, {rest[1]} row(s) a sentence" + (
            ", shortlist" if rest[3] else ""
        )
    return f"{name} search's own work, {'1 sentence' if rest[0] == 1 else 'any sentences'}"


def _sentences(cls: str) -> str:
    return {
        "one": "1 sentence",
        "few": "a few sentences",
        "many": "many sentences",
        "any": "2 or more sentences",
    }[cls]


class Warmup:
    """Worker processes compiling a translator's graphs into its store while it decodes eagerly.

    source: the model directory and options the translator was loaded with (Translator.source); decoder: the
    one the translator decodes with, which adopts each graph and, where it is gated (its classes), opens
    each class of batches to its graphs; searches and sizes: what to compile for, the row classes each with
    the sentences of its warm-up batch (SENTENCES). here: worker 0 is this process (compile_here), for a
    process that has nothing else to do meanwhile (`aiayn translate --compile`), which saves a start; its
    workers then run at the same priority as it (nothing waits for answers). needs: the plan, where this
    process has made it (plan()), handed to the workers instead of each decoding its warm-up batches again
    first."""

    def __init__(
        self,
        source: tuple[Path, InferenceOptions],
        decoder: CompiledDecoder,
        searches: list[SearchConfig],
        sizes: dict[str, int],
        workers: int,
        say: Callable[[str], None],
        here: bool = False,
        needs: dict[tuple, set[str]] | None = None,
    ):
        self.directory, self.options = source
        self.needs = needs
        self.decoder, self.searches, self.sizes, self.say = decoder, searches, sizes, say
        self.workers, self.here = workers, here
        self.progress = Progress()
        self.processes: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.finished_workers = 0

    def start(self) -> None:
        """Start the workers; returns at once."""
        assert self.decoder.store is not None, "workers hand graphs over through a store"
        expected = self.decoder.model_fingerprint()
        stored = None if self.here else stored_plan(self.decoder, self.searches, self.sizes)
        if stored is not None:  # an earlier start's plan, every graph of it stored: loaded here, no worker
            self.progress.state = "compiling"
            thread = threading.Thread(target=self._load_stored, args=(stored,), daemon=True)
            thread.start()
            self.threads.append(thread)
            self.say(f"compiled decoding: loading the {len(stored)} graphs an earlier start stored")
            return
        for index in range(1 if self.here else 0, self.workers):
            read, write = os.pipe()
            command = [sys.executable, "-m", "aiayn.inference.warmup_worker", str(self.directory), "--options",
                       json.dumps(asdict(self.options)), "--searches", json.dumps([asdict(s) for s in self.searches]),
                       "--sizes", json.dumps(self.sizes), "--worker", str(index), "--workers", str(self.workers),
                       "--events", str(write), "--fingerprint", expected, "--nice", str(0 if self.here else NICE),
                       "--threads", str(self.options.threads or torch.get_num_threads())]  # fmt: skip
            if self.needs is not None:
                command += ["--plan", json.dumps(plan_as_json(self.needs))]
            env = {**os.environ, "AIAYN_COMPILE_STORE": str(self.decoder.store)}
            process = subprocess.Popen(command, env=env, pass_fds=(write,), stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, process_group=0,
                                       encoding="utf-8", errors="replace")  # fmt: skip
            os.close(write)
            self.processes.append(process)
            thread = threading.Thread(target=self._follow, args=(index, process, read), daemon=True)
            thread.start()
            self.threads.append(thread)
        self.progress.state = "compiling"
        classes = ", ".join(_sentences(cls) for cls in self.sizes)
        processes = f"{self.workers} worker process{'es' if self.workers > 1 else ''}"
        self.say(f"compiled decoding: compiling the graphs of batches of {classes} ({processes})")
        if self.decoder.classes is not None:
            self.say(
                "compiled decoding: answering now, eagerly; the compile runs at a lower priority, and each "
                "class of batches switches to its graphs once they are all in (GET /info says how far)"
            )

    def compile_here(self, translator: Any) -> None:
        """Worker 0's share, in this process (here=True), after start(): its graphs go straight into the
        decoder (which is translator's), the others' come as the workers store them."""
        error = None
        try:
            compile_share(translator, self.searches, self.sizes, 0, self.workers, lambda e: self._event(0, e),
                          self.needs)  # fmt: skip
        except Exception as failure:  # as a worker's: said, and the batches that need the graphs compile them
            error = f"{type(failure).__name__}: {failure}"
        self._finished(0, error)

    def wait(self, timeout: float | None = None) -> bool:
        """Until every worker has ended; whether all of the plan is in."""
        self.done.wait(timeout)
        return self.progress.state == "done"

    def stop(self, timeout: float = 5.0) -> None:
        """End the workers now (SIGTERM to their process groups, then SIGKILL): a package being written is
        not renamed into the store, so nothing partial is left there."""
        if self.progress.state in ("compiling", "starting"):
            self.progress.state = "stopped"
        for process in self.processes:
            if process.poll() is None:
                with _no_such_process():
                    os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with _no_such_process():
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for thread in self.threads:
            thread.join(timeout)

    # --- in each worker's reader thread ---

    def _follow(self, index: int, process: subprocess.Popen, read: int) -> None:
        """Read a worker's events, then its end; stderr is kept for the error, if there is one."""
        errors: collections.deque[str] = collections.deque(maxlen=40)
        drain = threading.Thread(target=lambda: errors.extend(process.stderr), daemon=True)  # type: ignore[arg-type]
        drain.start()
        try:
            with os.fdopen(read, encoding="utf-8") as events:
                for line in events:
                    self._event(index, json.loads(line))
        except Exception as error:  # a graph that does not load: this worker's graphs are not used
            self._fail(f"{type(error).__name__}: {error}")
            with _no_such_process():
                os.killpg(process.pid, signal.SIGTERM)
        code = process.wait()
        drain.join(5)
        error = None
        if code:
            last = "".join(errors).strip().splitlines()[-1:] or [f"exit status {code}"]
            error = f"worker {index} failed: {last[0]}\n{''.join(errors).rstrip()}"
        self._finished(index, error)

    def _finished(self, index: int, error: str | None) -> None:
        """A worker has ended (error: why it failed); the last to end settles the state."""
        with self.lock:
            self.finished_workers += 1
            if error is not None and self.progress.state == "compiling":
                message, _, details = error.partition("\n")
                self._fail(message, details)
            if self.finished_workers == self.workers:
                if self.progress.state == "compiling":
                    self.progress.state = "done" if self._missing() == [] else "failed"
                    if self.progress.state == "done":  # for a later start: stored_plan
                        store_plan(self.decoder, self.searches, self.sizes,
                                   {key: graph.classes for key, graph in self.progress.graphs.items()})  # fmt: skip
                self.progress.finished = time.monotonic()
                self.done.set()

    def _event(self, index: int, event: dict) -> None:
        with self.lock:
            progress = self.progress
            if "plan" in event:  # every worker sends the same plan: the first is kept
                if not progress.graphs:
                    for key, classes in plan_from_json(event["plan"]).items():
                        progress.graphs[key] = Graph(key, classes, worker=0)
                    self.say(f"compiled decoding: {len(progress.graphs)} graphs to compile")
                return
            key = _key(event["graph"])
        self.decoder.adopt(key, Path(event["path"]))  # outside the lock: loading takes a second or so
        with self.lock:
            graph = progress.graphs[key]
            graph.seconds, graph.worker = event["seconds"], index
            done = [g for g in progress.graphs.values() if g.seconds is not None]
            for cls in self.sizes:
                if cls not in progress.ready and all(
                    g.seconds is not None for g in progress.graphs.values() if cls in g.classes
                ):
                    progress.ready.append(cls)
                    if self.decoder.classes is not None:
                        self.decoder.classes.add(cls)
            elapsed = time.monotonic() - progress.started
            left = len(progress.graphs) - len(done)
            # the graphs left, at the mean compile time of those in, shared among the workers
            mean = sum(g.seconds for g in done) / len(done)  # type: ignore[misc]
            estimate = f"; about {mean * left / self.workers:.0f} s left" if left else ""
            self.say(f"compiled decoding: graph {len(done)} of {len(progress.graphs)} in ({describe(key)}, "
                     f"{graph.seconds:.0f} s) after {elapsed:.0f} s{estimate}"
                     + (f"; {_opened(progress.ready)}" if progress.ready else ""))  # fmt: skip

    def _load_stored(self, needs: dict[tuple, set[str]]) -> None:
        """Every graph of a stored plan adopted in turn, each class opened once its graphs are in, as the
        workers' events would; a package that does not load leaves its classes eager, said once."""
        with self.lock:
            for key, classes in needs.items():
                self.progress.graphs[key] = Graph(key, classes, worker=0)
        try:
            for key in needs:
                self._event(
                    0, {"graph": list(key), "path": str(self.decoder.package_path(key)), "seconds": 0.0}
                )
        except Exception as failure:  # (a damaged package: the next start compiles it again)
            with self.lock:
                self._fail(f"a stored graph did not load ({type(failure).__name__}: {failure})")
        for index in range(self.workers):
            self._finished(index, None)

    def _missing(self) -> list[tuple]:
        return [key for key, graph in self.progress.graphs.items() if graph.seconds is None]

    def _fail(self, message: str, details: str = "") -> None:
        if self.progress.state == "compiling":
            self.progress.state = "failed"
            self.progress.error = message
            self.say(f"compiled decoding: {message}; decoding stays eager for what is not compiled"
                     + (f"\n{details.rstrip()}" if details else ""))  # fmt: skip


def _opened(ready: list[str]) -> str:
    return "compiled now: " + ", ".join(_sentences(c) for c in ready)


def _key(value: list) -> tuple:
    """A graph's key from JSON (lists back to the tuple)."""
    return tuple(value)


class _no_such_process:
    """Around a signal to a worker that may have ended already."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, trace: Any) -> bool:
        return kind is ProcessLookupError


def warm_up_batches(
    translator: Any, searches: list[SearchConfig], sizes: dict[str, int], planning: bool = False
) -> Iterator[tuple[str, Callable[[], Any]]]:
    """Each class's warm-up batch with each search: (class, a function translating it). Its sentences are
    of different lengths, LINE_TOKENS and fewer (about a Multi30k sentence's), so that they end at
    different steps, as a real batch's do, and the batch meets the graphs of fewer live sentences too.
    planning: the searches stop PLAN_STEPS past each source's length (the graphs a batch meets do not
    depend on how long it decodes, only on its sentences ending at different steps: a model with random
    weights, never ending a sentence, decoded each for its source length + 50)."""
    vocabulary = translator.model.config.src_vocab_size
    tokens = [4 + i % (vocabulary - 4) for i in range(LINE_TOKENS - 1)]
    if planning:
        searches = [dataclasses.replace(s, max_len_a=1.0, max_len_b=PLAN_STEPS) for s in searches]
    for cls, sentences in sizes.items():
        lines = [tokens[: len(tokens) - i % 8] + [EOS_ID] for i in range(sentences)]
        for search in searches:
            yield cls, lambda search=search, lines=lines: translator.translate_ids(lines, search)
