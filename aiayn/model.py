"""The Transformer of "Attention Is All You Need", section 3 top to bottom, with a key/value cache.

Shapes: B batch, S source length, T target length, L new target positions in one decode call,
D d_model, H heads, D/H per-head size, F d_ff, V vocabulary, P positions filled in the cache.
Masks are boolean and True where attention is allowed (the convention of
`F.scaled_dot_product_attention`); the model builds them itself from the pad id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import ModelConfig

# --- §3.2 Attention ---------------------------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    """§3.2.2 MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i).

    §3.2.1 scaled dot-product attention softmax(Q K^T / sqrt(d_k)) V is `F.scaled_dot_product_attention`.
    The input projections of all heads are fused matrices; `SelfAttention` and `CrossAttention` own them.
    Projected queries, keys and values stay (B, L, D) until `attend` splits them into heads, so the
    decoder's cache can store them as they come out of the projection.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.out_proj = nn.Linear(config.d_model, config.d_model)  # W^O
        self.attention_dropout = config.attention_dropout
        self.recorded: list[Tensor] | None = None  # set to a list to record attention weights

    def split_heads(self, x: Tensor) -> Tensor:
        B, L, D = x.shape
        return x.view(B, L, self.n_heads, D // self.n_heads).transpose(1, 2)  # (B, H, L, D/H)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
        """q (B, L, D), k and v (B, M, D), mask broadcastable to (B, H, L, M) -> (B, L, D)."""
        B, L, D = q.shape
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)  # (B, H, L or M, D/H)
        if self.recorded is not None:  # visualisation only: weights written out, off the fast path
            weights = naive_attention_weights(q, k, mask, causal)  # (B, H, L, M)
            self.recorded.append(weights.detach())
            out = weights.to(v.dtype) @ v  # (B, H, L, D/H)
        else:
            p = self.attention_dropout if self.training else 0.0
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)
        return self.out_proj(out.transpose(1, 2).reshape(B, L, D))  # (B, L, D)


class SelfAttention(MultiHeadAttention):
    """Queries, keys and values from the same sequence: one (D -> 3D) matmul [W^Q; W^K; W^V]."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.in_proj = nn.Linear(config.d_model, 3 * config.d_model)

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.in_proj(x).chunk(3, dim=-1)  # 3 x (B, L, D)
        return q, k, v


class CrossAttention(MultiHeadAttention):
    """§3.2.3 encoder-decoder attention: queries from the decoder, keys and values from the encoder output."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.q_proj = nn.Linear(config.d_model, config.d_model)  # W^Q
        self.kv_proj = nn.Linear(config.d_model, 2 * config.d_model)  # [W^K; W^V], fused

    def project_q(self, x: Tensor) -> Tensor:
        return self.q_proj(x)  # (B, T, D)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Computed once per sentence (Transformer.new_cache)."""
        k, v = self.kv_proj(memory).chunk(2, dim=-1)  # 2 x (B, S, D)
        return k, v

    def attend_beams(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, beam: int) -> Tensor:
        """Hypotheses of one sentence share its keys and values.

        q (B*N, L, D) with the N = beam rows of a sentence next to each other; k and v (B, S, D), one row
        per sentence. The N hypotheses become N*L queries of their sentence instead of repeating its keys
        and values N times: the same numbers, N times less memory to read.
        """
        R, L, D = q.shape
        out = self.attend(q.reshape(R // beam, beam * L, D), k, v, mask)  # (B, N*L, D)
        return out.view(R, L, D)  # (B*N, L, D)


def naive_attention_weights(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """softmax(Q K^T / sqrt(d_k)) written out, for recording attention maps."""
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, H, L, M)
    if causal:
        L, M = scores.shape[-2:]
        mask = torch.ones(L, M, dtype=torch.bool, device=q.device).tril(M - L)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)


# --- §3.3 Position-wise feed-forward ---------------------------------------------------------------


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied to each position separately."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w_1 = nn.Linear(config.d_model, config.d_ff)
        self.w_2 = nn.Linear(config.d_ff, config.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(F.relu(self.w_1(x)))  # (B, L, F) -> (B, L, D)


# --- §3.4 Embeddings and §3.5 positional encoding ------------------------------------------------


def sinusoids(n_positions: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))."""
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (D/2,)
    angle = pos / torch.pow(10000.0, two_i / d_model)  # (P, D/2)
    pe = torch.empty(n_positions, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)  # even dimensions: sine
    pe[:, 1::2] = torch.cos(angle)  # odd dimensions: cosine (interleaved, as in the paper's formula)
    return pe.float()


class Embedding(nn.Module):
    """§3.4 token embedding scaled by sqrt(d_model), plus §3.5 positions, then dropout (§5.4)."""

    def __init__(self, vocab_size: int, config: ModelConfig):
        super().__init__()
        self.d_model = config.d_model
        self.tokens = nn.Embedding(vocab_size, config.d_model, padding_idx=config.pad_id)
        self.learned = config.positions == "learned"
        if self.learned:  # a named option (the paper found both equal, §3.5 / Table 3 row E)
            self.positions = nn.Embedding(config.max_positions, config.d_model)
        else:  # not a parameter and not saved: always recomputed from the formula
            self.register_buffer("table", sinusoids(config.max_positions, config.d_model), persistent=False)
        self.dropout = nn.Dropout(config.dropout)

    def position_table(self, end: int) -> Tensor:
        """Positions 0..end-1, (end, D); sinusoids extend past max_positions, learned ones cannot."""
        if self.learned:
            if end > self.positions.num_embeddings:
                raise ValueError(
                    f"sequence of {end} tokens is longer than max_positions={self.positions.num_embeddings} "
                    "of this model's learned positions"
                )
            return self.positions.weight[:end]
        if end > self.table.size(0):
            self.table = sinusoids(max(end, 2 * self.table.size(0)), self.d_model).to(self.table)
        return self.table[:end]

    def forward(self, ids: Tensor, start: int = 0) -> Tensor:
        x = self.tokens(ids) * math.sqrt(self.d_model)  # (B, L, D)
        x = x + self.position_table(start + ids.size(1))[start:]  # (B, L, D)
        return self.dropout(x)


# --- §3.1 Encoder and decoder stacks ---------------------------------------------------------------


class Residual(nn.Module):
    """§3.1 + §5.4: LayerNorm(x + Dropout(Sublayer(x))); pre-norm x + Dropout(Sublayer(LayerNorm(x)))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.d_model)  # per-feature gain and bias
        self.dropout = nn.Dropout(config.dropout)
        self.pre_norm = config.norm == "pre"  # deviation, see docs/deviations.md

    def input(self, x: Tensor) -> Tensor:
        """What the sublayer reads."""
        return self.norm(x) if self.pre_norm else x

    def output(self, x: Tensor, sublayer_out: Tensor) -> Tensor:
        """What the next sublayer gets."""
        x = x + self.dropout(sublayer_out)
        return x if self.pre_norm else self.norm(x)


class EncoderLayer(nn.Module):
    """Self-attention, then feed-forward, each in a residual connection."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = SelfAttention(config)
        self.feed_forward = FeedForward(config)
        self.res_attn = Residual(config)
        self.res_ff = Residual(config)

    def forward(self, x: Tensor, src_mask: Tensor | None) -> Tensor:
        q, k, v = self.self_attn.project_qkv(self.res_attn.input(x))  # 3 x (B, S, D)
        x = self.res_attn.output(x, self.self_attn.attend(q, k, v, src_mask))  # (B, S, D)
        return self.res_ff.output(x, self.feed_forward(self.res_ff.input(x)))  # (B, S, D)


@dataclass
class LayerCache:
    """One decoder layer's keys and values, preallocated: self-attention grows, cross stays.

    Rows R = B*N: the N hypotheses of each of B sentences (N = 1 outside beam search).
    """

    self_k: Tensor  # (R, T_max, D), positions [0, length) filled, as the projection wrote them
    self_v: Tensor  # (R, T_max, D)
    spare_k: Tensor  # (>= R, T_max, D), where `reorder` gathers into before swapping with self_k
    spare_v: Tensor
    cross_k: Tensor  # (B, S, D), one row per sentence, from the encoder output, computed once
    cross_v: Tensor  # (B, S, D)


@dataclass
class DecoderCache:
    """Everything incremental decoding keeps between steps (§3.2.3 masked self-attention)."""

    layers: list[LayerCache]
    src_mask: Tensor | None  # (B, 1, 1, S), one row per sentence
    beam: int = 1  # N: rows per sentence, next to each other; they share the sentence's cross keys/values
    length: int = 0  # target positions already decoded

    def expand(self, beam: int) -> None:
        """Give every sentence `beam` rows (copies of its one row): B rows -> B*N, for beam search."""
        assert self.beam == 1, "expand once"
        B = self.layers[0].self_k.size(0)
        self.reorder(torch.arange(B, device=self.layers[0].self_k.device).repeat_interleave(beam))
        self.beam = beam

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> None:
        """Keep or repeat rows: beams follow their parents, finished sentences leave the batch.

        index (R',): the rows whose self-attention keys/values make the new rows. Only the filled
        positions move, gathered into the spare buffer, which then swaps with the live one: one copy,
        no allocation unless the batch grows.
        sentences (B',): the sentences whose encoder-decoder keys/values stay, in the new order;
        None keeps them all (beams reordering within their sentences).
        """
        for layer in self.layers:
            layer.self_k, layer.spare_k = gather_rows(layer.self_k, layer.spare_k, index, self.length)
            layer.self_v, layer.spare_v = gather_rows(layer.self_v, layer.spare_v, index, self.length)
            if sentences is not None:
                layer.cross_k = layer.cross_k.index_select(0, sentences)  # (B', S, D)
                layer.cross_v = layer.cross_v.index_select(0, sentences)
        if sentences is not None and self.src_mask is not None:
            self.src_mask = self.src_mask.index_select(0, sentences)  # (B', 1, 1, S)


def gather_rows(live: Tensor, spare: Tensor, index: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Rows `index` (R',) of live (R, T_max, D), positions [0, n), copied into spare: (new live, new spare)."""
    R = index.numel()
    if spare.size(0) < R:  # the batch grows (e.g. B sentences -> B*N beams)
        spare = live.new_empty(R, *live.shape[1:])  # (R', T_max, D)
    torch.index_select(live[:, :n], 0, index, out=spare[:R, :n])  # (R', n, D)
    return spare[:R], live


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, then feed-forward, each in a residual."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = SelfAttention(config)
        self.cross_attn = CrossAttention(config)
        self.feed_forward = FeedForward(config)
        self.res_self = Residual(config)
        self.res_cross = Residual(config)
        self.res_ff = Residual(config)

    def forward(
        self,
        y: Tensor,
        memory: Tensor | None,
        src_mask: Tensor | None,
        cache: LayerCache | None = None,
        start: int = 0,
        beam: int = 1,
    ) -> Tensor:
        """y (B, L, D) -> (B, L, D). With a cache, `memory` is unused and B counts rows (B*N)."""
        q, k, v = self.self_attn.project_qkv(self.res_self.input(y))  # 3 x (B, L, D)
        if cache is None:  # whole target at once: the causal mask hides later positions
            a = self.self_attn.attend(q, k, v, None, causal=True)  # (B, L, D)
        else:  # L new positions [start, end): write them into the cache and attend over [0, end)
            end = start + y.size(1)
            cache.self_k[:, start:end] = k
            cache.self_v[:, start:end] = v
            k, v = cache.self_k[:, :end], cache.self_v[:, :end]  # (B, end, D)
            # position start+i sees [0, start+i]; SDPA's is_causal would align the corner wrongly here
            mask = None if y.size(1) == 1 else cache_causal_mask(start, end, y.device)  # (L, end)
            a = self.self_attn.attend(q, k, v, mask)  # (B, L, D)
        y = self.res_self.output(y, a)

        q = self.cross_attn.project_q(self.res_cross.input(y))  # (B, L, D)
        if cache is None:
            k, v = self.cross_attn.project_kv(memory)  # 2 x (B, S, D)
            a = self.cross_attn.attend(q, k, v, src_mask)  # (B, L, D)
        else:  # keys/values of each sentence, shared by its `beam` rows
            a = self.cross_attn.attend_beams(q, cache.cross_k, cache.cross_v, src_mask, beam)  # (B*N, L, D)
        y = self.res_cross.output(y, a)
        return self.res_ff.output(y, self.feed_forward(self.res_ff.input(y)))  # (B, L, D)


def cache_causal_mask(start: int, end: int, device: torch.device) -> Tensor:
    """(L, end) True where new position start+i may attend to position j, i.e. j <= start+i."""
    return torch.ones(end - start, end, dtype=torch.bool, device=device).tril(start)


# --- The whole model ------------------------------------------------------------------------------


@dataclass
class Memory:
    """The encoder's output and which source positions are real tokens."""

    states: Tensor  # (B, S, D)
    src_mask: Tensor | None  # (B, 1, 1, S) True at real tokens; None when nothing is padded

    def index_select(self, index: Tensor) -> Memory:
        mask = None if self.src_mask is None else self.src_mask.index_select(0, index)
        return Memory(self.states.index_select(0, index), mask)  # (N, S, D)


class Transformer(nn.Module):
    """Encoder-decoder Transformer (Figure 1). Callers pass token ids only; the model builds its masks."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tgt_embed = Embedding(config.tgt_vocab_size, config)
        # §3.4: one matrix for source and target embeddings when the vocabulary is shared
        self.src_embed = (
            self.tgt_embed if config.share_embeddings else Embedding(config.src_vocab_size, config)
        )
        self.encoder = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_decoder_layers))
        # Pre-norm stacks need a final LayerNorm; the paper's post-norm layers already end in one.
        pre = config.norm == "pre"
        self.encoder_norm = nn.LayerNorm(config.d_model) if pre else nn.Identity()
        self.decoder_norm = nn.LayerNorm(config.d_model) if pre else nn.Identity()
        self.generator = nn.Linear(config.d_model, config.tgt_vocab_size, bias=False)  # pre-softmax
        self.reset_parameters()
        if config.tie_output:  # §3.4: the same weight matrix as the target embedding
            self.generator.weight = self.tgt_embed.tokens.weight

    def reset_parameters(self) -> None:
        """Xavier-uniform matrices, zero biases; embeddings N(0, d_model^-0.5) (the paper is silent)."""
        for name, p in self.named_parameters():
            if "tokens" in name:
                nn.init.normal_(p, mean=0.0, std=self.config.d_model**-0.5)
                with torch.no_grad():
                    p[self.config.pad_id].zero_()
            elif p.dim() > 1:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def src_mask(self, src: Tensor) -> Tensor | None:
        """(B, S) ids -> (B, 1, 1, S) True at real tokens, or None when nothing is padded."""
        keep = src != self.config.pad_id  # (B, S)
        if bool(keep.all()):
            return None
        # A sentence that is all padding may attend to its padding: finite numbers instead of NaN
        # (its outputs are never used). Other rows are untouched.
        keep = keep | ~keep.any(dim=1, keepdim=True)  # (B, S)
        return keep[:, None, None, :]  # (B, 1, 1, S)

    def encode(self, src: Tensor) -> Memory:
        """src (B, S) -> Memory with states (B, S, D)."""
        mask = self.src_mask(src)
        x = self.src_embed(src)  # (B, S, D)
        for layer in self.encoder:
            x = layer(x, mask)  # (B, S, D)
        return Memory(self.encoder_norm(x), mask)

    def new_cache(self, memory: Memory, max_len: int) -> DecoderCache:
        """An empty cache for decoding up to max_len target positions; cross keys/values computed once."""
        B, S, D = memory.states.shape
        layers = []
        for layer in self.decoder:
            k, v = layer.cross_attn.project_kv(memory.states)  # 2 x (B, S, D)
            self_k, self_v, spare_k, spare_v = k.new_empty(4, B, max_len, D)  # 4 x (B, T_max, D)
            layers.append(LayerCache(self_k, self_v, spare_k, spare_v, k, v))
        return DecoderCache(layers, memory.src_mask)

    def decode(
        self,
        tgt_in: Tensor,
        memory: Memory | None,
        cache: DecoderCache | None = None,
        where: Tensor | None = None,
    ) -> Tensor:
        """Logits (B, L, V) for target positions; (n, V) at the n positions where `where` (B, L) is True.

        Without a cache, tgt_in (B, T) is the whole shifted target (BOS first) and L = T.
        With a cache, tgt_in (B*N, L) holds only the next L positions of each row of the cache, which
        then holds them too; the encoder output is read from the cache (`new_cache` projected it), so
        `memory` may be None.
        """
        if cache is None:
            y = self.tgt_embed(tgt_in)  # (B, T, D)
            for layer in self.decoder:
                y = layer(y, memory.states, memory.src_mask)  # (B, T, D)
        else:
            start = cache.length
            y = self.tgt_embed(tgt_in, start)  # (B*N, L, D)
            for layer, layer_cache in zip(self.decoder, cache.layers):
                y = layer(y, None, cache.src_mask, layer_cache, start, cache.beam)  # (B*N, L, D)
            cache.length = start + tgt_in.size(1)
        if where is not None:  # only the positions that are asked for reach the vocabulary projection
            y = y[where]  # (n, D)
        return self.generator(self.decoder_norm(y))  # (B, L, V) or (n, V)

    def forward(self, src: Tensor, tgt_in: Tensor, where: Tensor | None = None) -> Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, V). Softmax and loss live in train.py.

        where (B, T) bool: logits only at those positions, (n, V). Training passes its non-pad
        targets, so the output projection and the loss spend nothing on padding.
        """
        return self.decode(tgt_in, self.encode(src), where=where)

    @torch.no_grad()
    def attention_maps(self, src: Tensor, tgt_in: Tensor) -> dict[str, list[Tensor]]:
        """Attention weights of every layer: {"encoder", "decoder", "cross"} -> n_layers x (B, H, L, M)."""
        groups = {
            "encoder": [layer.self_attn for layer in self.encoder],
            "decoder": [layer.self_attn for layer in self.decoder],
            "cross": [layer.cross_attn for layer in self.decoder],
        }
        maps: dict[str, list[Tensor]] = {name: [] for name in groups}
        for name, modules in groups.items():
            for module in modules:
                module.recorded = maps[name]
        try:
            self(src, tgt_in)
        finally:
            for modules in groups.values():
                for module in modules:
                    module.recorded = None
        return maps

    def num_parameters(self) -> int:
        """Distinct parameters (a shared matrix counts once)."""
        return sum(p.numel() for p in self.parameters())
