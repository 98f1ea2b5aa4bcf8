"""The Transformer of model.py in the Keras 3 functional API, with aiayn's weights, for Keras users.

The same architecture as aiayn/model.py, section 3 of the paper top to bottom and in the same order,
built from `keras.Input` and layers composed into a `keras.Model`, with its own scaled dot-product
attention, sinusoids and masks. Layer and weight names are model.py's, so the two read side by side.

    aiayn export MODEL_DIR --format keras --out model.keras      # aiayn's weights in a .keras file

    import aiayn.interop.keras_model                                     # registers these layers with Keras
    model = keras.saving.load_model("model.keras")               # inputs src (B, S), tgt_in (B, T) ids
    logits = model([src, tgt_in])                                # (B, T, V)
    ids = aiayn.interop.keras_model.greedy_translate(model, [[45, 9, 2]], max_len=60)

Nothing here imports torch or the rest of aiayn (only the exporter at the bottom does, when called), so
the layers load on any Keras backend. Keras picks its backend from KERAS_BACKEND; when it is unset this
module sets "torch", so aiayn's PyTorch is the only deep-learning framework needed.

Shapes: B batch, S source length, T target length, L query positions, M key positions, D d_model,
H heads, D/H per-head size, F d_ff, V vocabulary, P positions. Masks are boolean and True where
attention is allowed, as in model.py; the model builds them itself from the pad id.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "torch")  # read when Keras is first imported; the user's choice wins
import keras  # noqa: E402
from keras import ops  # noqa: E402

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # aiayn's special ids (aiayn.tokenizer; a test holds them equal)
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's, which model.py uses (Keras's default is 1e-3)
# What a masked score becomes: a finite number no softmax lets through (exp underflows to exactly 0), so
# a row with nothing to attend to gets uniform weights instead of the NaN that -inf would give.
MASKED = -1e9

serializable = keras.saving.register_keras_serializable(package="aiayn")  # registered as "aiayn>Name"


# --- §3.2 Attention ---------------------------------------------------------------------------------


def attention(q, k, v, mask, dropout: keras.layers.Dropout):
    """§3.2.1 Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V, every head at once.

    q (B, H, L, D/H), k and v (B, H, M, D/H), mask bool broadcastable to (B, H, L, M) -> (B, H, L, D/H).
    Scores are float32 whatever the compute dtype, so MASKED stays finite.
    """
    d_k = q.shape[-1]
    scores = ops.matmul(ops.cast(q, "float32"), ops.cast(ops.swapaxes(k, -1, -2), "float32"))  # (B, H, L, M)
    scores = ops.where(mask, scores / math.sqrt(d_k), MASKED)
    weights = dropout(ops.softmax(scores, axis=-1))  # (B, H, L, M)
    return ops.matmul(ops.cast(weights, v.dtype), v)  # (B, H, L, D/H)


class MultiHeadAttention(keras.layers.Layer):
    """§3.2.2 MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(Q W^Q_i, K W^K_i, V W^V_i).

    The input projections of all heads are fused matrices, as in model.py; `SelfAttention` and
    `CrossAttention` own them.
    """

    def __init__(self, d_model: int, n_heads: int, attention_dropout: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        self.d_model, self.n_heads, self.attention_dropout = d_model, n_heads, attention_dropout
        self.out_proj = keras.layers.Dense(d_model, name="out_proj")  # W^O
        self.dropout = keras.layers.Dropout(attention_dropout)  # on the weights; not in the paper

    def split_heads(self, x):
        """(B, L, D) -> (B, H, L, D/H)."""
        x = ops.reshape(x, (ops.shape(x)[0], -1, self.n_heads, self.d_model // self.n_heads))
        return ops.transpose(x, (0, 2, 1, 3))

    def attend(self, q, k, v, mask):
        """q (B, L, D), k and v (B, M, D), mask broadcastable to (B, H, L, M) -> (B, L, D)."""
        out = attention(self.split_heads(q), self.split_heads(k), self.split_heads(v), mask, self.dropout)
        out = ops.transpose(out, (0, 2, 1, 3))  # (B, L, H, D/H)
        return self.out_proj(ops.reshape(out, (ops.shape(out)[0], -1, self.d_model)))  # (B, L, D)

    def get_config(self):
        return {**super().get_config(), "d_model": self.d_model, "n_heads": self.n_heads,
                "attention_dropout": self.attention_dropout}  # fmt: skip


@serializable
class SelfAttention(MultiHeadAttention):
    """Queries, keys and values from the same sequence: one (D -> 3D) matmul [W^Q; W^K; W^V]."""

    def __init__(self, d_model: int, n_heads: int, attention_dropout: float = 0.0, **kwargs):
        super().__init__(d_model, n_heads, attention_dropout, **kwargs)
        self.in_proj = keras.layers.Dense(3 * d_model, name="in_proj")

    def call(self, x, attn_mask):
        """x (B, L, D), attn_mask broadcastable to (B, H, L, L) -> (B, L, D)."""
        q, k, v = ops.split(self.in_proj(x), 3, axis=-1)  # 3 x (B, L, D)
        return self.attend(q, k, v, attn_mask)


@serializable
class CrossAttention(MultiHeadAttention):
    """§3.2.3 encoder-decoder attention: queries from the decoder, keys and values from the encoder output."""

    def __init__(self, d_model: int, n_heads: int, attention_dropout: float = 0.0, **kwargs):
        super().__init__(d_model, n_heads, attention_dropout, **kwargs)
        self.q_proj = keras.layers.Dense(d_model, name="q_proj")  # W^Q
        self.kv_proj = keras.layers.Dense(2 * d_model, name="kv_proj")  # [W^K; W^V], fused

    def call(self, y, memory, src_mask):
        """y (B, T, D), memory (B, S, D), src_mask (B, 1, 1, S) -> (B, T, D)."""
        k, v = ops.split(self.kv_proj(memory), 2, axis=-1)  # 2 x (B, S, D)
        return self.attend(self.q_proj(y), k, v, src_mask)


# --- §3.3 Position-wise feed-forward ---------------------------------------------------------------


# aiayn's activations (ModelConfig.activation): Keras's gelu defaults to the tanh approximation, aiayn's
# (PyTorch's) is the exact one
ACTIVATIONS = MappingProxyType(
    {"relu": ops.relu, "swish": ops.silu, "gelu": lambda x: ops.gelu(x, approximate=False)}
)


@serializable
class FeedForward(keras.layers.Layer):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, applied to each position separately (another activation
    than max(0, .) where the model names one)."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", **kwargs):
        super().__init__(**kwargs)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
        self.d_model, self.d_ff, self.activation = d_model, d_ff, activation
        self.w_1 = keras.layers.Dense(d_ff, name="w_1")
        self.w_2 = keras.layers.Dense(d_model, name="w_2")

    def call(self, x):
        return self.w_2(ACTIVATIONS[self.activation](self.w_1(x)))  # (B, L, F) -> (B, L, D)

    def get_config(self):
        return {
            **super().get_config(),
            "d_model": self.d_model,
            "d_ff": self.d_ff,
            "activation": self.activation,
        }


@serializable
class OutputBias(keras.layers.Layer):
    """A bias added to the logits (B, T, V): an imported model's (ModelConfig.output_bias), tied or not."""

    def __init__(self, vocab_size: int, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = vocab_size

    def build(self, input_shape=None):
        self.bias = self.add_weight(shape=(self.vocab_size,), initializer="zeros", name="bias")

    def call(self, logits):
        return logits + self.bias

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size}


# --- §3.4 Embeddings and §3.5 positional encoding ------------------------------------------------


def sinusoids(n_positions: int, d_model: int) -> np.ndarray:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)): (P, D)."""
    pos = np.arange(n_positions, dtype=np.float64)[:, None]  # (P, 1)
    two_i = np.arange(0, d_model, 2, dtype=np.float64)  # (D/2,)
    angle = pos / np.power(10000.0, two_i / d_model)  # (P, D/2)
    pe = np.empty((n_positions, d_model), dtype=np.float64)
    pe[:, 0::2] = np.sin(angle)  # even dimensions: sine
    pe[:, 1::2] = np.cos(angle)  # odd dimensions: cosine (interleaved, as in the paper's formula)
    return pe.astype(np.float32)


@serializable
class Embedding(keras.layers.Layer):
    """§3.4 token embedding scaled by sqrt(d_model), plus §3.5 positions, then dropout (§5.4).

    Called with mode="logits" it is the tied pre-softmax projection y E^T (§3.4: the same weight matrix).
    """

    def __init__(
        self, vocab_size: int, d_model: int, max_positions: int = 1024, positions: str = "sinusoidal",
        dropout: float = 0.0, **kwargs,
    ):  # fmt: skip
        super().__init__(**kwargs)
        if positions not in ("sinusoidal", "learned"):
            raise ValueError(f"positions must be 'sinusoidal' or 'learned', got {positions!r}")
        self.vocab_size, self.d_model, self.max_positions = vocab_size, d_model, max_positions
        self.positions, self.rate = positions, dropout
        self.dropout = keras.layers.Dropout(dropout)
        self.table = sinusoids(max_positions, d_model)  # not a weight and not saved: from the formula

    def build(self, input_shape=None):
        normal = keras.initializers.RandomNormal(stddev=self.d_model**-0.5)  # model.py's initialisation
        self.tokens = self.add_weight(
            shape=(self.vocab_size, self.d_model), initializer=normal, name="tokens"
        )
        if self.positions == "learned":  # a named option (the paper found both equal, Table 3 row E)
            self.learned = self.add_weight(shape=(self.max_positions, self.d_model), name="positions")

    def position_table(self, length):
        """Positions 0..length-1, (length, D); sinusoids extend past max_positions, learned ones cannot."""
        if isinstance(length, int) and length > self.max_positions:
            if self.positions == "learned":
                raise ValueError(
                    f"sequence of {length} tokens is longer than max_positions={self.max_positions} "
                    "of this model's learned positions"
                )
            if length > len(self.table):
                self.table = sinusoids(max(length, 2 * len(self.table)), self.d_model)
        table = self.learned if self.positions == "learned" else ops.convert_to_tensor(self.table)
        return table[:length]

    def call(self, inputs, mode: str = "embed"):
        if mode == "logits":  # inputs: decoder states (B, T, D) -> (B, T, V)
            return ops.matmul(inputs, ops.transpose(self.tokens))
        x = ops.take(self.tokens, inputs, axis=0) * math.sqrt(self.d_model)  # ids (B, L) -> (B, L, D)
        x = x + self.position_table(ops.shape(inputs)[1])  # (B, L, D)
        return self.dropout(x)

    def compute_output_spec(self, inputs, mode: str = "embed"):
        """The output's shape without tracing `call` (whose position table wants a real length)."""
        shape = (*inputs.shape[:-1], self.vocab_size) if mode == "logits" else (*inputs.shape, self.d_model)
        return keras.KerasTensor(shape, dtype=self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size, "d_model": self.d_model,
                "max_positions": self.max_positions, "positions": self.positions,
                "dropout": self.rate}  # fmt: skip


# --- Masks, built by the model from the ids ---------------------------------------------------------


@serializable
class PaddingMask(keras.layers.Layer):
    """src (B, S) ids -> (B, 1, 1, S) True at real tokens (every query of every head may see them).

    A sentence that is all padding may attend to its padding: finite numbers instead of NaN (its outputs
    are never used). Other rows are untouched.
    """

    def __init__(self, pad_id: int = PAD_ID, **kwargs):
        super().__init__(**kwargs)
        self.pad_id = pad_id

    def call(self, src):
        keep = ops.not_equal(src, self.pad_id)  # (B, S)
        keep = ops.logical_or(keep, ops.logical_not(ops.any(keep, axis=1, keepdims=True)))  # (B, S)
        return keep[:, None, None, :]  # (B, 1, 1, S)

    def get_config(self):
        return {**super().get_config(), "pad_id": self.pad_id}


@serializable
class CausalMask(keras.layers.Layer):
    """tgt_in (B, T) ids -> (T, T) True where position i may attend to position j, i.e. j <= i (§3.2.3).

    Target padding needs no mask of its own: it comes after the real tokens, which never look ahead, and
    the loss ignores the outputs at padded positions.
    """

    def call(self, tgt_in):
        i = ops.arange(ops.shape(tgt_in)[1])
        return ops.greater_equal(i[:, None], i[None, :])  # (T, T)


# --- §3.1 Encoder and decoder stacks ---------------------------------------------------------------
# Each sublayer is wrapped as LayerNorm(x + Dropout(Sublayer(x))) (§3.1, dropout §5.4). The pre-norm
# option, x + Dropout(Sublayer(LayerNorm(x))) with a final LayerNorm per stack, is a deviation
# (docs/deviations.md) and reads as its own branch.


def _layer_norm(name: str) -> keras.layers.LayerNormalization:
    return keras.layers.LayerNormalization(epsilon=LAYER_NORM_EPS, name=name)  # per-feature gain and bias


class _Sublayers(keras.layers.Layer):
    """What an encoder and a decoder layer share: their sizes, dropout and the norm option."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.1,
                 attention_dropout: float = 0.0, norm: str = "post", activation: str = "relu", **kwargs):  # fmt: skip
        super().__init__(**kwargs)
        if norm not in ("post", "pre"):
            raise ValueError(f"norm must be 'post' or 'pre', got {norm!r}")
        self.sizes = dict(d_model=d_model, n_heads=n_heads, attention_dropout=attention_dropout)
        self.d_ff, self.rate, self.norm, self.activation = d_ff, dropout, norm, activation
        self.pre_norm = norm == "pre"
        self.self_attn = SelfAttention(**self.sizes, name="self_attn")
        self.feed_forward = FeedForward(d_model, d_ff, activation, name="feed_forward")
        self.self_attn_norm = _layer_norm("self_attn_norm")
        self.feed_forward_norm = _layer_norm("feed_forward_norm")
        self.dropout = keras.layers.Dropout(dropout)

    def get_config(self):
        return {
            **super().get_config(),
            **self.sizes,
            "d_ff": self.d_ff,
            "dropout": self.rate,
            "norm": self.norm,
            "activation": self.activation,
        }


@serializable
class EncoderLayer(_Sublayers):
    """Self-attention, then feed-forward, each in a residual connection followed by layer norm."""

    def call(self, x, src_mask):
        """x (B, S, D) -> (B, S, D)."""
        if self.pre_norm:  # deviation
            x = x + self.dropout(self.self_attn(self.self_attn_norm(x), src_mask))
            return x + self.dropout(self.feed_forward(self.feed_forward_norm(x)))
        x = self.self_attn_norm(x + self.dropout(self.self_attn(x, src_mask)))
        return self.feed_forward_norm(x + self.dropout(self.feed_forward(x)))


@serializable
class DecoderLayer(_Sublayers):
    """Masked self-attention, encoder-decoder attention, then feed-forward, each in a residual + norm."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, **kwargs):
        super().__init__(d_model, n_heads, d_ff, **kwargs)
        self.cross_attn = CrossAttention(**self.sizes, name="cross_attn")
        self.cross_attn_norm = _layer_norm("cross_attn_norm")

    def call(self, y, memory, src_mask, causal_mask):
        """y (B, T, D), memory (B, S, D) -> (B, T, D)."""
        if self.pre_norm:  # deviation
            y = y + self.dropout(self.self_attn(self.self_attn_norm(y), causal_mask))
            y = y + self.dropout(self.cross_attn(self.cross_attn_norm(y), memory, src_mask))
            return y + self.dropout(self.feed_forward(self.feed_forward_norm(y)))
        y = self.self_attn_norm(y + self.dropout(self.self_attn(y, causal_mask)))
        y = self.cross_attn_norm(y + self.dropout(self.cross_attn(y, memory, src_mask)))
        return self.feed_forward_norm(y + self.dropout(self.feed_forward(y)))


# --- The whole model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parts:
    """The model's layers by role. `transformer` composes them into the functional graph; `of` finds
    them again in a built or loaded model, so `greedy_translate` runs the encoder once per sentence."""

    src_mask: PaddingMask
    causal_mask: CausalMask
    src_embed: Embedding  # the same layer as tgt_embed when the vocabulary is shared (§3.4)
    tgt_embed: Embedding
    encoder: tuple[EncoderLayer, ...]
    decoder: tuple[DecoderLayer, ...]
    encoder_norm: keras.layers.LayerNormalization | None  # pre-norm stacks end in one; post-norm: None
    decoder_norm: keras.layers.LayerNormalization | None
    generator: keras.layers.Dense | None  # None: tied to the target embedding (§3.4)
    output_bias: OutputBias | None  # an imported model's bias on the logits; None: none (the paper's)

    @classmethod
    def of(cls, model: keras.Model) -> Parts:
        names = {layer.name: layer for layer in model.layers}
        n_enc = sum(name.startswith("encoder_") and name[8:].isdigit() for name in names)
        n_dec = sum(name.startswith("decoder_") and name[8:].isdigit() for name in names)
        return cls(
            names["src_mask"], names["causal_mask"], names.get("src_embed", names["tgt_embed"]),
            names["tgt_embed"], tuple(names[f"encoder_{i}"] for i in range(n_enc)),
            tuple(names[f"decoder_{i}"] for i in range(n_dec)), names.get("encoder_norm"),
            names.get("decoder_norm"), names.get("generator"), names.get("output_bias"),
        )  # fmt: skip

    def encode(self, src):
        """src (B, S) ids -> memory (B, S, D) and its mask (B, 1, 1, S)."""
        mask = self.src_mask(src)
        x = self.src_embed(src)  # (B, S, D)
        for layer in self.encoder:
            x = layer(x, mask)  # (B, S, D)
        return (x if self.encoder_norm is None else self.encoder_norm(x)), mask

    def decode(self, tgt_in, memory, src_mask):
        """tgt_in (B, T) ids, BOS first -> logits (B, T, V)."""
        causal = self.causal_mask(tgt_in)  # (T, T)
        y = self.tgt_embed(tgt_in)  # (B, T, D)
        for layer in self.decoder:
            y = layer(y, memory, src_mask, causal)  # (B, T, D)
        if self.decoder_norm is not None:
            y = self.decoder_norm(y)
        logits = self.tgt_embed(y, mode="logits") if self.generator is None else self.generator(y)
        return logits if self.output_bias is None else self.output_bias(logits)


def transformer(
    *, src_vocab_size: int, tgt_vocab_size: int, d_model: int = 512, d_ff: int = 2048, n_heads: int = 8,
    n_encoder_layers: int = 6, n_decoder_layers: int = 6, dropout: float = 0.1, attention_dropout: float = 0.0,
    max_positions: int = 1024, norm: str = "post", positions: str = "sinusoidal", share_embeddings: bool = True,
    tie_output: bool = True, activation: str = "relu", output_bias: bool = False, pad_id: int = PAD_ID,
) -> keras.Model:  # fmt: skip
    """Encoder-decoder Transformer (Figure 1) as a functional model: inputs `src` (B, S) and `tgt_in`
    (B, T) token ids (BOS first), output logits (B, T, V). The arguments are aiayn's ModelConfig fields
    (its config.json), with the same defaults."""
    if share_embeddings and src_vocab_size != tgt_vocab_size:
        raise ValueError(
            f"shared embeddings need one vocabulary size, got {src_vocab_size} and {tgt_vocab_size}"
        )
    embed = dict(d_model=d_model, max_positions=max_positions, positions=positions, dropout=dropout)
    tgt_embed = Embedding(tgt_vocab_size, **embed, name="tgt_embed")
    sizes = dict(d_model=d_model, n_heads=n_heads, d_ff=d_ff, dropout=dropout,
                 attention_dropout=attention_dropout, norm=norm, activation=activation)  # fmt: skip
    pre = norm == "pre"
    parts = Parts(
        src_mask=PaddingMask(pad_id, name="src_mask"),
        causal_mask=CausalMask(name="causal_mask"),
        src_embed=tgt_embed if share_embeddings else Embedding(src_vocab_size, **embed, name="src_embed"),
        tgt_embed=tgt_embed,
        encoder=tuple(EncoderLayer(**sizes, name=f"encoder_{i}") for i in range(n_encoder_layers)),
        decoder=tuple(DecoderLayer(**sizes, name=f"decoder_{i}") for i in range(n_decoder_layers)),
        encoder_norm=_layer_norm("encoder_norm") if pre else None,
        decoder_norm=_layer_norm("decoder_norm") if pre else None,
        generator=None
        if tie_output
        else keras.layers.Dense(tgt_vocab_size, use_bias=False, name="generator"),
        output_bias=OutputBias(tgt_vocab_size, name="output_bias") if output_bias else None,
    )
    src = keras.Input(shape=(None,), dtype="int32", name="src")  # (B, S)
    tgt_in = keras.Input(shape=(None,), dtype="int32", name="tgt_in")  # (B, T)
    memory, src_mask = parts.encode(src)
    return keras.Model([src, tgt_in], parts.decode(tgt_in, memory, src_mask), name="transformer")


# --- Search -----------------------------------------------------------------------------------------


def greedy_translate(
    model: keras.Model, src_ids: Sequence[Sequence[int]], max_len: int | Sequence[int],
    bos_id: int = BOS_ID, eos_id: int = EOS_ID,
) -> list[list[int]]:  # fmt: skip
    """aiayn's greedy search for Keras: the most probable next token at every step.

    src_ids: one list of token ids per sentence, EOS-terminated as aiayn's tokenizer makes them
    (`Tokenizer.encode_src`; the tokenizer.json beside the model). max_len: the most output tokens,
    EOS included, for every sentence or one per sentence (aiayn uses floor(1.0 * |source| + 50), §6.1).
    Returns the output ids of each sentence without BOS and EOS, in input order; PAD and BOS are never
    output. The encoder runs once;
    the decoder reads the whole prefix at each step (no key/value cache: this is the reference, not
    the fast path).
    """
    parts = Parts.of(model)
    B = len(src_ids)
    limits = np.broadcast_to(np.asarray(max_len, dtype=np.int64), (B,))
    if B == 0:
        return []
    if int(limits.min()) < 1:
        raise ValueError(f"every maximum output length must be at least 1, got {limits.tolist()}")
    src = np.full((B, max(1, max(map(len, src_ids)))), parts.src_mask.pad_id, dtype=np.int32)  # (B, S)
    for i, ids in enumerate(src_ids):
        src[i, : len(ids)] = ids
    memory, src_mask = parts.encode(ops.convert_to_tensor(src))  # (B, S, D), (B, 1, 1, S)
    T = int(limits.max())
    out = np.full((B, T + 1), bos_id, dtype=np.int32)  # (B, 1 + T): BOS, then the outputs
    length = limits.copy()  # (B,) tokens produced, EOS included; set when a sentence stops
    live = np.ones(B, dtype=bool)
    for t in range(T):
        logits = parts.decode(ops.convert_to_tensor(out[:, : t + 1]), memory, src_mask)  # (B, t+1, V)
        scores = ops.convert_to_numpy(logits[:, -1]).astype(np.float32)  # (B, V)
        scores[:, [parts.src_mask.pad_id, bos_id]] = -np.inf  # inputs only, never output (as aiayn's search)
        token = scores.argmax(axis=-1)  # (B,)
        out[live, t + 1] = token[live]
        stop = live & ((token == eos_id) | (limits <= t + 1))
        length[stop] = t + 1
        live &= ~stop
        if not live.any():
            break
    return [[int(x) for x in row[1 : 1 + n - (row[n] == eos_id)]] for row, n in zip(out, length.tolist())]


# --- aiayn's weights --------------------------------------------------------------------------------


def load_aiayn_weights(model: keras.Model, state: Mapping[str, np.ndarray]) -> None:
    """Set every weight of `model` from aiayn's state dict (model.state_dict() names, as NumPy arrays).

    Each Keras weight is written exactly once, here. A torch Linear weight is (out, in) and a Keras Dense
    kernel (in, out): transposed. Everything else is as it is. A weight left unset, or a shape that does
    not fit, is a ValueError.
    """
    parts = Parts.of(model)
    written: dict[int, str] = {}

    def put(variable, name: str, transpose: bool = False) -> None:
        if name not in state:
            raise ValueError(f"the aiayn weights have no {name} for the Keras model's {variable.path}")
        value = np.asarray(state[name], dtype=np.float32)
        value = value.T if transpose else value
        if tuple(variable.shape) != value.shape:
            raise ValueError(
                f"{name} is {value.shape}, the Keras model's {variable.path} is {tuple(variable.shape)}"
            )
        variable.assign(value)
        written[id(variable)] = name

    def dense(layer: keras.layers.Dense, name: str) -> None:
        put(layer.kernel, f"{name}.weight", transpose=True)
        put(layer.bias, f"{name}.bias")

    def layer_norm(layer: keras.layers.LayerNormalization, name: str) -> None:
        put(layer.gamma, f"{name}.weight")
        put(layer.beta, f"{name}.bias")

    def sublayers(layer: _Sublayers, name: str) -> None:
        dense(layer.self_attn.in_proj, f"{name}.self_attn.in_proj")
        dense(layer.self_attn.out_proj, f"{name}.self_attn.out_proj")
        layer_norm(layer.self_attn_norm, f"{name}.self_attn_norm")
        dense(layer.feed_forward.w_1, f"{name}.feed_forward.w_1")
        dense(layer.feed_forward.w_2, f"{name}.feed_forward.w_2")
        layer_norm(layer.feed_forward_norm, f"{name}.feed_forward_norm")

    for embed, name in {
        id(e): (e, n) for e, n in ((parts.src_embed, "src_embed"), (parts.tgt_embed, "tgt_embed"))
    }.values():
        put(embed.tokens, f"{name}.tokens.weight")  # (V, D); a shared one once
        if embed.positions == "learned":
            put(embed.learned, f"{name}.positions.weight")  # (P, D)
    for i, layer in enumerate(parts.encoder):
        sublayers(layer, f"encoder.{i}")
    for i, layer in enumerate(parts.decoder):
        sublayers(layer, f"decoder.{i}")
        dense(layer.cross_attn.q_proj, f"decoder.{i}.cross_attn.q_proj")
        dense(layer.cross_attn.kv_proj, f"decoder.{i}.cross_attn.kv_proj")
        dense(layer.cross_attn.out_proj, f"decoder.{i}.cross_attn.out_proj")
        layer_norm(layer.cross_attn_norm, f"decoder.{i}.cross_attn_norm")
    if parts.encoder_norm is not None:
        layer_norm(parts.encoder_norm, "encoder_norm")
        layer_norm(parts.decoder_norm, "decoder_norm")
    if parts.generator is not None:  # tied: the target embedding, already written
        put(parts.generator.kernel, "generator.weight", transpose=True)  # (V, D) -> (D, V)
    if parts.output_bias is not None:
        put(parts.output_bias.bias, "generator.bias")
    unset = [v.path for v in model.weights if id(v) not in written]
    if unset:
        raise ValueError(f"no aiayn weight for {', '.join(unset)}")


def from_aiayn(model_dir: str | Path) -> keras.Model:
    """An aiayn model directory (what `aiayn train --out` wrote) as the Keras model, in float32."""
    from aiayn.checkpoint import ModelDir  # torch, and aiayn's loader (legacy names, tied weights)

    torch_model = ModelDir.read(model_dir).model()
    model = transformer(**asdict(torch_model.config))
    load_aiayn_weights(model, {k: v.detach().float().numpy() for k, v in torch_model.state_dict().items()})
    return model


def export_keras(model_dir: str | Path, out: str | Path, force: bool = False) -> Path:
    """Write model directory MODEL_DIR as a .keras file OUT, loadable with keras.saving.load_model once
    this module is imported. OUT is written under a temporary name and renamed: never half written."""
    from aiayn.files import TMP_SUFFIX, check_replaceable, fsync_dir, writing

    out = Path(out)
    if out.suffix != ".keras":
        raise ValueError(f"{out}: a Keras model file must end in .keras")
    if out.is_dir():
        raise ValueError(f"{out}: is a directory; the output must be a .keras file")
    check_replaceable(out, force)
    model = from_aiayn(model_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=TMP_SUFFIX))
    try:
        with writing(out):  # a full disk names the file asked for
            model.save(tmp / out.name)  # Keras wants the .keras name; the directory is the temporary part
        os.replace(tmp / out.name, out)
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
