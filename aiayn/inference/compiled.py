"""A decoding step compiled with torch.compile: a graph per class of batches (one sentence, a few, many)
over the static key/value cache of static_cache.py, and the search's own work after each step. Eager
decoding (model.py) is the reference.

Shapes: as model.py. R rows of the cache (B sentences x N hypotheses), S source positions, V vocabulary.

Why: a decoding step of a small model is about 140 PyTorch operator calls, each with a fixed cost
whatever its size; one compiled graph runs the step as a few fused kernels (benchmarks/bench_translate.py
and bench_real.py measure both). A graph takes every size its cache marks dynamic (static_cache.py), so
one serves every batch of its class; once it exists it runs without dynamo's checks on the way in
(CompiledDecoder._call).

Compiling costs a process tens of seconds per graph, and torch.compile's own caches still trace every
graph again in the next process. With a store (`--compile` has one: graph_store.default_store), each graph
is instead exported (torch.export) and compiled ahead of time into an AOTInductor package, weights frozen
in, which a later process loads without tracing, guards, dynamo or inductor: the same kernels.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from aiayn import precision
from aiayn.inference import compiler
from aiayn.inference.graph_store import (
    GRAPH,
    SEARCH_WORK,
    GraphStore,
    Package,
    compile_options,
    load_stored,
    tensors,
)
from aiayn.inference.search import BeamLive, BeamStep, Decoder, GreedyStep, beam_candidates, greedy_candidates
from aiayn.inference.static_cache import (
    DYNAMIC,
    GROWTH,
    MOST,
    SENTENCES,
    TRACED_SENTENCES,
    TRACED_TOKENS,
    CompiledMemory,
    StaticCache,
    StaticLayerCache,
    dynamic,
    row_class,
    sized,
)
from aiayn.model import DecoderCache, Memory, Transformer
from aiayn.precision import traced_rows
from aiayn.tokenizer import PAD_ID


def _mark_dynamic(args: tuple) -> None:
    """Dynamo's marks of the sizes `dynamic` marked on the tensors of args, for torch.compile in memory."""
    for t in tensors(args, []):
        for dim, bounds in getattr(t, DYNAMIC, {}).items():
            torch._dynamo.maybe_mark_dynamic(t, dim)
            if bounds is not None:
                torch._dynamo.mark_dynamic(t, dim, min=bounds[0], max=bounds[1])


def shared_class(kind: str, cls: str, per_sentence: int = 1) -> str:
    """The class of the stored graph a batch of class cls decodes its `kind` ("memory", or "step" with
    per_sentence rows a sentence) with: "any" where the few and the many classes would compile the same
    graph, every choice made by the traced rows the same (each kind of matrix product's kernel,
    compiler.TEMPLATE_ROWS, and the int8 layers' route, precision.row_class), else cls. A graph fewer
    to compile; the few sentences then run the many's kernels, as they would their own (a memory's rows
    are many in both, and so are a beam's steps where inductor's own kernel stops at 16 rows)."""
    if cls not in ("few", "many"):
        return cls
    few, many = (_traced((kind, c, per_sentence)) for c in ("few", "many"))
    return "any" if _choices(few) == _choices(many) else cls


def _choices(rows: int | None) -> tuple:
    """What a graph traced for this many rows chooses by them (shared_class)."""
    if rows is None:
        return ()
    return precision.row_class(rows), tuple(rows < limit for limit in compiler.template_rows().values())


def dynamo_limits() -> contextlib.AbstractContextManager:
    """What dynamo allows while a graph is traced: each row class and search is a graph of its own (three
    classes, times greedy and each beam size), more than its default of 8 a function, after which it would
    run eager; and never a silent fall back to eager. Around tracing only, not for the process."""
    return torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True)


class CompiledDecoder(Decoder):
    """The narrow model interface of search.py (encode, new_cache, decode) over a compiled step.

    A batch of up to max_sentences sentences (any, unless told) decodes with the graphs of its row class
    (one sentence, a few, many: row_class), which take any number of sentences in the class; a larger
    one eagerly. Its cache drops finished sentences and grows with the output (StaticCache), so a step
    costs what the live sentences need: on whole files, faster than eager decoding at every batch size
    (benchmarks/bench_real.py).

    With a store, the graphs are AOTInductor packages kept there (what `--compile` uses, GraphStore);
    without, torch.compile compiles them in memory. The packages run faster than graphs in memory in most
    of benchmarks/bench_translate.py's cells, and a later process loads them without a compiler.
    """

    def __init__(
        self, model: Transformer, max_sentences: int = MOST, store: str | Path | None = None, **options: Any
    ):
        self.model = model.eval()
        self.config = model.config
        self.max_sentences = min(max_sentences, MOST)  # larger batches decode eagerly
        self.options = compile_options(model, **options)
        # store: a directory of AOTInductor packages, one per graph and model, which a later process
        # loads in a fraction of a second instead of tracing and compiling again (None: compile in memory)
        self.store = Path(store) if store is not None else None
        self._store = GraphStore(self.store, model, self.options) if store is not None else None

        # the step, once per batch the memory (S is dynamic), and a search's own tensor work after each
        # step (beam or greedy); each compiled by torch.compile on its first call, or exported to the store
        self.graphs = {"step": partial(_step, model), "memory": partial(_memory, model), "beam": _beam_work,
                       "greedy": _greedy_work}  # fmt: skip
        # torch.compile's wrapper of each graph, made at its first call in memory: making one imports
        # dynamo, a part of a server's start before its first answer that a store's packages never need
        self.compiled: dict[str, Callable[..., Any]] = {}
        self.compile_seconds = 0.0  # the first call of each graph, compile included
        self.load_seconds = 0.0  # reading graphs compiled by an earlier process from the store
        self._seen: set[tuple] = set()  # the keys of the graphs compiled in memory
        self._graph_classes: dict[tuple, str] = {}  # _graph_class's answers: asked at every step
        self._packages: dict[tuple, Package] = {}  # the keys of the graphs from the store
        # the graphs this decoder compiles, by key: all of them, or those a worker of warmup.py was given
        # (it runs the others eagerly, only to go on)
        self.compiles: Callable[[tuple], bool] = lambda key: True
        self.calls: list[tuple] | None = None  # a list: every graph call's key is added to it
        self.on_compiled: Callable[[tuple, Path | None, float], None] | None = None  # (key, package, s)
        # the row classes it decodes at all (None: every one); a batch of another raises NotStored, and
        # Translator decodes it eagerly
        self.classes: set[str] | None = None
        self.builds_at_once = True  # a package's two C++ builds at once (compiler.py): the cores are ours
        # whether the batch being decoded is above max_sentences: eager to its end, its search's work too
        self._eager_batch = False

    def encode(self, src: Tensor) -> Memory:
        """src (B, S) -> memory, with each decoder layer's cross keys and values (CompiledMemory)."""
        B = src.size(0)
        self._eager_batch = B > self.max_sentences
        if self._eager_batch:
            return self.model.encode(src)
        cls = row_class(B)
        if self.classes is not None and cls not in self.classes:
            raise NotStored(("memory", cls))
        # a new tensor either way: a caller's tensor made outside inference mode has other dispatch keys,
        # which the graph is guarded on
        src = src.clone()  # (B, S)
        if src.size(1) < 2:  # a size of 1 would be a graph of its own: pad it (masked, so nothing changes)
            src = torch.cat([src, src.new_full((B, 1), PAD_ID)], dim=1)  # (B, 2)
        mask = self.model.src_mask(src)
        if mask is None:
            mask = torch.ones(B, 1, 1, src.size(1), dtype=torch.bool, device=src.device)  # (B, 1, 1, S)
        graph = self._graph_class("memory", cls)
        src, mask = sized(dynamic(src, 1), 0, graph), sized(dynamic(mask, 3), 0, graph)
        key = ("memory", graph, traced_format(src.device))
        states, cross = self._call(key, src, mask)  # (B, S, D), 2 x (B, S, D) a layer
        return CompiledMemory(sized(dynamic(states, 1), 0, cls), mask, cross=cross)

    def new_cache(self, memory: Memory, max_len: int) -> StaticCache | DecoderCache:
        B, S, D = memory.states.shape
        if B > self.max_sentences:
            return self.model.new_cache(memory, max_len)
        assert isinstance(memory, CompiledMemory), "a batch of the graphs' size is encoded by them"
        cls = row_class(B)
        max_len = max(max_len, 2)  # a size of 1 would be a graph of its own
        self.model.tgt_embed.position_table(max_len)  # long enough for every position the graph reads
        device = memory.states.device
        length = torch.zeros(1, dtype=torch.long, device=device)
        T = min(max_len, GROWTH)  # the buffers' positions, grown as they fill (StaticCache.make_room)
        positions = dynamic(torch.arange(T, device=device), 0)
        layers = []
        for k, v in memory.cross:
            # contiguous, as a `reorder` leaves them: slices of one projection have other strides, which
            # the graph is guarded on
            k, v = (sized(dynamic(x.contiguous(), 1), 0, cls) for x in (k, v))  # 2 x (B, S, D)
            # each buffer a storage of its own, as after a `reorder`: views of one storage would be guarded
            # on not overlapping, and the first reorder would trace the step again
            self_k, self_v = (
                sized(dynamic(k.new_zeros(B, T, D), 1), 0, cls, "rows") for _ in range(2)
            )  # 2 x (B, T_max, D): a row a sentence until a beam expands them
            layers.append(StaticLayerCache(self_k, self_v, k, v, length, positions, None))
        vocabulary = output = None
        if memory.vocabulary is not None:  # a shortlist's size changes from batch to batch too
            vocabulary = dynamic(memory.vocabulary, 0)
            output = dynamic(self.model.output_rows(vocabulary), 0)
        mask = sized(dynamic(memory.src_mask, 3), 0, cls)
        return StaticCache(layers, mask, B, cls, None, vocabulary, output, max_len=max_len)

    def decode(
        self, tgt_in: Tensor, memory: Memory | None, cache: StaticCache | DecoderCache | None = None
    ) -> Tensor:
        """tgt_in (R', 1), R' <= the cache's rows -> logits (R', 1, V)."""
        if not isinstance(cache, StaticCache):  # a large batch: eager
            return self.model.decode(tgt_in, memory, cache)
        assert tgt_in.size(1) == 1, "a compiled step decodes one position at a time"
        live = tgt_in.size(0)
        if live < cache.rows:
            tgt_in = torch.cat([tgt_in, tgt_in.new_full((cache.rows - live, 1), PAD_ID)])  # (R, 1)
        # beam search passes a column of its tokens: strides are guarded too
        tgt_in = sized(tgt_in.contiguous(), 0, cache.row_class, "rows")
        # the class of the batch's sentences B, and N = R / B rows a sentence (hypotheses: the cross
        # keys/values have B rows); with a beam's table or without, with a shortlist or without
        B = cache.layers[0].cross_k.size(0)
        N = cache.rows // B
        key = ("step", self._graph_class("step", cache.row_class, N), N, cache.source is not None,
               cache.output is not None, traced_format(tgt_in.device))  # fmt: skip
        cache.make_room()
        logits = self._call(key, tgt_in, *cache.arguments())[:live]
        cache.written += 1
        return logits

    def beam_candidates(
        self,
        logits: Tensor,
        live: BeamLive,
        length: Tensor,
        n_best: int,
        alpha: float,
        kind: str,
        stopping: str,
    ) -> BeamStep:
        """search.beam_candidates as one graph for one sentence and one for any number of them (B and V
        dynamic), per beam, n_best and penalty: at one sentence of `small`, eager, its 30-odd operators
        took half as long as the compiled step (benchmarks/bench_translate.py)."""
        if self._eager_batch or logits.size(0) > self.max_sentences:
            return beam_candidates(logits, live, length, n_best, alpha, kind, stopping)
        key = (
            "beam",
            min(logits.size(0), 2),
            logits.size(1),
            n_best,
            alpha,
            kind,
            stopping,
            str(logits.dtype),
        )
        args = (logits, *live, length, n_best, alpha, kind, stopping)
        return BeamStep(*self._search_work(key, 2, (logits, *live), args))

    def greedy_candidates(
        self, logits: Tensor, log_prob: Tensor, limit: Tensor, length: Tensor
    ) -> GreedyStep:
        """search.greedy_candidates as one graph for one sentence and one for any number (B and V dynamic)."""
        if self._eager_batch or logits.size(0) > self.max_sentences:
            return greedy_candidates(logits, log_prob, limit, length)
        key = ("greedy", min(logits.size(0), 2), str(logits.dtype))
        return GreedyStep(
            *self._search_work(key, 1, (logits, log_prob, limit), (logits, log_prob, limit, length))
        )

    def _search_work(self, key: tuple, vocabulary: int, batched: tuple[Tensor, ...], args: tuple) -> Any:
        """Graph key, a search's own work after a step, on args: batched[0] is the logits, whose size along
        dim `vocabulary` changes (a shortlist), and each of `batched` has the sentences along dim 0,
        dynamic past one (a size of 1 is a graph of its own)."""
        if key not in self._seen and key not in self._packages:  # the sizes a graph takes as dynamic
            dynamic(batched[0], vocabulary)
            if key[1] > 1:
                for t in batched:
                    dynamic(t, 0)
        return self._call(key, *args)

    def _graph_class(self, kind: str, cls: str, per_sentence: int = 1) -> str:
        """The class of the graph of `kind` a batch of class cls decodes with: in a store on a CPU, the few
        and the many classes share it wherever it would be the same graph (shared_class: the CPU's rules).
        (Compiled in memory each keeps its own: there a graph's sizes are bounded where its tensors are
        made, for their batch's class.)"""
        if self.store is None:
            return cls
        asked = (kind, cls, per_sentence)
        if asked not in self._graph_classes:  # asked at every step: the rules once
            on_cpu = next(self.model.parameters()).device.type == "cpu"
            self._graph_classes[asked] = shared_class(kind, cls, per_sentence) if on_cpu else cls
        return self._graph_classes[asked]

    def _call(self, key: tuple, *args: Any) -> Any:
        """The graph key[0] of self.graphs on args; the key names the graph (what changes a shape the graph
        does not take as dynamic). The first call of a key loads it from the store, or traces and compiles
        it, with freezing: the weights become constants, prepacked for the GEMMs (inductor reads that
        setting outside torch.compile's options, so it is set around the call). Later calls of a graph
        compiled in memory skip both what costs time on the way in: dynamo's guards (about 1,300 checks
        that the model and inputs are still what the graph was traced for, a large part of a batch-1
        decode call of `small`), of which only those that have told two graphs apart before are evaluated
        (skip_guard_eval_unsafe), and setting the option: safe, as a key's inputs differ only in the sizes
        marked dynamic, each at least 2 (0 and 1 would be graphs of their own), and its model is fixed. A package has no guards at all: it checks only its inputs' shapes.

        A graph this decoder does not compile (`compiles` says which) runs eagerly: a worker of warmup.py
        goes on to the graphs it does compile."""
        if self.calls is not None:
            self.calls.append(key)
        package = self._packages.get(key)
        if package is not None:
            return package(*args)
        if key in self._seen:
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    return self.compiled[key[0]](*args)
            except RuntimeError as error:  # inputs no trace of the graph fits: trace them (dynamo
                if "skip_guard_eval_unsafe" not in str(error):  # raises before running anything)
                    raise
        if not self.compiles(key):
            return self.graphs[key[0]](*args)
        start = time.perf_counter()
        if self.store is not None:
            self._packages[key] = package = self._package(key, args)
            out = package(*args)
        else:
            if key[0] not in self.compiled:
                self.compiled[key[0]] = torch.compile(
                    self.graphs[key[0]], fullgraph=True, options=self.options
                )
            with (
                torch._inductor.config.patch(freezing=True),
                dynamo_limits(),
                tracing(self.model),
                compiling(key, self.builds_at_once),
            ):
                _mark_dynamic(args)
                out = self.compiled[key[0]](*args)
            self.compile_seconds += time.perf_counter() - start
            self._seen.add(key)
        if self.on_compiled is not None:
            self.on_compiled(
                key, self.package_path(key) if self.store is not None else None, time.perf_counter() - start
            )
        return out

    def holds(self, key: tuple) -> bool:
        """Whether graph key is compiled or loaded in this decoder."""
        return key in self._packages or key in self._seen

    def adopt(self, key: tuple, path: Path) -> None:
        """Run graph key from now on with the package at path: one another process compiled (warmup.py).
        A graph this decoder has already is kept."""
        if key in self._packages:
            return
        start = time.perf_counter()
        package = load_stored(path)
        self.load_seconds += time.perf_counter() - start
        self._packages[key] = package

    def package_path(self, key: tuple) -> Path:
        """Where the store keeps graph key's package (GraphStore.path)."""
        assert self._store is not None
        return self._store.path(key)

    def model_fingerprint(self) -> str:
        """fingerprint() of this decoder's model and options, which its packages' names hold."""
        assert self._store is not None
        return self._store.fingerprint()

    def _package(self, key: tuple, args: tuple) -> Package:
        """The AOTInductor package of graph key from the store, exported and compiled into it first if it
        is not there (or damaged). The package holds the model's weights as constants, so its name holds
        a hash of them."""
        assert self._store is not None
        start = time.perf_counter()
        package = self._store.load(key)
        if package is not None:
            self.load_seconds += time.perf_counter() - start
            return package
        compiler.prepare(next(self.model.parameters()).device)
        package = self._store.write(key, lambda archive, name: export(self, key, args, archive, name))
        self.compile_seconds += time.perf_counter() - start
        return package


def export(decoder: CompiledDecoder, key: tuple, args: tuple, archive: Any, name: str) -> None:
    """decoder's graph key exported (torch.export) on args and compiled into an AOTInductor package in archive,
    its metadata naming it `name`, which load_stored checks: a whole package of another graph under
    this name would run on inputs it was not compiled for."""
    shapes = _shapes(key, args)
    # (inference tensors cannot be traced in place)
    with (
        torch.inference_mode(False),
        torch.no_grad(),
        tracing(decoder.model),
        compiling(key, decoder.builds_at_once),
    ):
        example = pytree.tree_map_only(Tensor, torch.clone, args)
        module = _Graph(decoder.graphs[key[0]], None if key[0] in SEARCH_WORK else decoder.model)
        program = torch.export.export(module, example, dynamic_shapes={"args": shapes}, strict=False)
        configs = {"freezing": True, "aot_inductor.metadata": {GRAPH: name}, **decoder.options}
        # max_autotune makes inductor's own kernel of every product a candidate, which costs seconds of
        # rendering its template; where the rule would choose the library's for all of them, none is made
        configs["max_autotune"] = configs.get("max_autotune") and compiler.may_choose_template(_traced(key))
        torch._inductor.aoti_compile_and_package(program, package_path=archive, inductor_configs=configs)


def tracing(model: Transformer) -> contextlib.AbstractContextManager:
    """What every graph is traced and compiled under. On a CPU: F.scaled_dot_product_attention written
    out as its arithmetic (PyTorch's math backend: Q K^T scaled, masked, softmax, times V) instead of a
    call of the fused CPU kernel, which inductor cannot fuse into: each attention of a graph stayed a
    call of it, with that kernel's own set-up (buffers, a parallel loop over batch x heads), six of them
    a decoding step, each costing more than its arithmetic at one sentence of `small`. Written out, one query's attention
    over a few dozen keys is a few small loops that inductor fuses with what surrounds them. Eager
    decoding keeps the fused kernel; on a GPU the graphs keep it too. (PyTorch's choice of backend is
    process-wide: while a graph is traced, eager attention in another thread runs the math one too.)"""
    if next(model.parameters()).device.type != "cpu":
        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH)


def _step(model: Transformer, tokens: Tensor, *cache: Any) -> Tensor:
    """tokens (R, 1) and StaticCache.arguments() -> logits (R, 1, V) at the cache's next position: the
    graph compiled."""
    length, positions, source, src_mask, self_k, self_v, cross_k, cross_v, vocabulary, output = cache
    layers = [
        StaticLayerCache(*kv, length, positions, source) for kv in zip(self_k, self_v, cross_k, cross_v)
    ]
    # (the row class only says which sizes to mark dynamic, outside the graph)
    static = StaticCache(layers, src_mask, tokens.size(0), "one", source, vocabulary, output)
    static.claim()
    logits = model.decode(tokens, None, static)  # type: ignore[arg-type]
    static.advance()
    return logits


def _memory(model: Transformer, src: Tensor, mask: Tensor) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """src (B, S) and its mask -> the encoder's states (B, S, D) and each decoder layer's cross keys and
    values of them: what a batch computes once, one graph rather than two to compile."""
    states = model.encoder_states(src, mask)
    return states, model.cross_keys_values(states)


@contextlib.contextmanager
def compiling(key: tuple, builds_at_once: bool) -> Iterator[None]:
    """Around the compile of graph key (compiler.compiling): where its rows are dynamic, it is traced for
    those of a batch of its class, TRACED_SENTENCES, so that its matrix products' kernels and int8 routes
    are the same whatever batch compiles it: a step's rows, N a sentence; a memory's, B x S, TRACED_TOKENS
    a sentence (its int8 layers, whose route reads the dynamic S, take the many-rows route)."""
    with traced_rows(_traced(key)), compiler.compiling(builds_at_once):
        yield


def _traced(key: tuple) -> int | None:
    """The rows graph key's matrix products are compiled for (compiling), None for a graph without any."""
    if key[0] == "step":
        return key[2] * TRACED_SENTENCES[key[1]]
    if key[0] == "memory":
        return TRACED_SENTENCES[key[1]] * TRACED_TOKENS
    return None


def _shapes(key: tuple, args: tuple) -> Any:
    """What torch.export is told of graph key's arguments: the sizes marked dynamic where the buffers
    were made (static_cache.dynamic) are dynamic; a batch's sentences B are one size, bounded to the key's
    row class, and its rows R are N times that, N = R / B the rows a sentence (static_cache.sized). (The
    arguments that are not tensors are constants of the graph.)"""
    from torch.export import Dim  # here: slow to import, and decoding from the store never needs it

    named: dict[str, Any] = {}
    if key[1] in SENTENCES:  # the memory and step graphs of a few or many sentences
        least, most = SENTENCES[key[1]]
        named["sentences"] = sentences = Dim("sentences", min=least, max=most)
        named["rows"] = key[2] * sentences if key[0] == "step" and key[2] > 1 else sentences

    def shape(t: Any) -> dict[int, Any] | None:
        if not isinstance(t, Tensor):
            return None
        sizes = getattr(t, "_aiayn_sizes", {})
        return {d: named.get(sizes.get(d), Dim.DYNAMIC) for d in getattr(t, DYNAMIC, {})}

    return pytree.tree_map(shape, args)


def _beam_work(
    logits: Tensor,
    scores: Tensor,
    limit: Tensor,
    limit_penalty: Tensor,
    best_finished: Tensor,
    n_finished: Tensor,
    length: Tensor,
    n_best: int,
    alpha: float,
    kind: str,
    stopping: str,
) -> tuple[Tensor, ...]:
    """search.beam_candidates with its named inputs and outputs flat: a graph's arguments and results are
    tensors and constants (an exported package would otherwise have to know search's types by name)."""
    live = BeamLive(scores, limit, limit_penalty, best_finished, n_finished)
    return tuple(beam_candidates(logits, live, length, n_best, alpha, kind, stopping))


def _greedy_work(logits: Tensor, log_prob: Tensor, limit: Tensor, length: Tensor) -> tuple[Tensor, ...]:
    """search.greedy_candidates with a flat result, as _beam_work."""
    return tuple(greedy_candidates(logits, log_prob, limit, length))


class _Graph(torch.nn.Module):
    """One of CompiledDecoder.graphs as the module torch.export takes; the model a submodule, so that
    its weights are the program's parameters (frozen into constants by the package)."""

    def __init__(self, fn: Callable, model: Transformer | None):
        super().__init__()
        self.fn, self.model = fn, model  # None: a graph that reads no weights (a search's own work)

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def traced_format(device: torch.device) -> str:
    """The number format a graph of the model called now runs in: the autocast in force around the call,
    part of the graph's key. A graph keeps the casts it was traced with, so one model's fp32 and bf16
    graphs are different graphs, and a store holding one must not serve the other (a search's own
    work is keyed by its logits' dtype)."""
    if torch.is_autocast_enabled(device.type):
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[torch.get_autocast_dtype(device.type)]
    return "fp32"


class NotStored(Exception):
    """A graph a StoredDecoder would have to compile: the batch that needs it decodes eagerly instead."""


class StoredDecoder(CompiledDecoder):
    """A CompiledDecoder that runs the graphs its store holds and compiles none. A batch that needs one the
    store lacks (another number of sentences, another search) raises NotStored at that graph's first call,
    and Translator decodes the batch again eagerly (the same tokens). What `aiayn translate` decodes with
    unless told: compiling costs minutes on a small CPU, more than most runs decode, so only a run given
    `--compile` pays it, and every later run has the graphs it left.

    A server compiling in the background (warmup.py) sets `classes` and adds each class once all its
    graphs are in: until then its batches decode eagerly from the start, rather than meeting a missing
    graph half way."""

    def __init__(self, model: Transformer, store: str | Path, max_sentences: int = MOST, **options: Any):
        super().__init__(model, max_sentences, store, **options)

    def _call(self, key: tuple, *args: Any) -> Any:
        if key not in self._packages and not self.package_path(key).is_file():
            raise NotStored(key)
        return super()._call(key, *args)
