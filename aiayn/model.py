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
        """q (B, H, L, D/H), k and v (B, H, M, D/H), mask broadcastable to (B, H, L, M) -> (B, L, D)."""
        if self.recorded is not None:  # visualisation only: weights written out, off the fast path
            weights = naive_attention_weights(q, k, mask, causal)  # (B, H, L, M)
            self.recorded.append(weights.detach())
            out = weights.to(v.dtype) @ v  # (B, H, L, D/H)
        else:
            p = self.attention_dropout if self.training else 0.0
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)
        B, H, L, Dh = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, L, H * Dh))  # (B, L, D)


class SelfAttention(MultiHeadAttention):
    """Queries, keys and values from the same sequence: one (D -> 3D) matmul [W^Q; W^K; W^V]."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.in_proj = nn.Linear(config.d_model, 3 * config.d_model)

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.in_proj(x).chunk(3, dim=-1)  # 3 x (B, L, D)
        return self.split_heads(q), self.split_heads(k), self.split_heads(v)  # 3 x (B, H, L, D/H)


class CrossAttention(MultiHeadAttention):
    """§3.2.3 encoder-decoder attention: queries from the decoder, keys and values from the encoder output."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.q_proj = nn.Linear(config.d_model, config.d_model)  # W^Q
        self.kv_proj = nn.Linear(config.d_model, 2 * config.d_model)  # [W^K; W^V], fused

    def project_q(self, x: Tensor) -> Tensor:
        return self.split_heads(self.q_proj(x))  # (B, H, T, D/H)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Computed once per sentence (Transformer.new_cache)."""
        k, v = self.kv_proj(memory).chunk(2, dim=-1)  # 2 x (B, S, D)
        return self.split_heads(k), self.split_heads(v)  # 2 x (B, H, S, D/H)


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
        q, k, v = self.self_attn.project_qkv(self.res_attn.input(x))  # 3 x (B, H, S, D/H)
        x = self.res_attn.output(x, self.self_attn.attend(q, k, v, src_mask))  # (B, S, D)
        return self.res_ff.output(x, self.feed_forward(self.res_ff.input(x)))  # (B, S, D)


@dataclass
class LayerCache:
    """One decoder layer's keys and values, preallocated: self-attention grows, cross stays."""

    self_k: Tensor  # (B, H, T_max, D/H), positions [0, length) filled
    self_v: Tensor  # (B, H, T_max, D/H)
    cross_k: Tensor  # (B, H, S, D/H), from the encoder output, computed once
    cross_v: Tensor  # (B, H, S, D/H)


@dataclass
class DecoderCache:
    """Everything incremental decoding keeps between steps (§3.2.3 masked self-attention)."""

    layers: list[LayerCache]
    src_mask: Tensor | None  # (B, 1, 1, S)
    length: int = 0  # target positions already decoded

    def reorder(self, index: Tensor, cross: bool = True) -> None:
        """Keep or repeat batch rows `index` (N,): beam reordering and dropping finished sentences.

        Only the filled positions [0, length) of the self-attention keys/values move, within their
        preallocated buffers when the batch does not grow. cross=False keeps the encoder-decoder
        keys/values as they are: right when every row of `index` comes from a row holding the same
        sentence (beams of one sentence share them), which saves the copy on most beam steps.
        """
        n, grow = self.length, index.numel() > self.layers[0].self_k.size(0)
        for layer in self.layers:
            if grow:  # a new batch (e.g. B sentences -> B*N beams): new buffers
                layer.self_k = layer.self_k.index_select(0, index)  # (N, H, T_max, D/H)
                layer.self_v = layer.self_v.index_select(0, index)
            else:  # in place: gather the rows' filled positions, write them back at the top
                k, v = layer.self_k[index, :, :n], layer.self_v[index, :, :n]  # (N, H, n, D/H)
                layer.self_k, layer.self_v = layer.self_k[: index.numel()], layer.self_v[: index.numel()]
                layer.self_k[:, :, :n], layer.self_v[:, :, :n] = k, v
            if cross:
                layer.cross_k = layer.cross_k.index_select(0, index)  # (N, H, S, D/H)
                layer.cross_v = layer.cross_v.index_select(0, index)
        if cross and self.src_mask is not None:
            self.src_mask = self.src_mask.index_select(0, index)  # (N, 1, 1, S)


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
        self, y: Tensor, memory: Tensor | None, src_mask: Tensor | None, cache: LayerCache | None, start: int
    ) -> Tensor:
        q, k, v = self.self_attn.project_qkv(self.res_self.input(y))  # 3 x (B, H, L, D/H)
        if cache is None:  # whole target at once: the causal mask hides later positions
            a = self.self_attn.attend(q, k, v, None, causal=True)  # (B, L, D)
        else:  # L new positions [start, end): write them into the cache and attend over [0, end)
            end = start + y.size(1)
            cache.self_k[:, :, start:end] = k
            cache.self_v[:, :, start:end] = v
            k, v = cache.self_k[:, :, :end], cache.self_v[:, :, :end]  # (B, H, end, D/H)
            # position start+i sees [0, start+i]; SDPA's is_causal would align the corner wrongly here
            mask = None if y.size(1) == 1 else cache_causal_mask(start, end, y.device)  # (L, end)
            a = self.self_attn.attend(q, k, v, mask)  # (B, L, D)
        y = self.res_self.output(y, a)

        q = self.cross_attn.project_q(self.res_cross.input(y))  # (B, H, L, D/H)
        if cache is None:
            k, v = self.cross_attn.project_kv(memory)  # 2 x (B, H, S, D/H)
        else:
            k, v = cache.cross_k, cache.cross_v
        y = self.res_cross.output(y, self.cross_attn.attend(q, k, v, src_mask))  # (B, L, D)
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
        H = self.config.n_heads
        layers = []
        for layer in self.decoder:
            k, v = layer.cross_attn.project_kv(memory.states)  # 2 x (B, H, S, D/H)
            empty = k.new_empty(B, H, max_len, D // H)  # (B, H, T_max, D/H)
            layers.append(LayerCache(empty, torch.empty_like(empty), k, v))
        return DecoderCache(layers, memory.src_mask)

    def decode(self, tgt_in: Tensor, memory: Memory, cache: DecoderCache | None = None) -> Tensor:
        """Logits (B, L, V) for target positions.

        Without a cache, tgt_in (B, T) is the whole shifted target (BOS first) and L = T.
        With a cache, tgt_in (B, L) holds only the next L positions; the cache then holds them too.
        """
        start = 0 if cache is None else cache.length
        y = self.tgt_embed(tgt_in, start)  # (B, L, D)
        src_mask = memory.src_mask if cache is None else cache.src_mask
        for i, layer in enumerate(self.decoder):
            y = layer(y, memory.states, src_mask, None if cache is None else cache.layers[i], start)
        if cache is not None:
            cache.length = start + tgt_in.size(1)
        return self.generator(self.decoder_norm(y))  # (B, L, V)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, V). Softmax and loss live in train.py."""
        return self.decode(tgt_in, self.encode(src))

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
