"""The Transformer of "Attention Is All You Need", section 3 top to bottom, with a key/value cache.

Shapes: B batch, S source length, T target length, L new target positions in one decode call,
R rows of a decoder cache (B, or B*N when each sentence has N hypotheses), D d_model, H heads,
D/H per-head size, F d_ff, V vocabulary, P positions.
Masks are boolean and True where attention is allowed (the convention of
`F.scaled_dot_product_attention`); the model builds them itself from the pad id.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import ModelConfig
from aiayn.precision import Int8Linear
from aiayn.tokenizer import PAD_ID

# --- §3.2 Attention ---------------------------------------------------------------------------------


class ScaledDotProductAttention(nn.Module):
    """§3.2.1 Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V, every head at once (PyTorch's fused kernel).

    q (B, H, L, D/H), k and v (B, H, M, D/H), mask broadcastable to (B, H, L, M) -> (B, H, L, D/H).
    """

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout  # on the attention weights; not in the paper (attention_dropout)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)


class MultiHeadAttention(nn.Module):
    """§3.2.2 MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i).

    The input projections of all heads are fused matrices; `SelfAttention` and `CrossAttention` own them.
    Projected queries, keys and values stay (B, L, D) until `attend` splits them into heads, so the
    decoder's cache can store them as they come out of the projection.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.out_proj = nn.Linear(config.d_model, config.d_model)  # W^O
        self.attention = ScaledDotProductAttention(config.attention_dropout)

    def split_heads(self, x: Tensor) -> Tensor:
        B, L, D = x.shape
        return x.view(B, L, self.n_heads, D // self.n_heads).transpose(1, 2)  # (B, H, L, D/H)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = False) -> Tensor:
        """q (B, L, D), k and v (B, M, D), mask broadcastable to (B, H, L, M) -> (B, L, D)."""
        B, L, D = q.shape
        q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)  # (B, H, L or M, D/H)
        out = self.attention(q, k, v, mask, causal)  # (B, H, L, D/H)
        return self.out_proj(out.transpose(1, 2).reshape(B, L, D))  # (B, L, D)


class SelfAttention(MultiHeadAttention):
    """Queries, keys and values from the same sequence: one (D -> 3D) matmul [W^Q; W^K; W^V]."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.in_proj = nn.Linear(config.d_model, 3 * config.d_model)

    def forward(
        self, x: Tensor, mask: Tensor | None = None, causal: bool = False, cache: LayerCache | None = None
    ) -> Tensor:
        """x (B, L, D) -> (B, L, D). With a cache, x holds L new positions after those the cache holds;
        they are added to it and attend to all of them (§3.2.3: each position sees itself and earlier)."""
        q, k, v = self.in_proj(x).chunk(3, dim=-1)  # 3 x (B, L, D)
        if cache is not None:
            k, v, mask = cache.append(k, v)  # 2 x (B, M, D): every position so far; mask (L, M) or None
            causal = False  # the cache's mask says what each new position sees
        return self.attend(q, k, v, mask, causal)


class CrossAttention(MultiHeadAttention):
    """§3.2.3 encoder-decoder attention: queries from the decoder, keys and values from the encoder output."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.q_proj = nn.Linear(config.d_model, config.d_model)  # W^Q
        self.kv_proj = nn.Linear(config.d_model, 2 * config.d_model)  # [W^K; W^V], fused

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of the encoder output (B, S, D); a cache computes them once per sentence."""
        k, v = self.kv_proj(memory).chunk(2, dim=-1)  # 2 x (B, S, D)
        return k, v

    def forward(
        self, y: Tensor, memory: Tensor | None, src_mask: Tensor | None, cache: LayerCache | None = None
    ) -> Tensor:
        """y (R, L, D) -> (R, L, D); keys and values from memory (B, S, D), or from the cache.

        R may be a multiple of B: then the R/B rows of each sentence sit next to each other (a cache
        expanded for several hypotheses) and share its keys and values: they become R/B*L queries of
        their sentence instead of repeating its keys and values, the same numbers with less to read.
        """
        q = self.q_proj(y)  # (R, L, D)
        k, v = self.project_kv(memory) if cache is None else (cache.cross_k, cache.cross_v)  # (B, S, D)
        R, L, D = q.shape
        B = k.size(0)
        out = self.attend(q.reshape(B, R // B * L, D), k, v, src_mask)  # (B, R/B*L, D)
        return out.view(R, L, D)  # (R, L, D)


def attention_weights(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """softmax(Q K^T / sqrt(d_k)) written out (SDPA never shows it): (B, H, L, D/H), (B, H, M, D/H) -> (B, H, L, M)."""
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.size(-1))  # (B, H, L, M)
    if causal:
        L, M = scores.shape[-2:]
        mask = torch.ones(L, M, dtype=torch.bool, device=q.device).tril(M - L)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)


# --- §3.3 Position-wise feed-forward ---------------------------------------------------------------


# The paper's max(0, x), and the deviations an imported model may name (config.activation)
ACTIVATIONS = MappingProxyType({"relu": F.relu, "swish": F.silu, "gelu": F.gelu})


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied to each position separately (another activation
    than max(0, .) where the config names one)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w_1 = nn.Linear(config.d_model, config.d_ff)
        self.w_2 = nn.Linear(config.d_ff, config.d_model)
        self.activation = ACTIVATIONS[config.activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(self.activation(self.w_1(x)))  # (B, L, F) -> (B, L, D)


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


class Dropout(nn.Module):
    """§5.4 residual dropout: in training, each element is zeroed with probability p and the others are
    scaled by 1 / (1 - p); in evaluation, the identity. `nn.Dropout`, except on the CPU.

    PyTorch's CPU dropout draws its mask with `bernoulli_`, a sizeable part of a small model's training
    step on a CPU (benchmarks/bench_train.py). The same mask from 15 random bits an element costs about
    a third of that: `random_` fills int64s with 63 random bits, and each int64
    seen as four int16s, masked to their low 15 bits, gives four uniform numbers in [0, 32768). p is
    rounded to a multiple of 1/32768 there (0.1 -> 0.100006). Both draw from torch's default generator,
    so `torch.manual_seed` fixes the masks either way.
    """

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu":  # a fused kernel on the GPU
            return F.dropout(x, self.p, training=True)
        n = x.numel()
        bits = torch.empty(n // 4 + 1, dtype=torch.int64).random_().view(torch.int16)[:n] & 0x7FFF
        keep = bits.view(x.shape) >= round(self.p * 32768)  # P(keep) = 1 - p, p to 1/32768
        return x * keep.to(x.dtype).mul_(1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Embedding(nn.Module):
    """§3.4 token embedding scaled by sqrt(d_model), plus §3.5 positions, then dropout (§5.4)."""

    def __init__(self, vocab_size: int, config: ModelConfig):
        super().__init__()
        self.d_model = config.d_model
        self.tokens = nn.Embedding(vocab_size, config.d_model, padding_idx=PAD_ID)
        self.learned = config.positions == "learned"
        if self.learned:  # a named option (the paper found both equal, §3.5 / Table 3 row E)
            self.positions = nn.Embedding(config.max_positions, config.d_model)
        else:  # not a parameter and not saved: always recomputed from the formula
            self.register_buffer("table", sinusoids(config.max_positions, config.d_model), persistent=False)
        self.dropout = Dropout(config.dropout)

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

    def forward(self, ids: Tensor, start: int | Tensor = 0) -> Tensor:
        """ids (B, L) at positions start..start+L-1; start may be a (1,) tensor (a compiled decoding step
        reads its position from a tensor, so that one graph serves every step; then L is 1)."""
        x = self.tokens(ids) * math.sqrt(self.d_model)  # (B, L, D)
        if isinstance(start, Tensor):
            # the caller made the table long enough (position_table(T_max)) before the first step
            table = self.positions.weight if self.learned else self.table  # (P, D)
            return self.dropout(x + table.index_select(0, start))  # (B, 1, D)
        x = x + self.position_table(start + ids.size(1))[start:]  # (B, L, D)
        return self.dropout(x)


# --- §3.1 Encoder and decoder stacks ---------------------------------------------------------------
# Each sublayer is wrapped as LayerNorm(x + Dropout(Sublayer(x))) (§3.1, dropout §5.4). The pre-norm
# option, x + Dropout(Sublayer(LayerNorm(x))) with a final LayerNorm per stack, is a deviation
# (docs/deviations.md) and reads as its own branch.


class EncoderLayer(nn.Module):
    """Self-attention, then feed-forward, each in a residual connection followed by layer norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = SelfAttention(config)
        self.feed_forward = FeedForward(config)
        self.self_attn_norm = nn.LayerNorm(config.d_model)  # per-feature gain and bias
        self.feed_forward_norm = nn.LayerNorm(config.d_model)
        self.dropout = Dropout(config.dropout)
        self.pre_norm = config.norm == "pre"

    def forward(self, x: Tensor, src_mask: Tensor | None) -> Tensor:
        """x (B, S, D) -> (B, S, D)."""
        if self.pre_norm:  # deviation
            x = x + self.dropout(self.self_attn(self.self_attn_norm(x), src_mask))
            return x + self.dropout(self.feed_forward(self.feed_forward_norm(x)))
        x = self.self_attn_norm(x + self.dropout(self.self_attn(x, src_mask)))
        return self.feed_forward_norm(x + self.dropout(self.feed_forward(x)))


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, then feed-forward, each in a residual + norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = SelfAttention(config)
        self.cross_attn = CrossAttention(config)
        self.feed_forward = FeedForward(config)
        self.self_attn_norm = nn.LayerNorm(config.d_model)
        self.cross_attn_norm = nn.LayerNorm(config.d_model)
        self.feed_forward_norm = nn.LayerNorm(config.d_model)
        self.dropout = Dropout(config.dropout)
        self.pre_norm = config.norm == "pre"

    def forward(
        self, y: Tensor, memory: Tensor | None, src_mask: Tensor | None, cache: LayerCache | None = None
    ) -> Tensor:
        """y (R, L, D) -> (R, L, D). Without a cache, y is the whole target (R = B) and the causal mask
        hides later positions; with one, y holds the next L positions and memory is unused."""
        if self.pre_norm:  # deviation
            y = y + self.dropout(self.self_attn(self.self_attn_norm(y), causal=True, cache=cache))
            y = y + self.dropout(self.cross_attn(self.cross_attn_norm(y), memory, src_mask, cache))
            return y + self.dropout(self.feed_forward(self.feed_forward_norm(y)))
        y = self.self_attn_norm(y + self.dropout(self.self_attn(y, causal=True, cache=cache)))
        y = self.cross_attn_norm(y + self.dropout(self.cross_attn(y, memory, src_mask, cache)))
        return self.feed_forward_norm(y + self.dropout(self.feed_forward(y)))


# --- Incremental decoding: the key/value cache -----------------------------------------------------


@dataclass
class LayerCache:
    """One decoder layer's keys and values, preallocated: self-attention grows, cross stays.

    Rows R: B sentences, or B*N after `DecoderCache.expand(N)` (N rows of a sentence next to each other).
    """

    self_k: Tensor  # (R, T_max, D), positions [0, length) filled, as the projection wrote them
    self_v: Tensor  # (R, T_max, D)
    spare_k: Tensor  # (>= R, T_max, D), where `reorder` gathers into before swapping with self_k
    spare_v: Tensor
    cross_k: Tensor  # (B, S, D), one row per sentence, from the encoder output, computed once
    cross_v: Tensor  # (B, S, D)
    length: int = 0  # target positions filled

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Write L new positions' keys and values (R, L, D); returns all filled ones (R, M, D), M = length,
        and the (L, M) mask of what each new position sees (None for one position: all of them)."""
        start, end = self.length, self.length + k.size(1)
        self.self_k[:, start:end] = k
        self.self_v[:, start:end] = v
        self.length = end
        # position start+i sees [0, start+i]; SDPA's is_causal would align the corner wrongly here
        mask = None if k.size(1) == 1 else cache_causal_mask(start, end, k.device)  # (L, M)
        return self.self_k[:, :end], self.self_v[:, :end], mask


@dataclass
class DecoderCache:
    """Everything incremental decoding keeps between steps (§3.2.3 masked self-attention)."""

    layers: list[LayerCache]
    src_mask: Tensor | None  # (B, 1, 1, S), one row per sentence
    vocabulary: Tensor | None = None  # (V',) a shortlist: the only target ids given logits; None: all
    output: Tensor | None = None  # (V', D) their rows of the output projection, gathered once

    @property
    def length(self) -> int:
        """Target positions already decoded."""
        return self.layers[0].length

    def expand(self, n: int) -> None:
        """Give every sentence n rows (copies of its one row): B rows -> B*N, e.g. for beam search."""
        B = self.layers[0].cross_k.size(0)
        assert self.layers[0].self_k.size(0) == B, "expand a cache of one row per sentence"
        self.reorder(torch.arange(B, device=self.layers[0].self_k.device).repeat_interleave(n))

    def reorder(self, index: Tensor, sentences: Tensor | None = None) -> None:
        """Keep or repeat rows: beams follow their parents, finished sentences leave the batch.

        index (R',): the rows whose self-attention keys/values make the new rows. Only the filled
        positions move, gathered into the spare buffer, which then swaps with the live one: one copy,
        no allocation unless the batch grows.
        sentences (B',): the sentences whose encoder-decoder keys/values stay, in the new order;
        None keeps them all (rows reordering within their sentences).
        """
        for layer in self.layers:
            layer.self_k, layer.spare_k = gather_rows(layer.self_k, layer.spare_k, index, layer.length)
            layer.self_v, layer.spare_v = gather_rows(layer.self_v, layer.spare_v, index, layer.length)
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


def cache_causal_mask(start: int, end: int, device: torch.device) -> Tensor:
    """(L, end) True where new position start+i may attend to position j, i.e. j <= start+i."""
    return torch.ones(end - start, end, dtype=torch.bool, device=device).tril(start)


# --- The whole model ------------------------------------------------------------------------------


@dataclass
class Memory:
    """The encoder's output and which source positions are real tokens."""

    states: Tensor  # (B, S, D)
    src_mask: Tensor | None  # (B, 1, 1, S) True at real tokens; None when nothing is padded
    vocabulary: Tensor | None = None  # (V',) the target ids decoding may produce (shortlist.py); None: all


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
        # pre-softmax; a bias only where the config asks for one (an imported model's)
        self.generator = nn.Linear(config.d_model, config.tgt_vocab_size, bias=config.output_bias)
        self.reset_parameters()
        if config.tie_output:  # §3.4: the same weight matrix as the target embedding
            self.generator.weight = self.tgt_embed.tokens.weight

    def reset_parameters(self) -> None:
        """Xavier-uniform matrices, zero biases; embeddings N(0, d_model^-0.5) (the paper is silent)."""
        for name, p in self.named_parameters():
            if "tokens" in name:
                nn.init.normal_(p, mean=0.0, std=self.config.d_model**-0.5)
                with torch.no_grad():
                    p[PAD_ID].zero_()
            elif p.dim() > 1:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def src_mask(self, src: Tensor) -> Tensor | None:
        """(B, S) ids -> (B, 1, 1, S) True at real tokens, or None when nothing is padded."""
        keep = src != PAD_ID  # (B, S)
        if bool(keep.all()):
            return None
        # A sentence that is all padding may attend to its padding: finite numbers instead of NaN
        # (its outputs are never used). Other rows are untouched.
        keep = keep | ~keep.any(dim=1, keepdim=True)  # (B, S)
        return keep[:, None, None, :]  # (B, 1, 1, S)

    def encode(self, src: Tensor) -> Memory:
        """src (B, S) -> Memory with states (B, S, D)."""
        mask = self.src_mask(src)
        return Memory(self.encoder_states(src, mask), mask)

    def encoder_states(self, src: Tensor, mask: Tensor | None) -> Tensor:
        """The encoder stack: src (B, S) ids and their (B, 1, 1, S) mask or None -> states (B, S, D)."""
        x = self.src_embed(src)  # (B, S, D)
        for layer in self.encoder:
            x = layer(x, mask)  # (B, S, D)
        return self.encoder_norm(x)

    def cross_keys_values(self, states: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each decoder layer's encoder-decoder keys and values of the encoder output (B, S, D), once
        per batch: 2 x (B, S, D) per layer."""
        return [layer.cross_attn.project_kv(states) for layer in self.decoder]

    def new_cache(self, memory: Memory, max_len: int) -> DecoderCache:
        """An empty cache for decoding up to max_len target positions; cross keys/values computed once."""
        B, S, D = memory.states.shape
        layers = []
        for k, v in self.cross_keys_values(memory.states):  # 2 x (B, S, D) per layer
            self_k, self_v, spare_k, spare_v = k.new_empty(4, B, max_len, D)  # 4 x (B, T_max, D)
            layers.append(LayerCache(self_k, self_v, spare_k, spare_v, k, v))
        return DecoderCache(layers, memory.src_mask, memory.vocabulary, self.output_rows(memory.vocabulary))

    def output_rows(self, vocabulary: Tensor | None) -> Tensor | None:
        """(V', D) the output projection's rows of a shortlist (V',), once per batch; None for all."""
        if vocabulary is None:
            return None
        if isinstance(self.generator, Int8Linear):  # an int8 layer dequantises its rows
            return self.generator.rows(vocabulary)
        return self.generator.weight[vocabulary]

    def decode(
        self,
        tgt_in: Tensor,
        memory: Memory | None,
        cache: DecoderCache | None = None,
        where: Tensor | None = None,
    ) -> Tensor:
        """Logits (R, L, V) for target positions; (n, V) at the n positions where `where` (R, L) is True.

        Without a cache, tgt_in (B, T) is the whole shifted target (BOS first) and L = T.
        With a cache, tgt_in (R, L) holds only the next L positions of each of its rows, which it then
        holds too; the encoder output is read from the cache (`new_cache` projected it), so `memory` may
        be None.
        """
        if cache is None:
            y = self.tgt_embed(tgt_in)  # (B, T, D)
            for layer in self.decoder:
                y = layer(y, memory.states, memory.src_mask)  # (B, T, D)
        else:
            y = self.tgt_embed(tgt_in, start=cache.length)  # (R, L, D)
            for layer, layer_cache in zip(self.decoder, cache.layers):
                y = layer(y, None, cache.src_mask, layer_cache)  # (R, L, D)
        if where is not None:  # only the positions that are asked for reach the vocabulary projection
            y = y[where]  # (n, D)
        y = self.decoder_norm(y)
        if cache is None or cache.vocabulary is None:
            return self.generator(y)  # (R, L, V) or (n, V)
        # a shortlist: logits of its tokens only; the others get -inf, probability 0 after the softmax
        short = F.linear(y, cache.output)  # (R, L, V')
        if self.generator.bias is not None:
            short = short + self.generator.bias[cache.vocabulary]
        logits = short.new_full((*short.shape[:-1], self.config.tgt_vocab_size), float("-inf"))  # (R, L, V)
        return logits.index_copy_(-1, cache.vocabulary, short)  # (R, L, V)

    def forward(self, src: Tensor, tgt_in: Tensor, where: Tensor | None = None) -> Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, V). Softmax and loss live in train.py.

        where (B, T) bool: logits only at those positions, (n, V). Training passes its non-pad
        targets, so the output projection and the loss spend nothing on padding.
        """
        return self.decode(tgt_in, self.encode(src), where=where)

    def num_parameters(self) -> int:
        """Distinct parameters (a shared matrix counts once)."""
        return sum(p.numel() for p in self.parameters())


# --- Attention maps, for pictures (training and search never come here) ---------------------------


class RecordedAttention(ScaledDotProductAttention):
    """The same attention written out, keeping the weights of every call."""

    def __init__(self, record: list[Tensor]):
        super().__init__(dropout=0.0)
        self.record = record

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        weights = attention_weights(q, k, mask, causal)  # (B, H, L, M)
        self.record.append(weights)
        return weights.to(v.dtype) @ v  # (B, H, L, D/H)


@torch.no_grad()
def attention_maps(model: Transformer, src: Tensor, tgt_in: Tensor) -> dict[str, list[Tensor]]:
    """Attention weights of every layer: {"encoder", "decoder", "cross"} -> n_layers x (B, H, L, M).

    A twin of the model (the same parameters, modules of its own) whose attention keeps its weights
    runs the forward pass; the model itself is not changed, so other callers may use it meanwhile.
    """
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    twin = copy.deepcopy(model, memo=shared).eval()
    maps: dict[str, list[Tensor]] = {"encoder": [], "decoder": [], "cross": []}
    for layer in twin.encoder:
        layer.self_attn.attention = RecordedAttention(maps["encoder"])
    for layer in twin.decoder:
        layer.self_attn.attention = RecordedAttention(maps["decoder"])
        layer.cross_attn.attention = RecordedAttention(maps["cross"])
    twin(src, tgt_in)
    return maps
