"""A decoding step of fixed shapes, compiled with torch.compile: a static key/value cache, the position
as a tensor, the batch padded to a fixed number of rows. Eager decoding (model.py) is the reference.

Shapes: as model.py. R rows of the cache (B sentences x N hypotheses), B_max sentences it was made for,
T_max target positions, S source positions, V vocabulary.

Why: at one sentence a decoding step of a small model is about 140 PyTorch operator calls, each with a
fixed cost whatever its size; one compiled graph per row count runs the step as a few fused kernels
(benchmarks/bench_translate.py measures both).
Nothing in a step may change a shape or a Python value the graph depends on, or torch.compile traces
it again (a recompilation), so:
- every layer's self-attention keys/values live in (R, T_max, D) buffers written at a position held
  in a (1,) tensor; attention reads all T_max positions through a mask (positions <= the current one);
  a beam's hypotheses read theirs through a table of where each was written (StaticCache), so following
  their parents moves no keys or values;
- a batch is padded to R rows; when sentences finish, search drops them and the rows left over
  repeat the last live one (computed, never read);
- the source length S and T_max are marked dynamic: one graph serves every batch of the same rows;
- once a graph exists it runs without dynamo's checks on the way in (CompiledDecoder._call).

Compiling costs a process tens of seconds per graph, and torch.compile's own caches still trace every
graph again in the next process. With a store (`--compile` has one: default_store), each graph is
instead exported (torch.export) and compiled ahead of time into an AOTInductor package, weights frozen
in, which a later process loads in about a second: no tracing, no guards, the same kernels.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor
from torch.export import Dim
from torch.nn.attention import SDPBackend, sdpa_kernel

from aiayn.files import atomic_write
from aiayn.inference.search import BeamLive, BeamStep, Decoder, GreedyStep, beam_candidates, greedy_candidates
from aiayn.model import DecoderCache, Memory, Transformer
from aiayn.precision import Int8Linear, cpu_flags, cpu_info
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
        self.source = _dynamic(own + torch.arange(T, device=self.length.device)[:, None], 0)  # (T_max, R)
        for layer in self.layers:
            layer.self_k, layer.self_v = (
                _dynamic(layer.self_k.new_zeros(self.rows, *layer.self_k.shape[1:]), 1) for _ in range(2)
            )  # 2 x (R * n, T_max, D)
            layer.source = self.source

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> None:
        """index (R',), R' <= R: the rows that make the new ones; sentences (B',): those that stay."""
        index = _pad(index, self.rows)  # (R,)
        if self.source is not None:  # only the table moves: (T_max, R) indices
            self.source = _dynamic(self.source.index_select(1, index), 0)
        for layer in self.layers:
            if self.source is None:  # greedy: finished sentences leave, once each per batch
                layer.self_k = _dynamic(layer.self_k.index_select(0, index), 1)  # (R, T_max, D)
                layer.self_v = _dynamic(layer.self_v.index_select(0, index), 1)
            layer.source = self.source
            if sentences is not None:
                keep = _pad(sentences, layer.cross_k.size(0))  # (B,)
                layer.cross_k = _dynamic(layer.cross_k.index_select(0, keep), 1)
                layer.cross_v = _dynamic(layer.cross_v.index_select(0, keep), 1)
        if sentences is not None:
            self.src_mask = _dynamic(self.src_mask.index_select(0, _pad(sentences, self.src_mask.size(0))), 3)


def _dynamic(t: Tensor, dim: int) -> Tensor:
    """t, its size along dim marked as one that changes from batch to batch (S, T_max, a shortlist's V'):
    a graph compiled with it takes any size there. Every buffer a step reads is marked where it is made."""
    torch._dynamo.maybe_mark_dynamic(t, dim)
    return t


def _pad(index: Tensor, n: int) -> Tensor:
    """index (m,), m <= n, followed by copies of its last element: (n,)."""
    if index.numel() == n:
        return index
    return torch.cat([index, index[-1:].expand(n - index.numel())])


def dynamo_limits() -> contextlib.AbstractContextManager:
    """What dynamo allows while a graph is traced: each row count is a graph of its own (greedy 1, 2, 4, ...
    64 sentences; beams times that), more than its default of 8 a function, after which it would run
    eager; and never a silent fall back to eager. Around tracing only, not for the process."""
    return torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True)


class CompiledDecoder(Decoder):
    """The narrow model interface of search.py (encode, new_cache, decode) over a compiled step.

    A batch of up to max_sentences sentences is padded up to a power of two (1, 2, 4, ... sentences), so
    that a file's last, shorter batch reuses a graph instead of compiling another. Larger batches decode
    eagerly: there the matrix products are big enough for the BLAS, and eager search drops finished
    sentences while a fixed-shape step keeps computing their rows (on Multi30k's validation file in
    4,096-token batches, compiled greedy was slower than eager).

    One class for all of it, past the usual size, because its graphs share one cache layout, one key
    for a graph and one store: the cache's own work is StaticCache's, a stored graph's _Package's.

    With a store, the graphs are AOTInductor packages kept there (what `--compile` uses); without,
    torch.compile compiles them in memory. The packages run faster than graphs in memory in most of
    benchmarks/bench_translate.py's cells, and a later process loads them in about a second.
    """

    def __init__(
        self, model: Transformer, max_sentences: int = 32, store: str | Path | None = None, **options: Any
    ):
        self.model = model.eval()
        self.config = model.config
        self.max_sentences = max_sentences
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
            static = StaticCache(layers, src_mask, tokens.size(0), source, vocabulary, output)
            static.claim()
            logits = model.decode(tokens, None, static)  # type: ignore[arg-type]
            static.advance()
            return logits

        # the step, and once per batch the encoder and the cross-attention keys/values (S is dynamic, rows
        # are not), and a search's own tensor work after each step (beam or greedy); each compiled by
        # torch.compile on its first call, or exported to the store
        self.graphs = {
            "step": step,
            "encoder": model.encoder_states,
            "cross": model.cross_keys_values,
            "beam": _beam_work,
            "greedy": _greedy_work,
        }
        self.compiled = {
            name: torch.compile(fn, fullgraph=True, options=self.options) for name, fn in self.graphs.items()
        }
        self.compile_seconds = 0.0  # the first call of each graph, compile included
        self.load_seconds = 0.0  # reading graphs compiled by an earlier process from the store
        self._seen: set[tuple] = set()  # the keys of the graphs compiled in memory
        self._packages: dict[tuple, _Package] = {}  # the keys of the graphs from the store
        self._fingerprint: str | None = None

    def encode(self, src: Tensor) -> Memory:
        """src (B, S) -> memory of B_max = 2^k >= B sentences; the rows past B are copies of row 0."""
        B = src.size(0)
        if B > self.max_sentences:
            return self.model.encode(src)
        rows = 1 << (B - 1).bit_length()
        # a new tensor either way: a caller's tensor made outside inference mode has other dispatch keys,
        # which the graph is guarded on
        src = torch.cat([src, src[:1].expand(rows - B, -1)])  # (B_max, S)
        if src.size(1) < 2:  # a size of 1 would be a graph of its own: pad it (masked, so nothing changes)
            src = torch.cat([src, src.new_full((rows, 1), PAD_ID)], dim=1)  # (B_max, 2)
        mask = self.model.src_mask(src)
        if mask is None:
            mask = torch.ones(
                rows, 1, 1, src.size(1), dtype=torch.bool, device=src.device
            )  # (B_max, 1, 1, S)
        src, mask = _dynamic(src, 1), _dynamic(mask, 3)
        return Memory(_dynamic(self._call(("encoder", rows), src, mask), 1), mask)

    def new_cache(self, memory: Memory, max_len: int) -> StaticCache | DecoderCache:
        B, S, D = memory.states.shape
        if B > self.max_sentences:
            return self.model.new_cache(memory, max_len)
        max_len = max(max_len, 2)  # T_max: a size of 1 would be a graph of its own
        self.model.tgt_embed.position_table(max_len)  # long enough for every position the graph reads
        device = memory.states.device
        length = torch.zeros(1, dtype=torch.long, device=device)
        positions = _dynamic(torch.arange(max_len, device=device), 0)
        layers = []
        cross = self._call(("cross", B), memory.states)  # 2 x (B, S, D) per layer
        for k, v in cross:
            # contiguous, as a `reorder` leaves them: slices of one projection have other strides, which
            # the graph is guarded on
            k, v = k.contiguous(), v.contiguous()
            # each buffer a storage of its own, as after a `reorder`: views of one storage would be guarded
            # on not overlapping, and the first reorder would trace the step again
            self_k, self_v = (_dynamic(k.new_zeros(B, max_len, D), 1) for _ in range(2))  # 2 x (B, T_max, D)
            layers.append(
                StaticLayerCache(self_k, self_v, _dynamic(k, 1), _dynamic(v, 1), length, positions, None)
            )
        vocabulary = output = None
        if memory.vocabulary is not None:  # a shortlist's size changes from batch to batch too
            vocabulary = _dynamic(memory.vocabulary, 0)
            output = _dynamic(self.model.output_rows(vocabulary), 0)
        return StaticCache(layers, _dynamic(memory.src_mask, 3), B, None, vocabulary, output)

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
        tgt_in = tgt_in.contiguous()  # beam search passes a column of its tokens: strides are guarded too
        # rows R and sentences B: 32 rows are 32 sentences (greedy) or 8 sentences of 4 hypotheses (beam
        # 4), two graphs (the cross-attention keys/values have B rows); with a beam's table or without
        key = (
            "step",
            cache.rows,
            cache.layers[0].cross_k.size(0),
            cache.source is not None,
            cache.output is not None,
        )
        return self._call(key, tgt_in, *cache.arguments())[:live]

    def beam_candidates(
        self, logits: Tensor, live: BeamLive, length: Tensor, n_best: int, alpha: float, kind: str
    ) -> BeamStep:
        """search.beam_candidates as one graph for one sentence and one for any number of them (B and V
        dynamic), per beam, n_best and penalty: at one sentence of `small`, eager, its 30-odd operators
        took half as long as the compiled step (benchmarks/bench_translate.py)."""
        if logits.size(0) > self.max_sentences:
            return beam_candidates(logits, live, length, n_best, alpha, kind)
        key = ("beam", min(logits.size(0), 2), logits.size(1), n_best, alpha, kind, str(logits.dtype))
        args = (logits, *live, length, n_best, alpha, kind)
        return BeamStep(*self._search_work(key, 2, (logits, *live), args))

    def greedy_candidates(
        self, logits: Tensor, log_prob: Tensor, limit: Tensor, length: Tensor
    ) -> GreedyStep:
        """search.greedy_candidates as one graph for one sentence and one for any number (B and V dynamic)."""
        if logits.size(0) > self.max_sentences:
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
        not change. A package has no guards at all: it checks only its inputs' shapes."""
        package = self._packages.get(key)
        if package is not None:
            return package(*args)
        fn = self.compiled[key[0]]
        if key in self._seen:
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    return fn(*args)
            except RuntimeError as error:  # inputs no graph of fn was traced for: trace them (dynamo
                if "skip_guard_eval_unsafe" not in str(error):  # raises before running anything)
                    raise
        if self.store is not None:
            self._packages[key] = package = self._package(key, args)
            return package(*args)
        start = time.perf_counter()
        with torch._inductor.config.patch(freezing=True), dynamo_limits(), self._tracing():
            out = fn(*args)
        self.compile_seconds += time.perf_counter() - start
        self._seen.add(key)
        return out

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
        """Where the store keeps graph key's package: its name holds the key and the fingerprint."""
        assert self.store is not None
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.model, self.options)
        return self.store / f"{'-'.join(map(str, key))}-{self._fingerprint}.pt2"

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
        # the sizes marked dynamic where the buffers were made (_dynamic) are export's dynamic ones
        shapes = pytree.tree_map(  # (the options that are not tensors are constants of the graph)
            lambda t: (
                {d: Dim.DYNAMIC for d in getattr(t, "_dynamo_weak_dynamic_indices", ())}
                if isinstance(t, Tensor)
                else None
            ),
            args,
        )
        # (inference tensors cannot be traced in place)
        with torch.inference_mode(False), torch.no_grad(), self._tracing():
            example = pytree.tree_map_only(Tensor, torch.clone, args)
            module = _Graph(self.graphs[key[0]], None if key[0] in ("beam", "greedy") else self.model)
            program = torch.export.export(module, example, dynamic_shapes={"args": shapes}, strict=False)
            # Packaged in memory, then written atomically by us: PyTorch's own package writer, out of
            # space, leaves its zip unfinished and aborts the process when it is collected.
            archive = io.BytesIO()
            # the package names its graph (its file's name, fingerprint included), which _load_stored
            # checks: a whole package of another graph under this name would run on inputs it was not
            # compiled for
            configs = {"freezing": True, "aot_inductor.metadata": {GRAPH: path.stem}, **self.options}
            torch._inductor.aoti_compile_and_package(program, package_path=archive, inductor_configs=configs)
            atomic_write(path, lambda tmp: tmp.write_bytes(archive.getbuffer()))
        self.compile_seconds += time.perf_counter() - start
        # (not _load_stored: a package just compiled that does not load is an error, not a cache miss)
        start = time.perf_counter()
        package = _Package(torch._inductor.aoti_load_package(str(path)).loader)
        self.load_seconds += time.perf_counter() - start
        return package


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
) -> tuple[Tensor, ...]:
    """search.beam_candidates with its named inputs and outputs flat: a graph's arguments and results are
    tensors and constants (an exported package would otherwise have to know search's types by name)."""
    live = BeamLive(scores, limit, limit_penalty, best_finished, n_finished)
    return tuple(beam_candidates(logits, live, length, n_best, alpha, kind))


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
TRACED_CODE = ("model.py", "precision.py", "inference/search.py", "inference/compiled.py")  # under aiayn/


def fingerprint(model: Transformer, options: dict) -> str:
    """A hash of what a compiled package depends on: the weights, the modules that use them and the
    model's configuration (the number of heads, say, which no weight shows), the code traced, the compile
    options, PyTorch's version and the processor (kernels are compiled for its instructions)."""
    digest = hashlib.blake2b(digest_size=12)
    for name in TRACED_CODE:
        digest.update((Path(__file__).parents[1] / name).read_bytes())
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
                        cpu.get("cpu family"), cpu.get("model"), sorted(cpu_flags()), isa, str(device), gpu)).encode())  # fmt: skip
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


# --- What `aiayn translate` decodes with by default: the graphs an earlier compile stored, and no other --


def compile_options(model: Transformer, **options: Any) -> dict[str, Any]:
    """The inductor options CompiledDecoder(model, **options) compiles with, which its packages' names hold.

    max_autotune on the CPU: inductor times its own C++ GEMM kernels against the BLAS call for each
    matrix product of the step and keeps the faster: at a few rows MKL's sgemm is slow on AMD CPUs. On
    a GPU it would time Triton templates for every product of every graph, minutes per model, where
    cuBLAS is already the fast choice: off there."""
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
    `--compile` pays it, and every later run has the graphs it left."""

    def __init__(self, model: Transformer, store: str | Path, **options: Any):
        super().__init__(model, store=store, **options)

    def _call(self, key: tuple, *args: Any) -> Any:
        if key not in self._packages and not self._path(key).is_file():
            raise NotStored(key)
        return super()._call(key, *args)
