"""The key/value cache a compiled decoding step reads and writes, and which batches one graph serves.

Shapes: as model.py. R rows of the cache (B sentences x N hypotheses), T target positions the buffers
hold, S source positions, D model width.

Nothing in a step may change a shape or a Python value the graph depends on, or the graph would be one of
another batch, so:
- every layer's self-attention keys/values live in (R, T, D) buffers written at a position held in a (1,)
  tensor; attention reads the T positions through a mask (positions <= the current one); the buffers
  hold the positions written so far and at most GROWTH more, and grow as they fill;
- a beam's hypotheses read theirs through a table of where each was written (StaticCache), so following
  their parents moves no keys or values;
- when sentences finish, search drops them; the rows left over repeat the last live one (computed, never
  read) until the live ones fill at most SHRINK of the rows, when the buffers are rebuilt with theirs alone:
  a step's work follows the sentences still being decoded;
- the sizes that change from batch to batch (S, T, and past one sentence B and R: row_class) are marked
  dynamic on the tensors that have them (`dynamic`), and one graph takes them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import Tensor

from aiayn.model import Memory

# The positions a batch's key/value buffers grow by once full (StaticCache.make_room): attention reads at
# most this many positions past those written. Smaller grows more often (a copy of the buffers each time).
GROWTH = 16
# A batch's buffers are rebuilt with the live sentences alone once these fill at most this part of its
# rows (StaticCache.reorder): each rebuild copies what is written; the rows of finished sentences
# computed until then are at most the rest.
SHRINK = 0.75


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
    changes, so every ancestor's keys stay where they are, until the buffers are rebuilt (_rebuild). A cache of one row per sentence (greedy) has no
    table: its rows only ever leave, and are copied then."""

    layers: list[StaticLayerCache]
    src_mask: Tensor  # (B, 1, 1, S), never None: a graph for "no padding" would be a second graph
    rows: int  # R: the rows every step computes; search uses the first ones, the others repeat the last
    row_class: str  # of its batch (row_class): B and R are dynamic sizes in the few and many classes
    source: Tensor | None = None  # (T_max, R) int64 after `expand`: row r's position t is at source[t, r]
    vocabulary: Tensor | None = None  # (V',) a shortlist, as model.DecoderCache
    output: Tensor | None = None  # (V', D)
    written: int = 0  # positions written: `length` as Python counts it, without reading the tensor
    max_len: int = 2  # the most positions the batch decodes: the buffers never grow past it

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
        self.source = self._rows(dynamic(own + torch.arange(T, device=self.length.device)[:, None], 0), 1)
        for layer in self.layers:  # (T_max, R) above
            layer.self_k, layer.self_v = (
                self._rows(dynamic(layer.self_k.new_zeros(self.rows, *layer.self_k.shape[1:]), 1), 0)
                for _ in range(2)
            )  # 2 x (R * n, T_max, D)
            layer.source = self.source

    def make_room(self) -> None:
        """Before a step: a free position in the buffers for it; full, they grow by GROWTH positions (up
        to max_len), so that attention reads the positions written so far and a few more, not the
        longest output's."""
        T = self.layers[0].self_k.size(1)
        if self.written == T:
            self._rebuild(None, self.rows, min(T + GROWTH, self.max_len))

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> None:
        """index (R',), R' <= R: the rows that make the new ones; sentences (B',): those that stay.

        Where the sentences that stay fill at most SHRINK of the rows, the buffers are rebuilt with theirs
        alone (at least the fewest sentences of the batch's class, which its graph takes): a step's work
        follows the live sentences, and the rows left over repeat the last live one until then."""
        if sentences is not None and self.row_class != "one":
            per_sentence = self.rows // self.src_mask.size(0)
            kept = max(sentences.numel(), SENTENCES[self.row_class][0])
            if kept * per_sentence <= SHRINK * self.rows:
                rows = kept * per_sentence
                self._keep(sentences, kept)
                self._rebuild(pad_index(index, rows), rows, self.layers[0].self_k.size(1))
                return
        index = pad_index(index, self.rows)  # (R,)
        if self.source is not None:  # only the table moves: (T_max, R) indices
            self.source = self._rows(dynamic(self.source.index_select(1, index), 0), 1)
        for layer in self.layers:
            if self.source is None:  # greedy: finished sentences leave, once each per batch
                layer.self_k = self._rows(dynamic(layer.self_k.index_select(0, index), 1), 0)  # (R, T_max, D)
                layer.self_v = self._rows(dynamic(layer.self_v.index_select(0, index), 1), 0)
            layer.source = self.source
        if sentences is not None:
            self._keep(sentences, self.src_mask.size(0))

    def _keep(self, sentences: Tensor, n: int) -> None:
        """The encoder-decoder keys/values and source mask of sentences (B',) alone, in that order, padded
        to n sentences with copies of the last."""
        keep = pad_index(sentences, n)  # (n,)
        for layer in self.layers:
            layer.cross_k = sized(dynamic(layer.cross_k.index_select(0, keep), 1), 0, self.row_class)
            layer.cross_v = sized(dynamic(layer.cross_v.index_select(0, keep), 1), 0, self.row_class)
        mask = self.src_mask.index_select(0, keep)  # (B, 1, 1, S)
        self.src_mask = sized(dynamic(mask, 3), 0, self.row_class)

    def _rebuild(self, index: Tensor | None, rows: int, positions: int) -> None:
        """New buffers of `rows` rows and `positions` positions: row r holds what row index[r] (None: r)
        has written so far, in order, and no beam table is needed to find it (each row its own)."""
        n, device = self.written, self.length.device
        where = None  # (R', n): where each new row's positions are in the buffers seen as (R * T, D)
        if self.source is not None:
            where = (self.source[:n] if index is None else self.source[:n].index_select(1, index)).t()
        if index is None:
            index = torch.arange(self.rows, device=device)
        grown = []
        for layer in self.layers:
            for old in (layer.self_k, layer.self_v):
                R, T, D = old.shape
                new = old.new_zeros(rows, positions, D)  # (R', T', D): zeros past what is written
                new[:, :n] = old[index, :n] if where is None else old.view(R * T, D)[where]
                grown.append(self._rows(dynamic(new, 1), 0))
        if self.source is not None:
            own = torch.arange(rows, device=device)[None] * positions  # (1, R') buffer row r, position 0
            self.source = self._rows(dynamic(own + torch.arange(positions, device=device)[:, None], 0), 1)
        table = dynamic(torch.arange(positions, device=device), 0)
        for i, layer in enumerate(self.layers):
            layer.self_k, layer.self_v = grown[2 * i], grown[2 * i + 1]
            layer.source, layer.positions = self.source, table
        self.rows = rows

    def _rows(self, t: Tensor, dim: int) -> Tensor:
        """t with its size along dim, R, marked as the cache's rows (sized)."""
        return sized(t, dim, self.row_class, "rows")


@dataclass
class CompiledMemory(Memory):
    """A batch's memory as the compiled graph gives it: with each decoder layer's cross keys and values."""

    cross: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # 2 x (B, S, D) per layer


def dynamic(t: Tensor, dim: int, bounds: tuple[int, int] | None = None) -> Tensor:
    """t, its size along dim marked as one that changes from batch to batch (S, T_max, a shortlist's V'),
    within bounds (least, most) where given: a graph compiled with it takes any size there. Every buffer a
    step reads is marked where it is made. The marks are aiayn's own (DYNAMIC), read where a graph is
    compiled: export's shapes (_shapes) and torch.compile's marks (_mark_dynamic). Dynamo's own marking
    would import dynamo, which a process decoding with stored packages never needs: seconds of its start
    on a small CPU."""
    marks = getattr(t, DYNAMIC, None)
    if marks is None:
        marks = {}
        setattr(t, DYNAMIC, marks)
    if bounds is not None or dim not in marks:
        marks[dim] = bounds
    return t


DYNAMIC = "_aiayn_dynamic"  # a tensor's dynamic sizes: {dim: (least, most) or None}


def sized(t: Tensor, dim: int, row_class: str, size: str = "sentences") -> Tensor:
    """t with its size along dim, the batch's sentences B (or the rows R of a cache: size "rows"), dynamic
    where its graph serves a class of several numbers of sentences, fixed for one sentence. B is bounded
    to its class (SENTENCES), so that torch.compile makes a graph per class as export does. The size is
    named on the tensor: an exported graph is told that R is N times B (_shapes), which attention over each
    sentence's rows relies on, rather than left to find that R happens to divide by B."""
    if row_class == "one":
        return t
    dynamic(t, dim, SENTENCES[row_class] if size == "sentences" else None)
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
# times the beam) included, and this is far above any batch of a file or a server
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


def pad_index(index: Tensor, n: int) -> Tensor:
    """index (m,), m <= n, followed by copies of its last element: (n,)."""
    if index.numel() == n:
        return index
    return torch.cat([index, index[-1:].expand(n - index.numel())])
