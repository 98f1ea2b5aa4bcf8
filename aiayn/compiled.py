"""A decoding step of fixed shapes, compiled with torch.compile: a static key/value cache, the position
as a tensor, the batch padded to a fixed number of rows. Eager decoding (model.py) is the reference.

Shapes: as model.py. R rows of the cache (B sentences x N hypotheses), B_max sentences it was made for,
T_max target positions, S source positions, V vocabulary.

Why: at one sentence a decoding step of a small model is about 140 PyTorch operator calls of 5-20 us
each whatever their size; one compiled graph per row count runs the step as a few fused kernels.
Nothing in a step may change a shape or a Python value the graph depends on, or torch.compile traces
it again (a recompilation), so:
- every layer's self-attention keys/values live in (R, T_max, D) buffers written at a position held
  in a (1,) tensor; attention reads all T_max positions through a mask (positions <= the current one);
- a batch is padded to R rows; when sentences finish, search drops them and the rows left over
  repeat the last live one (computed, never read);
- the source length S and T_max are marked dynamic: one graph serves every batch of the same rows;
- once a graph exists it runs without dynamo's checks on the way in (CompiledDecoder._call).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from aiayn.model import DecoderCache, Memory, Transformer
from aiayn.tokenizer import PAD_ID


@dataclass
class StaticLayerCache:
    """One decoder layer's keys and values for a compiled step: every buffer keeps its shape."""

    self_k: Tensor  # (R, T_max, D); positions past `length` hold garbage and are masked
    self_v: Tensor  # (R, T_max, D)
    cross_k: Tensor  # (B, S, D) from the encoder output, computed once
    cross_v: Tensor  # (B, S, D)
    length: Tensor  # (1,) int64 shared by all layers: positions written before this step
    positions: Tensor  # (T_max,) 0..T_max-1, shared

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write one new position's keys and values (R, 1, D); returns all T_max positions (R, T_max, D)
        and the (1, T_max) mask of the written ones, the new one included. StaticCache.advance moves on."""
        self.self_k.index_copy_(1, self.length, k)
        self.self_v.index_copy_(1, self.length, v)
        mask = (self.positions <= self.length)[None]  # (1, T_max)
        return self.self_k, self.self_v, mask


@dataclass
class StaticCache:
    """What a compiled decoding step keeps between steps; the same interface as model.DecoderCache."""

    layers: list[StaticLayerCache]
    src_mask: Tensor  # (B, 1, 1, S), never None: a graph for "no padding" would be a second graph
    rows: int  # R: the rows every step computes; search uses the first ones, the others repeat the last
    spare: Tensor  # (R, T_max, D), where `reorder` gathers into before swapping
    vocabulary: Tensor | None = None  # (V',) a shortlist, as model.DecoderCache
    output: Tensor | None = None  # (V', D)

    @property
    def length(self) -> Tensor:
        return self.layers[0].length

    def advance(self) -> None:
        """After a step: its position is written in every layer."""
        self.length.add_(1)

    def expand(self, n: int) -> None:
        """n rows per sentence (beam search): the buffers grow to R * n rows, once per batch."""
        B = self.layers[0].cross_k.size(0)
        index = torch.arange(B, device=self.length.device).repeat_interleave(n)  # (B*n,)
        for layer in self.layers:
            layer.self_k = _dynamic(layer.self_k.index_select(0, index), 1)  # (B*n, T_max, D)
            layer.self_v = _dynamic(layer.self_v.index_select(0, index), 1)
        self.rows *= n
        self.spare = _dynamic(torch.empty_like(self.layers[0].self_k), 1)

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> None:
        """index (R',), R' <= R: the rows that make the new ones; sentences (B',): those that stay."""
        index = _pad(index, self.rows)  # (R,)
        for layer in self.layers:
            torch.index_select(layer.self_k, 0, index, out=self.spare)
            layer.self_k, self.spare = self.spare, layer.self_k
            torch.index_select(layer.self_v, 0, index, out=self.spare)
            layer.self_v, self.spare = self.spare, layer.self_v
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
    return torch.cat([index, index[-1:].expand(n - index.numel())])


class CompiledDecoder:
    """The narrow model interface of search.py (encode, new_cache, decode) over a compiled step.

    A batch of up to max_sentences sentences is padded up to a power of two (1, 2, 4, ... sentences), so
    that a file's last, shorter batch reuses a graph instead of compiling another. Larger batches decode
    eagerly: there the matrix products are big enough for the BLAS, and eager search drops finished
    sentences while a fixed-shape step keeps computing their rows (measured on Multi30k with 4,096-token
    batches: compiled greedy 0.45x eager).
    """

    def __init__(self, model: Transformer, max_sentences: int = 32, **options):
        # Each row count is a graph of its own (greedy 1, 2, 4, ... 64 sentences; beams times that):
        # more than dynamo's default of 8 per function, after which it would quietly run eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        torch._dynamo.config.fail_on_recompile_limit_hit = True  # never a silent fall back to eager
        self.model = model.eval()
        self.config = model.config
        self.max_sentences = max_sentences
        # max_autotune: inductor times its own C++ GEMM kernels against the BLAS call for each matrix
        # product of the step and keeps the faster: at a few rows MKL's sgemm is slow on AMD CPUs.
        self.options = {"max_autotune": True, **options}

        def step(tokens: Tensor, cache: StaticCache) -> Tensor:
            """tokens (R, 1) -> logits (R, 1, V) at the cache's next position: the graph compiled."""
            logits = model.decode(tokens, None, cache)  # type: ignore[arg-type]
            cache.advance()
            return logits

        self.step = torch.compile(step, fullgraph=True, options=self.options)
        # the encoder and the cross-attention keys/values, once per batch: S is dynamic, rows are not
        self.encoder_states = torch.compile(model.encoder_states, fullgraph=True, options=self.options)
        self.cross_keys_values = torch.compile(model.cross_keys_values, fullgraph=True, options=self.options)
        self.compile_seconds = 0.0  # the first call of each graph, compile included
        self._seen: set[tuple] = set()  # the keys of the graphs compiled

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
        return Memory(_dynamic(self._call(self.encoder_states, ("encoder", rows), src, mask), 1), mask)

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
        cross = self._call(self.cross_keys_values, ("cross", B), memory.states)  # 2 x (B, S, D) per layer
        for k, v in cross:
            # contiguous, as a `reorder` leaves them: slices of one projection have other strides, which
            # the graph is guarded on
            k, v = k.contiguous(), v.contiguous()
            # each buffer a storage of its own, as after a `reorder`: views of one storage would be guarded
            # on not overlapping, and the first reorder would trace the step again
            self_k, self_v = (_dynamic(k.new_zeros(B, max_len, D), 1) for _ in range(2))  # 2 x (B, T_max, D)
            layers.append(StaticLayerCache(self_k, self_v, _dynamic(k, 1), _dynamic(v, 1), length, positions))
        vocabulary = output = None
        if memory.vocabulary is not None:  # a shortlist's size changes from batch to batch too
            vocabulary = _dynamic(memory.vocabulary, 0)
            output = _dynamic(self.model.output_rows(vocabulary), 0)
        spare = _dynamic(torch.empty_like(self_k), 1)
        return StaticCache(layers, _dynamic(memory.src_mask, 3), B, spare, vocabulary, output)

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
        key = ("step", cache.rows, cache.output is not None)
        return self._call(self.step, key, tgt_in, cache)[:live]

    def _call(self, fn, key: tuple, *args):
        """fn(*args), fn compiled; key names its graph (what changes a shape the graph does not take as
        dynamic). The first call of a key traces and compiles, with freezing: the weights become constants,
        prepacked for the GEMMs (inductor reads that setting outside torch.compile's options, so it is set
        around the call). Later calls skip both what costs time on the way in: dynamo's guards (about
        1,300 checks that the model and inputs are still what the graph was traced for; skipping them
        took a decode call of a `small` batch-1 greedy search from 0.79 to 0.57 ms), of which
        only those that have told two graphs apart before are evaluated (skip_guard_eval_unsafe), and
        setting the option (0.03-0.13 ms more, in two measurements). That is safe here because a key's
        inputs differ only in the sizes marked dynamic, each at least 2 (0 and 1 would be graphs of their
        own), and a decoder's model does not change."""
        if key in self._seen:
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    return fn(*args)
            except RuntimeError as error:  # inputs no graph of fn was traced for: trace them (dynamo
                if "skip_guard_eval_unsafe" not in str(error):  # raises before running anything)
                    raise
        start = time.perf_counter()
        with torch._inductor.config.patch(freezing=True):
            out = fn(*args)
        self.compile_seconds += time.perf_counter() - start
        self._seen.add(key)
        return out
