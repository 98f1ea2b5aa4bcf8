"""The Transformer checked against independent references: formulas, a naive attention, invariances, a copy task."""

from __future__ import annotations

import copy
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn.config import preset
from aiayn.model import (
    Dropout,
    FeedForward,
    MultiHeadAttention,
    RecordedAttention,
    Transformer,
    attention_maps,
    sinusoids,
)
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID

V = 16  # vocabulary of the tiny models; ids 0-3 are special, 4..V-1 are words
FIRST_WORD = 4


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny matrices gain nothing from a second thread; on shared cores it makes the copy task ~10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(preset("tiny", **{"vocab_size": V, **overrides})).eval()


def words(*shape: int) -> Tensor:
    return torch.randint(FIRST_WORD, V, shape)


def with_bos(tgt: Tensor) -> Tensor:
    tgt = tgt.clone()
    tgt[:, 0] = BOS_ID
    return tgt


# --- References written here, from the paper's formulas -------------------------------------------


def pe(pos: int, dim: int, d_model: int) -> float:
    """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))."""
    two_i = dim - dim % 2
    angle = pos / 10000 ** (two_i / d_model)
    return math.sin(angle) if dim % 2 == 0 else math.cos(angle)


def pe_table(n: int, d_model: int) -> Tensor:
    return torch.tensor([[pe(p, d, d_model) for d in range(d_model)] for p in range(n)])  # (n, D)


def layer_norm(x: Tensor, norm: nn.LayerNorm) -> Tensor:
    """Normalise each position over its d_model features, then per-feature gain and bias."""
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


def fused_qkv(mha: MultiHeadAttention) -> tuple[Tensor, Tensor]:
    """[W^Q; W^K; W^V] (3D, D) and its bias, from a self-attention's in_proj or a cross-attention's q/kv."""
    if hasattr(mha, "in_proj"):
        return mha.in_proj.weight, mha.in_proj.bias
    return torch.cat([mha.q_proj.weight, mha.kv_proj.weight]), torch.cat([mha.q_proj.bias, mha.kv_proj.bias])


def naive_attention(
    mha: MultiHeadAttention, x_q: Tensor, x_kv: Tensor, allowed: Tensor
) -> tuple[Tensor, Tensor]:
    """§3.2: per head softmax(Q K^T / sqrt(d_k)) V from the rows of the fused in_proj, concat, W^O.

    allowed (B, L, M) is True where query position l may look at key position m.
    Returns the output (B, L, D) and the weights (B, H, L, M).
    """
    D, H = x_q.size(-1), mha.n_heads
    d_k = D // H
    W, b = fused_qkv(mha)  # (3D, D): [W^Q; W^K; W^V], head h in rows h*d_k..
    heads, weights = [], []
    for h in range(H):
        q_rows = slice(h * d_k, (h + 1) * d_k)
        k_rows = slice(D + h * d_k, D + (h + 1) * d_k)
        v_rows = slice(2 * D + h * d_k, 2 * D + (h + 1) * d_k)
        q = x_q @ W[q_rows].T + b[q_rows]  # (B, L, d_k)
        k = x_kv @ W[k_rows].T + b[k_rows]  # (B, M, d_k)
        v = x_kv @ W[v_rows].T + b[v_rows]  # (B, M, d_k)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(d_k)  # (B, L, M)
        w = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        heads.append(w @ v)
        weights.append(w)
    out = torch.cat(heads, dim=-1) @ mha.out_proj.weight.T + mha.out_proj.bias  # (B, L, D)
    return out, torch.stack(weights, dim=1)


def key_padding(keep: Tensor, n_queries: int) -> Tensor:
    """(B, M) real-token flags -> (B, L, M) allowed."""
    return keep[:, None, :].expand(-1, n_queries, -1)


def future_hidden(n: int) -> Tensor:
    """(1, n, n): position i may see j <= i."""
    return (torch.arange(n)[None, :] <= torch.arange(n)[:, None])[None]


def naive_self(mha, allowed, x):
    return naive_attention(mha, x, x, allowed)[0]


def naive_cross(mha, memory, allowed, x):
    return naive_attention(mha, x, memory, allowed)[0]


def naive_ffn(ff, x):
    return torch.relu(x @ ff.w_1.weight.T + ff.w_1.bias) @ ff.w_2.weight.T + ff.w_2.bias


def naive_sublayer(norm, x: Tensor, sublayer, pre: bool) -> Tensor:
    """§3.1 post-norm LayerNorm(x + Sublayer(x)); the pre-norm option x + Sublayer(LayerNorm(x))."""
    return x + sublayer(layer_norm(x, norm)) if pre else layer_norm(x + sublayer(x), norm)


def naive_forward(model: Transformer, src: Tensor, tgt: Tensor) -> Tensor:
    """The whole model from its parameters and the functions above (no module's forward is called)."""
    cfg = model.config
    D, pre = cfg.d_model, cfg.norm == "pre"
    S, T = src.size(1), tgt.size(1)
    keep = src != PAD_ID  # (B, S)

    x = model.src_embed.tokens.weight[src] * math.sqrt(D) + pe_table(S, D)  # §3.4, §3.5
    for layer in model.encoder:
        attend = partial(naive_self, layer.self_attn, key_padding(keep, S))
        x = naive_sublayer(layer.self_attn_norm, x, attend, pre)
        x = naive_sublayer(layer.feed_forward_norm, x, partial(naive_ffn, layer.feed_forward), pre)
    if pre:
        x = layer_norm(x, model.encoder_norm)

    y = model.tgt_embed.tokens.weight[tgt] * math.sqrt(D) + pe_table(T, D)
    for layer in model.decoder:
        attend = partial(naive_self, layer.self_attn, future_hidden(T))
        y = naive_sublayer(layer.self_attn_norm, y, attend, pre)
        attend = partial(naive_cross, layer.cross_attn, x, key_padding(keep, T))
        y = naive_sublayer(layer.cross_attn_norm, y, attend, pre)
        y = naive_sublayer(layer.feed_forward_norm, y, partial(naive_ffn, layer.feed_forward), pre)
    if pre:
        y = layer_norm(y, model.decoder_norm)
    return y @ model.generator.weight.T  # (B, T, V)


def expected_parameters(V_src: int, V_tgt: int, D: int, F: int, n_enc: int, n_dec: int, **cfg) -> int:
    """Counted from the architecture: embeddings, 4 projections with biases, FFN, per-feature LayerNorms."""
    attention = 4 * (D * D + D)
    ffn = D * F + F + F * D + D
    norm = 2 * D
    encoder = n_enc * (attention + ffn + 2 * norm)
    decoder = n_dec * (2 * attention + ffn + 3 * norm)
    embeddings = V_tgt * D
    if not cfg.get("share_embeddings", True):
        embeddings += V_src * D
    if not cfg.get("tie_output", True):
        embeddings += V_tgt * D
    final_norms = 2 * norm if cfg.get("norm") == "pre" else 0
    return embeddings + encoder + decoder + final_norms


# --- Parameter counts (Table 3) --------------------------------------------------------------------


@pytest.mark.parametrize(("name", "paper"), [("base", 65e6), ("big", 213e6)])
def test_parameter_count_matches_table_3(name, paper):
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = Transformer(preset(name, vocab_size=37000))  # §5.1: shared BPE vocabulary of ~37000
    n = model.num_parameters()
    assert abs(n - paper) / paper < 0.05, n
    c = model.config
    assert n == expected_parameters(37000, 37000, c.d_model, c.d_ff, 6, 6) == c.num_parameters()


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"norm": "pre"},
        {"share_embeddings": False, "src_vocab_size": 20, "tgt_vocab_size": 30},
        {"share_embeddings": False, "tie_output": False, "src_vocab_size": 20, "tgt_vocab_size": 30},
        {"positions": "learned", "max_positions": 50},
        {"positions": "learned", "share_embeddings": False, "src_vocab_size": 20, "tgt_vocab_size": 30},
    ],
)
def test_parameter_count_equals_formula(cfg):
    model = tiny(**cfg)
    c = model.config
    assert c.d_model == 64 and c.d_ff == 128 and c.n_encoder_layers == c.n_decoder_layers == 2
    expected = expected_parameters(c.src_vocab_size, c.tgt_vocab_size, 64, 128, 2, 2, **cfg)
    if c.positions == "learned":  # one table per embedding
        expected += c.max_positions * 64 * (1 if c.share_embeddings else 2)
    assert model.num_parameters() == expected == c.num_parameters()  # the config's own count, too
    assert sum(p.numel() for p in model.parameters()) == expected  # a shared matrix is one parameter


# --- §3.5 Positional encoding, §3.4 embeddings -----------------------------------------------------


def test_sinusoids_equal_the_formula():
    table = sinusoids(120, 64)  # (P, D)
    for pos, i in [(0, 0), (1, 0), (1, 1), (7, 3), (50, 10), (119, 31)]:
        angle = pos / 10000 ** (2 * i / 64)
        assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)  # 2i is sine
        assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)  # 2i+1 is cosine
    torch.testing.assert_close(table, pe_table(120, 64), atol=1e-6, rtol=0)
    torch.testing.assert_close(tiny().tgt_embed.table[:120], table, atol=0, rtol=0)


def test_embedding_scales_tokens_then_adds_positions():
    torch.manual_seed(1)
    model = tiny(share_embeddings=False, src_vocab_size=20, tgt_vocab_size=30)
    D = model.config.d_model
    for embed, vocab in [(model.tgt_embed, 30), (model.src_embed, 20)]:
        ids = torch.randint(0, vocab, (2, 9))
        ids[0, -3:] = PAD_ID
        expected = embed.tokens.weight[ids] * math.sqrt(D) + pe_table(9, D)
        torch.testing.assert_close(embed(ids), expected, atol=1e-5, rtol=0)
        # incremental decoding embeds positions start..start+L-1
        torch.testing.assert_close(embed(ids[:, 4:], start=4), expected[:, 4:], atol=1e-5, rtol=0)
    assert model.src_embed.tokens.weight[PAD_ID].abs().max() == 0  # a pad token adds nothing but its position


# --- §5.4 Dropout ------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_dropout_zeroes_at_rate_p_in_every_lane_and_scales_the_rest(p):
    """The mask's rate within 5 standard deviations, in each of the four int16 lanes of a random int64
    (a lane with a constant sign bit would never drop), neighbours independent, survivors x / (1 - p)."""
    torch.manual_seed(0)
    n = 1 << 20
    x = torch.rand(n) + 1.0  # no zeros of its own
    y = Dropout(p).train()(x)
    dropped = y == 0
    tolerance = lambda m: 5 * math.sqrt(p * (1 - p) / m)  # noqa: E731
    for lane in range(4):
        assert abs(dropped[lane::4].float().mean().item() - p) < tolerance(n // 4)
    both = (dropped[:-1] & dropped[1:]).float().mean().item()  # P(two neighbours dropped) = p^2
    assert abs(both - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / n)
    torch.testing.assert_close(y[~dropped], x[~dropped] / (1 - p), rtol=1e-6, atol=0)


def test_dropout_gradient_is_the_mask_and_evaluation_is_the_identity():
    torch.manual_seed(0)
    x = torch.randn(4, 7, 33, requires_grad=True)
    dropout = Dropout(0.2).train()
    y = dropout(x)
    assert y.shape == x.shape
    y.sum().backward()
    expected = torch.where(y == 0, 0.0, 1 / 0.8)
    torch.testing.assert_close(x.grad, expected)
    assert dropout.eval()(x) is x and Dropout(0.0).train()(x) is x
    assert Dropout(0.2).train()(x.detach().bfloat16()).dtype == torch.bfloat16


def test_dropout_masks_follow_the_seed():
    x = torch.ones(10_000)
    masks = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        masks.append(Dropout(0.1).train()(x) == 0)
    assert torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])


# --- §3.2 Attention ----------------------------------------------------------------------------------


def test_attention_equals_naive_softmax():
    torch.manual_seed(2)
    model = tiny()
    mha, cross = model.encoder[0].self_attn, model.decoder[0].cross_attn
    for module in (mha.in_proj, mha.out_proj, cross.q_proj, cross.kv_proj, cross.out_proj):
        nn.init.normal_(module.bias)  # nonzero biases so their layout is checked too
    B, L, M, D = 3, 5, 7, 64
    x, memory = torch.randn(B, L, D), torch.randn(B, M, D)
    keep_x = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    keep_m = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5], dtype=torch.bool)

    cases = {  # name: (module, its call, naive output and weights)
        "self, padded": (
            mha,
            lambda m: m(x, keep_x[:, None, None, :]),
            naive_attention(mha, x, x, key_padding(keep_x, L)),
        ),
        "cross, padded": (
            cross,
            lambda m: m(x, memory, keep_m[:, None, None, :]),
            naive_attention(cross, x, memory, key_padding(keep_m, L)),
        ),
        "self, causal": (
            mha,
            lambda m: m(x, causal=True),
            naive_attention(mha, x, x, future_hidden(L).expand(B, -1, -1)),
        ),
    }
    for name, (module, call, (expected, expected_weights)) in cases.items():
        torch.testing.assert_close(call(module), expected, atol=1e-5, rtol=0, msg=name)  # SDPA path
        recording, record = copy.deepcopy(module), []  # the attention-map path: weights written out
        recording.attention = RecordedAttention(record)
        torch.testing.assert_close(call(recording), expected, atol=1e-5, rtol=0, msg=name)
        (weights,) = record
        torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=0, msg=name)


def test_attention_maps_are_distributions_that_skip_padding_and_future():
    torch.manual_seed(3)
    model = tiny()
    src, tgt = words(2, 6), with_bos(words(2, 5))
    src[1, 4:] = PAD_ID
    before = {name: p.clone() for name, p in model.named_parameters()}
    maps = attention_maps(model, src, tgt)
    # The model is not touched: its modules run SDPA as before, and its parameters are the same.
    assert not any(isinstance(m, RecordedAttention) for m in model.modules())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    B, H, S, T = 2, 4, 6, 5
    for name, shape in [("encoder", (B, H, S, S)), ("decoder", (B, H, T, T)), ("cross", (B, H, T, S))]:
        assert len(maps[name]) == 2
        for w in maps[name]:
            assert w.shape == shape
            torch.testing.assert_close(w.sum(-1), torch.ones(shape[:-1]), atol=1e-6, rtol=0)
    for w in maps["encoder"] + maps["cross"]:
        assert w[1, :, :, 4:].abs().max() == 0  # padded source keys get no weight
        assert w[0].min() > 0  # and nothing else is hidden
    for w in maps["decoder"]:
        future = ~future_hidden(T)[0]
        assert w[:, :, future].abs().max() == 0
        assert w[:, :, ~future].min() > 0


# --- §3.1 LayerNorm, residuals ------------------------------------------------------------------------


def test_layer_norm_is_per_feature_and_post_norm_by_default():
    model = tiny()
    assert model.config.norm == "post"
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 2 * 2 + 2 * 3  # one per sublayer, no extra final norms in post-norm
    for norm in norms:
        assert norm.weight.shape == norm.bias.shape == (64,)
    assert isinstance(model.encoder_norm, nn.Identity) and isinstance(model.decoder_norm, nn.Identity)

    layer = model.encoder[0]
    torch.manual_seed(4)
    gain, bias = torch.rand(64) + 0.5, torch.randn(64)
    with torch.no_grad():
        layer.feed_forward_norm.weight.copy_(gain)
        layer.feed_forward_norm.bias.copy_(bias)
    x = 3 * torch.randn(2, 7, 64)
    z = (layer(x, None) - bias) / gain  # undo the per-feature gain and bias
    torch.testing.assert_close(z.mean(-1), torch.zeros(2, 7), atol=1e-5, rtol=0)  # per position
    torch.testing.assert_close(z.var(-1, unbiased=False), torch.ones(2, 7), atol=1e-3, rtol=0)


def test_pre_norm_option_builds_final_norms_and_leaves_layer_output_unnormalised():
    model = tiny(norm="pre")
    assert isinstance(model.encoder_norm, nn.LayerNorm) and isinstance(model.decoder_norm, nn.LayerNorm)
    assert model.encoder_norm.weight.shape == (64,)
    out = model.encoder[0](3 * torch.randn(2, 7, 64), None)  # x + Sublayer(LayerNorm(x)): not normalised
    assert (out.var(-1, unbiased=False) - 1).abs().min() > 0.5
    states = model.encode(words(2, 7)).states  # ...until the final norm
    torch.testing.assert_close(states.var(-1, unbiased=False), torch.ones(2, 7), atol=1e-3, rtol=0)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_whole_model_equals_naive_forward(norm):
    torch.manual_seed(5)
    model = tiny(norm=norm)
    with torch.no_grad():  # nonzero biases and gains, so every parameter's role is checked
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(
                    torch.randn_like(p) * 0.5 + (1.0 if "norm" in name and name.endswith("weight") else 0.0)
                )
    src, tgt = words(3, 7), with_bos(words(3, 6))
    src[1, 5:] = PAD_ID
    src[2, 2:] = PAD_ID
    tgt[2, 3:] = PAD_ID
    with torch.no_grad():
        torch.testing.assert_close(model(src, tgt), naive_forward(model, src, tgt), atol=1e-4, rtol=1e-4)


# --- Masks: causality and padding ---------------------------------------------------------------------


def test_decoder_is_causal():
    torch.manual_seed(6)
    model = tiny()
    src, tgt = words(2, 6), with_bos(words(2, 8))
    with torch.no_grad():
        logits = model(src, tgt)
        for t in [1, 4, 7]:
            changed = tgt.clone()
            changed[:, t:] = FIRST_WORD + (tgt[:, t:] - FIRST_WORD + 1) % (
                V - FIRST_WORD
            )  # every token differs
            new = model(src, changed)
            torch.testing.assert_close(new[:, :t], logits[:, :t], atol=1e-6, rtol=0)  # the past ignores it
            assert (new[:, t] - logits[:, t]).abs().max() > 1e-3  # position t reads its own token
        changed_src = src.clone()
        changed_src[:, -1] = FIRST_WORD + (src[:, -1] - FIRST_WORD + 1) % (V - FIRST_WORD)
        new = model(changed_src, tgt)
    # the encoder is not causal: the last source word reaches every target position
    assert ((new - logits).abs().amax(-1) > 1e-4).all()


def test_padding_does_not_change_the_logits():
    torch.manual_seed(7)
    model = tiny()
    src, tgt = words(2, 6), with_bos(words(2, 5))
    pads = torch.full((2, 4), PAD_ID)
    with torch.no_grad():
        logits = model(src, tgt)
        torch.testing.assert_close(model(torch.cat([src, pads], 1), tgt), logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(model(src, torch.cat([tgt, pads], 1))[:, :5], logits, atol=1e-5, rtol=0)
        # not vacuous: a PAD token embeds to its positional encoding, so an unmasked pad would be seen
        assert model.tgt_embed(pads).abs().max() > 0.1


def test_logits_where_asked_are_the_full_logits_at_those_positions():
    torch.manual_seed(9)
    model = tiny()
    src, tgt = padded_batch()
    where = torch.rand(tgt.shape) < 0.5  # (B, T) any positions, in row-major order
    with torch.no_grad():
        torch.testing.assert_close(model(src, tgt, where), model(src, tgt)[where], atol=1e-6, rtol=0)


def test_batching_with_a_longer_sentence_gives_the_same_logits():
    torch.manual_seed(8)
    model = tiny()
    short_src, short_tgt = words(1, 3), with_bos(words(1, 4))
    long_src, long_tgt = words(1, 9), with_bos(words(1, 8))
    src = torch.cat([F.pad(short_src, (0, 6), value=PAD_ID), long_src])
    tgt = torch.cat([F.pad(short_tgt, (0, 4), value=PAD_ID), long_tgt])
    with torch.no_grad():
        batched = model(src, tgt)
        torch.testing.assert_close(batched[:1, :4], model(short_src, short_tgt), atol=1e-5, rtol=0)
        torch.testing.assert_close(batched[1:], model(long_src, long_tgt), atol=1e-5, rtol=0)


def fully_padded_batch() -> tuple[Tensor, Tensor]:
    """Row 0 normal, row 1 an all-padding source, row 2 an all-padding target."""
    torch.manual_seed(9)
    src, tgt = words(3, 6), with_bos(words(3, 5))
    src[0, 4:] = PAD_ID
    src[1] = PAD_ID
    tgt[2] = PAD_ID
    return src, tgt


@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast-bf16"])
def test_fully_padded_sentences_give_finite_values_and_gradients(mode):
    model = tiny().train()  # gradients as in training (dropout is 0 in `tiny`)
    if mode == "bf16":
        model.to(torch.bfloat16)
    src, tgt = fully_padded_batch()
    tgt_out = torch.cat([tgt[:, 1:], torch.full((3, 1), EOS_ID)], 1)
    tgt_out[2] = PAD_ID
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast-bf16"):
        logits = model(src, tgt)
    assert logits.dtype == (torch.float32 if mode == "fp32" else torch.bfloat16)
    assert torch.isfinite(logits).all()
    loss = F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten(), ignore_index=PAD_ID)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.float().abs().sum() for g in grads) > 0
    for maps in attention_maps(model, src, tgt).values():
        assert all(torch.isfinite(w).all() for w in maps)


def test_fully_padded_rows_do_not_disturb_the_others():
    model = tiny()
    src, tgt = fully_padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(src, tgt)[:1], model(src[:1, :4], tgt[:1]), atol=1e-5, rtol=0)


# --- Incremental decoding with the cache ---------------------------------------------------------------


def padded_batch(B: int = 3, S: int = 7, T: int = 9) -> tuple[Tensor, Tensor]:
    torch.manual_seed(10)
    src, tgt = words(B, S), with_bos(words(B, T))
    for b in range(1, B):
        src[b, S - 2 * b :] = PAD_ID
    return src, tgt


def decode_in_chunks(model: Transformer, src: Tensor, tgt: Tensor, sizes: list[int]) -> Tensor:
    memory = model.encode(src)
    cache = model.new_cache(memory, tgt.size(1))
    out, start = [], 0
    for size in sizes:
        out.append(model.decode(tgt[:, start : start + size], memory, cache))  # (B, size, V)
        start += size
        assert cache.length == start
    return torch.cat(out, dim=1)  # (B, T, V)


@pytest.mark.parametrize("sizes", [[1] * 9, [2, 3, 1, 3], [3, 3, 3], [9]])
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_cached_decoding_equals_full_decoding(sizes, norm):
    model = tiny(norm=norm)
    src, tgt = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(
            decode_in_chunks(model, src, tgt, sizes), model(src, tgt), atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("index", [[2, 0, 0, 1], [1], [2, 1, 0]])
def test_cache_reorder_equals_decoding_the_reordered_batch(index):
    model = tiny()
    src, tgt = padded_batch()
    index = torch.tensor(index)
    with torch.no_grad():
        expected = model(src[index], tgt[index])
        memory = model.encode(src)
        cache = model.new_cache(memory, tgt.size(1))
        model.decode(tgt[:, :4], memory, cache)
        cache.reorder(index, sentences=index)
        steps = [model.decode(tgt[index, t : t + 1], memory, cache) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), expected[:, 4:], atol=1e-5, rtol=0)


def test_beam_rows_share_cross_attention_and_follow_their_parents():
    """expand(N), reordering within sentences and dropping a sentence == decoding those rows in full."""
    model, N = tiny(), 2
    src, tgt = padded_batch()  # 3 sentences, differently padded
    torch.manual_seed(11)
    tgt = torch.stack([tgt, with_bos(words(3, 9))], 1).flatten(0, 1)  # (B*N, T): rows 2b, 2b+1 of sentence b
    src = src.repeat_interleave(N, 0)  # (B*N, S) the source of every row, for the full decoding

    def full(rows: Tensor, t: int) -> Tensor:
        """Next-token logits after tgt[rows, :t], without a cache."""
        return model(src[rows], tgt[rows, :t])[:, -1]  # (R, V)

    with torch.no_grad():
        cache = model.new_cache(model.encode(src[::N]), tgt.size(1))  # one row per sentence
        cache.expand(N)
        rows = torch.arange(6)  # the target row each cache row has been fed
        got, expected = [model.decode(tgt[rows, :3], None, cache)[:, -1]], [full(rows, 3)]
        swap = torch.tensor([1, 1, 3, 2, 4, 5])  # sentence 0: both follow row 1; sentence 1 swaps its two
        cache.reorder(swap)
        rows = rows[swap]
        got.append(model.decode(tgt[rows, 3:4], None, cache)[:, -1])
        expected.append(full(rows, 4))
        index, keep = torch.tensor([4, 5, 0, 1]), torch.tensor([2, 0])  # sentence 1 leaves, 0 and 2 swap
        cache.reorder(index, sentences=keep)
        rows = rows[index]
        got.append(model.decode(tgt[rows, 4:5], None, cache)[:, -1])
        expected.append(full(rows, 5))
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"step {step}")


# --- A copy task must be learned ------------------------------------------------------------------------


def copy_sequences(g: torch.Generator, n: int) -> list[list[int]]:
    lengths = torch.randint(3, 9, (n,), generator=g).tolist()
    return [torch.randint(FIRST_WORD, FIRST_WORD + 10, (k,), generator=g).tolist() for k in lengths]


def pad_rows(rows: list[list[int]]) -> Tensor:
    width = max(map(len, rows))
    return torch.tensor([row + [PAD_ID] * (width - len(row)) for row in rows])


def greedy(model: Transformer, src: Tensor, max_len: int) -> list[list[int]]:
    """Most likely next token, one step at a time through the cache, until every row has said EOS."""
    memory = model.encode(src)
    cache = model.new_cache(memory, max_len)
    y = torch.full((src.size(0), 1), BOS_ID)  # (B, 1)
    out, done = [], torch.zeros(src.size(0), dtype=torch.bool)
    for _ in range(max_len):
        y = model.decode(y, memory, cache)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        out.append(y)
        done |= y[:, 0] == EOS_ID
        if done.all():
            break
    return torch.cat(out, 1).tolist()


def test_tiny_model_learns_to_copy():
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=FIRST_WORD + 10))
    steps, lr = 300, 2e-3
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98))
    held_out = copy_sequences(torch.Generator().manual_seed(1234), 200)
    unseen = {tuple(s) for s in held_out}
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        batch = [s for s in copy_sequences(g, 64) if tuple(s) not in unseen]
        src = pad_rows([s + [EOS_ID] for s in batch])
        tgt_in, tgt_out = pad_rows([[BOS_ID] + s for s in batch]), pad_rows([s + [EOS_ID] for s in batch])
        loss = F.cross_entropy(model(src, tgt_in).flatten(0, 1), tgt_out.flatten(), ignore_index=PAD_ID)
        for group in optimizer.param_groups:  # linear decay to 0: constant lr ends on a loss spike
            group["lr"] = lr * (1 - step / steps)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        out = greedy(model, pad_rows([s + [EOS_ID] for s in held_out]), max_len=10)
    wrong = [(s, o) for s, o in zip(held_out, out) if o[: len(s) + 1] != s + [EOS_ID]]
    assert not wrong, f"{len(wrong)}/200 held-out sequences not copied, e.g. {wrong[:3]}"


# --- §3.4 Shared weights ------------------------------------------------------------------------------


def test_shared_embeddings_are_one_tensor():
    model = tiny()
    w = model.tgt_embed.tokens.weight
    assert model.src_embed.tokens.weight is w and model.generator.weight is w
    with torch.no_grad():
        model.generator.weight[5, 3] = 7.0
    assert model.src_embed.tokens.weight[5, 3] == 7.0 and model.tgt_embed.tokens.weight[5, 3] == 7.0


def test_separate_vocabularies():
    model = tiny(share_embeddings=False, src_vocab_size=20, tgt_vocab_size=30)
    src_w, tgt_w = model.src_embed.tokens.weight, model.tgt_embed.tokens.weight
    assert src_w.shape == (20, 64) and tgt_w.shape == (30, 64)
    assert src_w.data_ptr() != tgt_w.data_ptr()
    assert model.generator.weight is tgt_w  # §3.4 output projection still tied to the target embedding
    with torch.no_grad():
        src_w[5, 3] = 7.0
        model.generator.weight[6, 2] = 9.0
    assert tgt_w[5, 3] != 7.0 and tgt_w[6, 2] == 9.0
    src = torch.randint(FIRST_WORD, 20, (2, 5))
    tgt = with_bos(torch.randint(FIRST_WORD, 30, (2, 4)))
    tgt[0, 1] = 29  # a target id the source vocabulary does not have
    with torch.no_grad():
        assert model(src, tgt).shape == (2, 4, 30)

    untied = tiny(share_embeddings=False, tie_output=False, src_vocab_size=20, tgt_vocab_size=30)
    pointers = {
        untied.src_embed.tokens.weight.data_ptr(),
        untied.tgt_embed.tokens.weight.data_ptr(),
        untied.generator.weight.data_ptr(),
    }
    assert len(pointers) == 3
    with torch.no_grad():
        assert untied(src, tgt).shape == (2, 4, 30)


# --- Learned and extended positions ---------------------------------------------------------------------


def test_learned_positions_work_and_refuse_long_sequences():
    model = tiny(positions="learned", max_positions=10)
    assert model.tgt_embed.positions.weight.shape == (10, 64)
    ids = words(2, 10)
    expected = model.tgt_embed.tokens.weight[ids] * math.sqrt(64) + model.tgt_embed.positions.weight
    torch.testing.assert_close(model.tgt_embed(ids), expected, atol=1e-6, rtol=0)
    with torch.no_grad():
        assert model(words(2, 10), with_bos(words(2, 10))).shape == (2, 10, V)
        with pytest.raises(ValueError, match="max_positions=10"):
            model(words(2, 11), with_bos(words(2, 3)))
        with pytest.raises(ValueError, match="max_positions=10"):
            model(words(2, 3), with_bos(words(2, 11)))
        memory = model.encode(words(2, 3))
        cache = model.new_cache(memory, 12)
        model.decode(with_bos(words(2, 10)), memory, cache)
        with pytest.raises(ValueError, match="max_positions=10"):
            model.decode(words(2, 1), memory, cache)


def test_sinusoids_extend_beyond_max_positions():
    model = tiny(max_positions=8)
    src, tgt = words(2, 20), with_bos(words(2, 25))
    with torch.no_grad():
        short = model(src[:, :5], tgt[:, :6])
        logits = model(src, tgt)
        assert logits.shape == (2, 25, V)
        torch.testing.assert_close(model.tgt_embed.table[:25], pe_table(25, 64), atol=1e-6, rtol=0)
        torch.testing.assert_close(model(src[:, :5], tgt[:, :6]), short, atol=0, rtol=0)  # prefix unchanged
        torch.testing.assert_close(
            decode_in_chunks(tiny(max_positions=8), src, tgt, [1] * 25), logits, atol=1e-5, rtol=0
        )


def test_sinusoids_extend_in_bfloat16():
    model = tiny(max_positions=8).to(torch.bfloat16)
    with torch.no_grad():
        logits = model(words(2, 12), with_bos(words(2, 12)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


# --- Initialisation --------------------------------------------------------------------------------------


def test_xavier_uniform_linear_weights_zero_biases_zero_pad_row():
    model = tiny(share_embeddings=False, tie_output=False, src_vocab_size=20, tgt_vocab_size=30)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 2 * (2 + 2) + 2 * (2 + 3 + 2) + 1  # attention projections, w_1/w_2, generator
    for m in linears:
        fan_out, fan_in = m.weight.shape
        bound = math.sqrt(6 / (fan_in + fan_out))
        assert m.weight.abs().max() <= bound
        # uniform on [-bound, bound] has std bound/sqrt(3); PyTorch's default bound 1/sqrt(fan_in) would not
        assert m.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1)
        if m.bias is not None:
            assert m.bias.abs().max() == 0
    for embed in [model.src_embed, model.tgt_embed]:
        assert embed.tokens.weight[PAD_ID].abs().max() == 0
        assert embed.tokens.weight.std().item() == pytest.approx(64**-0.5, rel=0.1)  # N(0, d_model^-0.5)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            assert (m.weight == 1).all() and (m.bias == 0).all()
    assert tiny().tgt_embed.tokens.weight[PAD_ID].abs().max() == 0  # also when shared (and tied)


@pytest.mark.parametrize(
    ("activation", "formula"),
    [
        ("relu", lambda h: h.clamp(min=0)),  # §3.3: max(0, x W_1 + b_1)
        ("swish", lambda h: h / (1 + torch.exp(-h))),  # x sigmoid(x), OPUS-MT's
        ("gelu", lambda h: 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))),  # x Phi(x), exact
    ],
)
def test_the_feed_forward_applies_the_activation_the_config_names(activation, formula):
    torch.manual_seed(0)
    ffn = FeedForward(preset("tiny", vocab_size=10, activation=activation))
    x = 2 * torch.randn(2, 3, 64)
    hidden = x @ ffn.w_1.weight.T + ffn.w_1.bias
    want = formula(hidden) @ ffn.w_2.weight.T + ffn.w_2.bias
    torch.testing.assert_close(ffn(x), want, atol=1e-5, rtol=1e-5)


def test_an_output_bias_adds_to_every_logit_of_the_tied_projection():
    """output_bias (an imported model's final_logits_bias): the logits of the same weights without it, plus
    the bias; the projection stays tied to the target embedding, and the bias is a parameter counted once."""
    torch.manual_seed(0)
    biased = Transformer(preset("tiny", vocab_size=30, output_bias=True)).eval()
    nn.init.normal_(biased.generator.bias)
    plain = Transformer(preset("tiny", vocab_size=30)).eval()
    plain.load_state_dict({k: v for k, v in biased.state_dict().items() if k != "generator.bias"})
    src, tgt_in = torch.randint(4, 30, (2, 5)), torch.randint(4, 30, (2, 4))
    with torch.no_grad():
        torch.testing.assert_close(biased(src, tgt_in), plain(src, tgt_in) + biased.generator.bias)
    assert biased.generator.weight is biased.tgt_embed.tokens.weight
    assert biased.num_parameters() == plain.num_parameters() + 30 == biased.config.num_parameters()
