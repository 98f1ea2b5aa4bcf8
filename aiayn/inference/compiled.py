"""A decoding step compiled with torch.compile: a static key/value cache, the position as a tensor, a
graph per class of batches (one sentence, a few, many). Eager decoding (model.py) is the reference.

Shapes: as model.py. R rows of the cache (B sentences x N hypotheses), T_max target positions, S source
positions, V vocabulary.

Why: at one sentence a decoding step of a small model is about 140 PyTorch operator calls, each with a
fixed cost whatever its size; one compiled graph runs the step as a few fused kernels
(benchmarks/bench_translate.py measures both).
Nothing in a step may change a shape or a Python value the graph depends on, or torch.compile traces
it again (a recompilation), so:
- every layer's self-attention keys/values live in (R, T_max, D) buffers written at a position held
  in a (1,) tensor; attention reads all T_max positions through a mask (positions <= the current one);
  a beam's hypotheses read theirs through a table of where each was written (StaticCache), so following
  their parents moves no keys or values;
- a batch keeps its R rows to the end; when sentences finish, search drops them and the rows left over
  repeat the last live one (computed, never read);
- the source length S and T_max are marked dynamic, and in the graphs of a few or many sentences B and R
  too (row_class): one graph serves every batch of its class;
- once a graph exists it runs without dynamo's checks on the way in (CompiledDecoder._call).

Compiling costs a process tens of seconds per graph, and torch.compile's own caches still trace every
graph again in the next process. With a store (`--compile` has one: default_store), each graph is
instead exported (torch.export) and compiled ahead of time into an AOTInductor package, weights frozen
in, which a later process loads in seconds: no tracing, no guards, the same kernels.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import sys
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from aiayn import precision
from aiayn.files import atomic_write
from aiayn.inference import compiler
from aiayn.inference.search import BeamLive, BeamStep, Decoder, GreedyStep, beam_candidates, greedy_candidates
from aiayn.model import DecoderCache, Memory, Transformer
from aiayn.precision import Int8Linear, cpu_flags, cpu_info, traced_rows
from aiayn.tokenizer import PAD_ID


@dataclass
class StaticLayerCache:
    """One decoder layer's keys and values for a compiled step: every buffer keeps its shape."""

    # (R, T_max, D): buffer row r holds, at position t, what the row r of step t wrote; with `source`, rows
    # read their earlier positions from where their ancestors wrote them. Positions past `length` are
    # masked and hold zeros or stale keys/values, never uninitialised memory: a masked weight of 0 times a
    # NaN there would still be NaN.
    self_k: Tensor
    self_v: Tensor  # (R, T_max, D)
    cross_k: Tensor  # (B, S, D) from the encoder output, computed once
    cross_v: Tensor  # (B, S, D)
    length: Tensor  # (1,) int64 shared by all layers: positions written before this step
    positions: Tensor  # (T_max,) 0..T_max-1, shared
    source: Tensor | None  # (T_max, R) int64 or None, shared: StaticCache.source

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write one new position's keys and values (R, 1, D), each row in its own buffer row; returns each
        row's T_max positions (R, T_max, D) and the (1, T_max) mask of the written ones, the new one
        included. StaticCache.advance moves on."""
        self.self_k.index_copy_(1, self.length, k)
        self.self_v.index_copy_(1, self.length, v)
        mask = (self.positions <= self.length)[None]  # (1, T_max)
        if self.source is None:
            return self.self_k, self.self_v, mask
        # A gather that inductor fuses into the attention's loops (no copy is made). `source` is (T_max, R):
        # with a (R, T_max) table, its loads outnumbered the values' and inductor vectorised the weighted sum
        # of values over positions instead of features, a scalar load per value (several times slower a step).
        R, T, D = self.self_k.shape
        where = self.source.t()  # (R, T_max) positions in the buffers seen as (R * T_max, D)
        return self.self_k.view(R * T, D)[where], self.self_v.view(R * T, D)[where], mask


@dataclass
class StaticCache:
    """What a compiled decoding step keeps between steps; the same interface as model.DecoderCache.

    A beam's hypotheses follow their parents without moving keys and values: `source` (T_max, R) holds, for
    each position t and row r, where in the buffers (seen as (R * T_max, D)) row r's keys and values of
    position t are: buffer row * T_max + t. A reorder gathers this table's columns (eager decoding copies
    the buffers' rows instead, model.gather_rows: 2L x (R, T_max, D) values every step); a step writes its
    position in each row's own buffer row and says so in the table (`claim`). A position once written never
    changes, so every ancestor's keys stay where they are. A cache of one row per sentence (greedy) has no
    table: its rows only ever leave, and are copied then."""

    layers: list[StaticLayerCache]
    src_mask: Tensor  # (B, 1, 1, S), never None: a graph for "no padding" would be a second graph
    rows: int  # R: the rows every step computes; search uses the first ones, the others repeat the last
    row_class: str  # of its batch (row_class): B and R are dynamic sizes in the few and many classes
    source: Tensor | None = None  # (T_max, R) int64 after `expand`: row r's position t is at source[t, r]
    vocabulary: Tensor | None = None  # (V',) a shortlist, as model.DecoderCache
    output: Tensor | None = None  # (V', D)

    @property
    def length(self) -> Tensor:
        return self.layers[0].length

    def claim(self) -> None:
        """In a step's graph, before it: the position it writes is, for every row, in its own buffer row."""
        if self.source is not None:
            T = self.source.size(0)
            own = torch.arange(self.rows, device=self.source.device)[None] * T + self.length  # (1, R)
            self.source.index_copy_(0, self.length, own)

    def advance(self) -> None:
        """After a step: its position is written in every layer."""
        self.length.add_(1)

    def arguments(self) -> tuple:
        """The cache as the step's flat arguments (what torch.export takes; `step` rebuilds it)."""
        layers = self.layers
        return (self.length, layers[0].positions, self.source, self.src_mask, [c.self_k for c in layers],
                [c.self_v for c in layers], [c.cross_k for c in layers], [c.cross_v for c in layers],
                self.vocabulary, self.output)  # fmt: skip

    def expand(self, n: int) -> None:
        """n rows per sentence (beam search), before the first step: zeros of R * n rows (nothing is
        written yet), each row its own."""
        assert self.source is None, "expand a cache once, before its first step"
        T = self.layers[0].self_k.size(1)
        self.rows *= n
        own = torch.arange(self.rows, device=self.length.device)[None] * T  # (1, R) buffer row r, position 0
        self.source = self._rows(_dynamic(own + torch.arange(T, device=self.length.device)[:, None], 0), 1)
        for layer in self.layers:  # (T_max, R) above
            layer.self_k, layer.self_v = (
                self._rows(_dynamic(layer.self_k.new_zeros(self.rows, *layer.self_k.shape[1:]), 1), 0)
                for _ in range(2)
            )  # 2 x (R * n, T_max, D)
            layer.source = self.source

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> None:
        """index (R',), R' <= R: the rows that make the new ones; sentences (B',): those that stay."""
        index = _pad(index, self.rows)  # (R,)
        if self.source is not None:  # only the table moves: (T_max, R) indices
            self.source = self._rows(_dynamic(self.source.index_select(1, index), 0), 1)
        for layer in self.layers:
            if self.source is None:  # greedy: finished sentences leave, once each per batch
                layer.self_k = self._rows(
                    _dynamic(layer.self_k.index_select(0, index), 1), 0
                )  # (R, T_max, D)
                layer.self_v = self._rows(_dynamic(layer.self_v.index_select(0, index), 1), 0)
            layer.source = self.source
            if sentences is not None:
                keep = _pad(sentences, layer.cross_k.size(0))  # (B,)
                layer.cross_k = _batch(_dynamic(layer.cross_k.index_select(0, keep), 1), 0, self.row_class)
                layer.cross_v = _batch(_dynamic(layer.cross_v.index_select(0, keep), 1), 0, self.row_class)
        if sentences is not None:
            mask = self.src_mask.index_select(0, _pad(sentences, self.src_mask.size(0)))  # (B, 1, 1, S)
            self.src_mask = _batch(_dynamic(mask, 3), 0, self.row_class)

    def _rows(self, t: Tensor, dim: int) -> Tensor:
        """t with its size along dim, R, marked as the cache's rows (_batch)."""
        return _batch(t, dim, self.row_class, "rows")


@dataclass
class CompiledMemory(Memory):
    """A batch's memory as the compiled graph gives it: with each decoder layer's cross keys and values."""

    cross: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # 2 x (B, S, D) per layer


def _dynamic(t: Tensor, dim: int) -> Tensor:
    """t, its size along dim marked as one that changes from batch to batch (S, T_max, a shortlist's V'):
    a graph compiled with it takes any size there. Every buffer a step reads is marked where it is made."""
    torch._dynamo.maybe_mark_dynamic(t, dim)
    return t


def _batch(t: Tensor, dim: int, row_class: str, size: str = "sentences") -> Tensor:
    """t with its size along dim, the batch's sentences B (or the rows R of a cache: size "rows"), dynamic
    where its graph serves a class of several numbers of sentences, fixed for one sentence. B is bounded
    to its class (SENTENCES), so that torch.compile makes a graph per class as export does. The size is
    named on the tensor: an exported graph is told that R is N times B (_shapes), which attention over each
    sentence's rows relies on, rather than left to find that R happens to divide by B."""
    if row_class == "one":
        return t
    _dynamic(t, dim)
    if size == "sentences":
        least, most = SENTENCES[row_class]
        torch._dynamo.mark_dynamic(t, dim, min=least, max=most)
    t._aiayn_sizes = {**getattr(t, "_aiayn_sizes", {}), dim: size}  # type: ignore[attr-defined]
    return t


# --- Row classes: which batches one graph serves ------------------------------------------------------

# A graph serves one class of batches: one sentence (every size fixed: 1 row, or a beam's N), a few or many
# sentences (their number B a dynamic size, at least 2: 0 and 1 would be graphs of their own). A graph
# per class rather than per number of sentences: each graph costs a compile. Two batched classes, because
# a matrix product's kernel is chosen for the rows of the batch the graph is compiled with (compiler.py:
# inductor's own kernel at a few rows, oneDNN's at many), and each class's batches are on one side of
# where the faster kernel changes.
MANY = 8  # the fewest sentences of the many class; the few class is 2 to MANY - 1
# The most sentences of the many class: export needs a bound on every size, the rows (the sentences
# times the beam) included, and this is far above any batch a graph is given (CompiledDecoder.max_sentences)
MOST = 1 << 16
# the least and most sentences of a class; "any": a graph both batched classes share (shared_class)
SENTENCES = MappingProxyType({"few": (2, MANY - 1), "many": (MANY, MOST), "any": (2, MOST)})
# What a graph's kernels and int8 routes are chosen for where its rows are dynamic (compiling): the
# sentences of a batch of its class, and for the memory, tokens a sentence (about a Multi30k sentence's).
TRACED_SENTENCES = MappingProxyType({"one": 1, "few": 4, "many": 32, "any": 32})
TRACED_TOKENS = 16


def row_class(sentences: int) -> str:
    """The class of graphs a batch of this many sentences decodes with: "one", "few" or "many"."""
    return "one" if sentences == 1 else "few" if sentences < MANY else "many"


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


def _pad(index: Tensor, n: int) -> Tensor:
    """index (m,), m <= n, followed by copies of its last element: (n,)."""
    if index.numel() == n:
        return index
    return torch.cat([index, index[-1:].expand(n - index.numel())])


def dynamo_limits() -> contextlib.AbstractContextManager:
    """What dynamo allows while a graph is traced: each row class and search is a graph of its own (three
    classes, times greedy and each beam size), more than its default of 8 a function, after which it would
    run eager; and never a silent fall back to eager. Around tracing only, not for the process."""
    return torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True)


class CompiledDecoder(Decoder):
    """The narrow model interface of search.py (encode, new_cache, decode) over a compiled step.

    A batch of up to max_sentences sentences decodes with the graphs of its row class (one sentence, a
    few, many: row_class), which take any number of sentences in the class. Larger batches decode
    eagerly: there the matrix products are big enough for the BLAS, and eager search drops finished
    sentences while a fixed-shape step keeps computing their rows (on Multi30k's validation file in
    4,096-token batches, compiled greedy was slower than eager).

    One class for all of it, past the usual size, because its graphs share one cache layout, one key
    for a graph and one store: the cache's own work is StaticCache's, a stored graph's _Package's.

    With a store, the graphs are AOTInductor packages kept there (what `--compile` uses); without,
    torch.compile compiles them in memory. The packages run faster than graphs in memory in most of
    benchmarks/bench_translate.py's cells, and a later process loads them in seconds.
    """

    def __init__(
        self, model: Transformer, max_sentences: int = 32, store: str | Path | None = None, **options: Any
    ):
        self.model = model.eval()
        self.config = model.config
        self.max_sentences = min(max_sentences, MOST)  # larger batches decode eagerly
        self.options = compile_options(model, **options)
        # store: a directory of AOTInductor packages, one per graph and model, which a later process
        # loads in a second or two instead of tracing and compiling again (None: compile in memory)
        self.store = Path(store) if store is not None else None

        def step(tokens: Tensor, *cache: Any) -> Tensor:
            """tokens (R, 1) and StaticCache.arguments() -> logits (R, 1, V) at the cache's next position:
            the graph compiled."""
            length, positions, source, src_mask, self_k, self_v, cross_k, cross_v, vocabulary, output = cache
            layers = [
                StaticLayerCache(*kv, length, positions, source)
                for kv in zip(self_k, self_v, cross_k, cross_v)
            ]
            # (the row class only says which sizes to mark dynamic, outside the graph)
            static = StaticCache(layers, src_mask, tokens.size(0), "one", source, vocabulary, output)
            static.claim()
            logits = model.decode(tokens, None, static)  # type: ignore[arg-type]
            static.advance()
            return logits

        def memory(src: Tensor, mask: Tensor) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
            """src (B, S) and its mask -> the encoder's states (B, S, D) and each decoder layer's cross
            keys and values of them: what a batch computes once, one graph rather than two to compile."""
            states = model.encoder_states(src, mask)
            return states, model.cross_keys_values(states)

        # the step, once per batch the memory (S is dynamic), and a search's own tensor work after each
        # step (beam or greedy); each compiled by torch.compile on its first call, or exported to the store
        self.graphs = {"step": step, "memory": memory, "beam": _beam_work, "greedy": _greedy_work}
        # torch.compile's wrapper of each graph, made at its first call in memory: making one imports
        # dynamo, a part of a server's start before its first answer that a store's packages never need
        self.compiled: dict[str, Callable[..., Any]] = {}
        self.compile_seconds = 0.0  # the first call of each graph, compile included
        self.load_seconds = 0.0  # reading graphs compiled by an earlier process from the store
        self._seen: set[tuple] = set()  # the keys of the graphs compiled in memory
        self._graph_classes: dict[tuple, str] = {}  # _graph_class's answers: asked at every step
        self._packages: dict[tuple, _Package] = {}  # the keys of the graphs from the store
        self._fingerprint: str | None = None
        self._search_fingerprint: str | None = None
        # the graphs this decoder compiles, by key: all of them, or those a worker of warmup.py was given
        # (it runs the others eagerly, only to go on)
        self.compiles: Callable[[tuple], bool] = lambda key: True
        self.calls: list[tuple] | None = None  # a list: every graph call's key is added to it
        self.on_compiled: Callable[[tuple, Path | None, float], None] | None = None  # (key, package, s)
        # the row classes it decodes at all (None: every one); a batch of another raises NotStored, and
        # Translator decodes it eagerly
        self.classes: set[str] | None = None
        self.builds_at_once = True  # a package's two C++ builds at once (compiler.py): the cores are ours
        # whether the batch being decoded is above max_sentences: eager to its end, its search's own work too,
        # when its live sentences come to fit: a graph loaded or compiled for a batch's last steps cost more
        # than it saved (benchmarks/bench_real.py, compiled greedy)
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
        src, mask = _batch(_dynamic(src, 1), 0, graph), _batch(_dynamic(mask, 3), 0, graph)
        key = ("memory", graph, traced_format(src.device))
        states, cross = self._call(key, src, mask)  # (B, S, D), 2 x (B, S, D) a layer
        return CompiledMemory(_batch(_dynamic(states, 1), 0, cls), mask, cross=cross)

    def new_cache(self, memory: Memory, max_len: int) -> StaticCache | DecoderCache:
        B, S, D = memory.states.shape
        if B > self.max_sentences:
            return self.model.new_cache(memory, max_len)
        assert isinstance(memory, CompiledMemory), "a batch of the graphs' size is encoded by them"
        cls = row_class(B)
        max_len = max(max_len, 2)  # T_max: a size of 1 would be a graph of its own
        self.model.tgt_embed.position_table(max_len)  # long enough for every position the graph reads
        device = memory.states.device
        length = torch.zeros(1, dtype=torch.long, device=device)
        positions = _dynamic(torch.arange(max_len, device=device), 0)
        layers = []
        for k, v in memory.cross:
            # contiguous, as a `reorder` leaves them: slices of one projection have other strides, which
            # the graph is guarded on
            k, v = (_batch(_dynamic(x.contiguous(), 1), 0, cls) for x in (k, v))  # 2 x (B, S, D)
            # each buffer a storage of its own, as after a `reorder`: views of one storage would be guarded
            # on not overlapping, and the first reorder would trace the step again
            self_k, self_v = (
                _batch(_dynamic(k.new_zeros(B, max_len, D), 1), 0, cls, "rows") for _ in range(2)
            )  # 2 x (B, T_max, D): a row a sentence until a beam expands them
            layers.append(StaticLayerCache(self_k, self_v, k, v, length, positions, None))
        vocabulary = output = None
        if memory.vocabulary is not None:  # a shortlist's size changes from batch to batch too
            vocabulary = _dynamic(memory.vocabulary, 0)
            output = _dynamic(self.model.output_rows(vocabulary), 0)
        mask = _batch(_dynamic(memory.src_mask, 3), 0, cls)
        return StaticCache(layers, mask, B, cls, None, vocabulary, output)

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
        tgt_in = _batch(tgt_in.contiguous(), 0, cache.row_class, "rows")
        # the class of the batch's sentences B, and N = R / B rows a sentence (hypotheses: the cross
        # keys/values have B rows); with a beam's table or without, with a shortlist or without
        B = cache.layers[0].cross_k.size(0)
        N = cache.rows // B
        key = ("step", self._graph_class("step", cache.row_class, N), N, cache.source is not None,
               cache.output is not None, traced_format(tgt_in.device))  # fmt: skip
        return self._call(key, tgt_in, *cache.arguments())[:live]

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
            _dynamic(batched[0], vocabulary)
            if key[1] > 1:
                for t in batched:
                    _dynamic(t, 0)
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
        (skip_guard_eval_unsafe), and setting the option. That is safe here because a key's inputs differ only in the sizes
        marked dynamic, each at least 2 (0 and 1 would be graphs of their own), and a decoder's model does
        not change. A package has no guards at all: it checks only its inputs' shapes.

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
                self._tracing(),
                compiling(key, self.builds_at_once),
            ):
                out = self.compiled[key[0]](*args)
            self.compile_seconds += time.perf_counter() - start
            self._seen.add(key)
        if self.on_compiled is not None:
            self.on_compiled(
                key, self._path(key) if self.store is not None else None, time.perf_counter() - start
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
        package = _load_stored(path)
        self.load_seconds += time.perf_counter() - start
        self._packages[key] = package

    def _tracing(self) -> contextlib.AbstractContextManager:
        """What every graph is traced and compiled under. On a CPU: F.scaled_dot_product_attention written
        out as its arithmetic (PyTorch's math backend: Q K^T scaled, masked, softmax, times V) instead of a
        call of the fused CPU kernel, which inductor cannot fuse into: each attention of a graph stayed a
        call of it, with that kernel's own set-up (buffers, a parallel loop over batch x heads), six of them
        a decoding step, each costing more than its arithmetic at one sentence of `small`. Written out, one query's attention
        over a few dozen keys is a few small loops that inductor fuses with what surrounds them. Eager
        decoding keeps the fused kernel; on a GPU the graphs keep it too. (PyTorch's choice of backend is
        process-wide: while a graph is traced, eager attention in another thread runs the math one too.)"""
        if next(self.model.parameters()).device.type != "cpu":
            return contextlib.nullcontext()
        return sdpa_kernel(SDPBackend.MATH)

    def _path(self, key: tuple) -> Path:
        """Where the store keeps graph key's package: its name holds the key and the fingerprint. A search's
        own work reads no weights: its packages serve every model (the fingerprint without the model's)."""
        assert self.store is not None
        if self._search_fingerprint is None:
            self._search_fingerprint = fingerprint(self.model, self.options, weights=False)
        name = self._search_fingerprint if key[0] in SEARCH_WORK else self.model_fingerprint()
        return self.store / f"{'-'.join(map(str, key))}-{name}.pt2"

    def model_fingerprint(self) -> str:
        """fingerprint() of this decoder's model and options, which its packages' names hold: hashed once
        (a large model's weights take a small CPU a good part of a second)."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.model, self.options)
        return self._fingerprint

    def _package(self, key: tuple, args: tuple) -> _Package:
        """The AOTInductor package of graph key from the store, exported and compiled into it first if it
        is not there, or if what is there is not a whole package of this graph (_load_stored: a damaged
        store is a cache miss, said in one line on stderr). Written atomically: processes sharing a store
        never read half a file, and two compiling the same graph at once each rename a whole file of their
        own (atomic_write's temporary names are unique) over it. The package holds the model's weights as
        constants, so its name holds a hash of them."""
        path = self._path(key)
        if path.is_file():
            start = time.perf_counter()
            try:
                package = _load_stored(path)
            except _Damaged as damage:
                print(f"aiayn: {path}: {damage}; compiling it again", file=sys.stderr)
            else:
                self.load_seconds += time.perf_counter() - start
                return package
        start = time.perf_counter()
        try:
            self.store.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(
                f"{self.store}: cannot keep compiled graphs there ({error.strerror}); set "
                "AIAYN_COMPILE_STORE to a writable directory, or to none to compile in memory"
            ) from error
        compiler.prepare(next(self.model.parameters()).device)
        shapes = _shapes(key, args)
        # (inference tensors cannot be traced in place)
        with (
            torch.inference_mode(False),
            torch.no_grad(),
            self._tracing(),
            compiling(key, self.builds_at_once),
        ):
            example = pytree.tree_map_only(Tensor, torch.clone, args)
            module = _Graph(self.graphs[key[0]], None if key[0] in SEARCH_WORK else self.model)
            program = torch.export.export(module, example, dynamic_shapes={"args": shapes}, strict=False)
            # Packaged in memory, then written atomically by us: PyTorch's own package writer, out of
            # space, leaves its zip unfinished and aborts the process when it is collected.
            archive = io.BytesIO()
            # the package names its graph (its file's name, fingerprint included), which _load_stored
            # checks: a whole package of another graph under this name would run on inputs it was not
            # compiled for
            configs = {"freezing": True, "aot_inductor.metadata": {GRAPH: path.stem}, **self.options}
            # max_autotune makes inductor's own kernel of every product a candidate, which costs seconds of
            # rendering its template; where the rule would choose the library's for all of them, none is made
            configs["max_autotune"] = configs.get("max_autotune") and compiler.may_choose_template(
                _traced(key)
            )
            torch._inductor.aoti_compile_and_package(program, package_path=archive, inductor_configs=configs)
            atomic_write(path, lambda tmp: tmp.write_bytes(archive.getbuffer()))
        self.compile_seconds += time.perf_counter() - start
        # (not _load_stored: a package just compiled that does not load is an error, not a cache miss)
        start = time.perf_counter()
        package = _Package(torch._inductor.aoti_load_package(str(path)).loader)
        self.load_seconds += time.perf_counter() - start
        return package


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
    were made (_dynamic) are dynamic; a batch's sentences B are one size, bounded to the key's row class,
    and its rows R are N times that, N = R / B the rows a sentence (_batch). (The arguments that are not
    tensors are constants of the graph.)"""
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
        return {
            d: named.get(sizes.get(d), Dim.DYNAMIC) for d in getattr(t, "_dynamo_weak_dynamic_indices", ())
        }

    return pytree.tree_map(shape, args)


SEARCH_WORK = ("beam", "greedy")  # the graphs of a search's own work, which read no weights
GRAPH = "aiayn.graph"  # a package's metadata: the name of the store file it was compiled for, without .pt2


# What zipfile raises reading a damaged archive: BadZipFile is its word for it, but header fields it
# trusts, damaged, raise the others (found by flipping each byte of a package's headers). Caught around
# zipfile's reading alone, where none of them can be a mistake of ours; an OSError (the disk, a
# permission) is not damage, and goes through.
ZIP_DAMAGE = (zipfile.BadZipFile, EOFError, NotImplementedError, OverflowError, RuntimeError, ValueError,
              zlib.error)  # fmt: skip


class _Damaged(Exception):
    """A store file that is not a whole package of the graph its name names: compiled again."""


def _load_stored(path: Path) -> _Package:
    """The package at path, checked before it is trusted; _Damaged, saying why, where the file is empty,
    truncated, corrupted, not a package, or a package of another graph or of other weights."""
    # Every member's CRC-32 first: PyTorch's loader checks none, and it dlopens the library it unpacks,
    # so a few flipped bytes in it crashed the process (a segfault, or ld.so's assertion) instead of
    # raising. Stored (uncompressed) members: this reads the file once, which loading does anyway.
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                with archive.open(member) as data:
                    while data.read(1 << 20):
                        pass
    except ZIP_DAMAGE as error:
        raise _Damaged(f"not a whole package ({error})") from None
    # A whole zip archive that is no AOTInductor package (no library for its model in it) is refused with
    # a RuntimeError, as is a library that cannot be loaded; only the loader runs in the try.
    try:
        loaded = torch._inductor.aoti_load_package(str(path))
    except RuntimeError as error:
        raise _Damaged(f"not a package PyTorch can load ({str(error).splitlines()[0]})") from None
    # A whole package of another graph (another key, or another fingerprint's weights) loads and then runs
    # on arguments it was not compiled for: with other shapes of as many tensors, nothing checks them.
    graph = loaded.get_metadata().get(GRAPH)
    if graph != path.stem:
        raise _Damaged(f"a package of {graph or 'an unnamed graph'}, not of {path.stem}")
    return _Package(loaded.loader)


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


class _Package:
    """A loaded AOTInductor package called with the graph's own arguments. Its own __call__ parses its
    input and output specifications from JSON on every call; this reads the output's once."""

    def __init__(self, loader: Any):
        self.run = loader.boxed_run
        self.out_spec = pytree.treespec_loads(loader.get_call_spec()[1])

    def __call__(self, *args: Any) -> Any:
        return pytree.tree_unflatten(self.run(_tensors(args, [])), self.out_spec)


def _tensors(args: tuple | list, out: list[Tensor]) -> list[Tensor]:
    """The tensors of args, nested in tuples and lists, in pytree's order (a package takes them flat; the
    other leaves are constants of the graph). Cheaper than pytree.tree_leaves, on every step's call."""
    for arg in args:
        if isinstance(arg, Tensor):
            out.append(arg)
        elif isinstance(arg, (tuple, list)):
            _tensors(arg, out)
    return out


class _Graph(torch.nn.Module):
    """One of CompiledDecoder.graphs as the module torch.export takes; the model a submodule, so that
    its weights are the program's parameters (frozen into constants by the package)."""

    def __init__(self, fn: Callable, model: Transformer | None):
        super().__init__()
        self.fn, self.model = fn, model  # None: a graph that reads no weights (a search's own work)

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def default_store() -> Path | None:
    """Where `--compile` keeps its packages between processes: $AIAYN_COMPILE_STORE ("" or "none": nowhere,
    compile in memory in every process), else $XDG_CACHE_HOME/aiayn/compiled (~/.cache/aiayn/compiled)."""
    value = os.environ.get("AIAYN_COMPILE_STORE")
    if value is not None:
        return None if value.strip().lower() in ("", "none") else Path(value)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aiayn" / "compiled"


# The source files the graphs are traced from: a package compiled from other code (an older aiayn, or
# one edited in place) must never be loaded, whatever the weights.
TRACED_CODE = (
    "model.py",
    "precision.py",
    "inference/search.py",
    "inference/compiled.py",
    "inference/compiler.py",
)


def fingerprint(model: Transformer, options: dict, weights: bool = True) -> str:
    """A hash of what a compiled package depends on: the weights, the modules that use them and the
    model's configuration (the number of heads, say, which no weight shows), the code traced, the compile
    options, PyTorch's version and the processor (kernels are compiled for its instructions). weights=False:
    all but the model's own (its device aside), for a graph that reads none (a search's own work)."""
    digest = hashlib.blake2b(digest_size=12)
    for name in TRACED_CODE:
        digest.update((Path(__file__).parents[1] / name).read_bytes())
    modules = []
    if weights:
        digest.update(repr(model.config).encode())
        modules = [
            (name, type(m).__name__, sorted(m.routes.items()) if isinstance(m, Int8Linear) else None)
            for name, m in model.named_modules()
        ]
    cpu = cpu_info()
    device = next(model.parameters()).device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    # (the vector instructions PyTorch and inductor use, which ATEN_CPU_CAPABILITY may cap below the CPU's)
    isa = torch.backends.cpu.get_cpu_capability()
    digest.update(repr((modules, sorted(options.items()), torch.__version__, cpu.get("model name"),
                        cpu.get("cpu family"), cpu.get("model"), sorted(cpu_flags()), isa, str(device), gpu,
                        sorted(compiler.template_rows().items()), sorted(TRACED_SENTENCES.items()), TRACED_TOKENS)).encode())  # fmt: skip
    for name, tensor in model.state_dict().items() if weights else ():
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


# --- Decoding with the graphs an earlier compile stored, and no other (compile="stored") -----------------


def traced_format(device: torch.device) -> str:
    """The number format a graph of the model called now runs in: the autocast in force around the call,
    part of the graph's key. A graph keeps the casts it was traced with, so one model's fp32 and bf16
    graphs are different graphs, and a store holding one must not serve the other (a search's own
    work is keyed by its logits' dtype)."""
    if torch.is_autocast_enabled(device.type):
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}[torch.get_autocast_dtype(device.type)]
    return "fp32"


def compile_options(model: Transformer, **options: Any) -> dict[str, Any]:
    """The inductor options CompiledDecoder(model, **options) compiles with, which its packages' names hold.

    max_autotune on the CPU: inductor's own C++ GEMM kernels are candidates beside the library's call for
    each matrix product, several times faster at a few rows; compiler.py picks one by the rows, timing
    none. On a GPU it would time Triton templates for every product of every graph, minutes per model,
    where cuBLAS is already the fast choice: off there."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    return {"max_autotune": on_cpu, **options}


def stored(model: Transformer, store: str | Path | None, **options: Any) -> bool:
    """Whether store holds graphs of this model: packages that CompiledDecoder(model, store=store,
    **options) would load (the same weights, layout, configuration, code, options, PyTorch and processor).
    Cheap where the store holds no packages at all; else the weights are hashed (fingerprint), and no
    compiler is imported."""
    if store is None or not any(Path(store).glob("*.pt2")):
        return False
    return any(Path(store).glob(f"*-{fingerprint(model, compile_options(model, **options))}.pt2"))


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

    def __init__(self, model: Transformer, store: str | Path, max_sentences: int = 32, **options: Any):
        super().__init__(model, max_sentences, store, **options)

    def _call(self, key: tuple, *args: Any) -> Any:
        if key not in self._packages and not self._path(key).is_file():
            raise NotStored(key)
        return super()._call(key, *args)
