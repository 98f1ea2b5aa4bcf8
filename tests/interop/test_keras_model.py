"""Tests for aiayn.interop.keras_model: on briefly trained tiny models, the Keras 3 functional model with aiayn's
weights gives aiayn's logits (1e-4, fp32) for a padded batch under every architecture option, the same
greedy translations token for token, the same logits from a .keras file loaded in a fresh process that
never imports aiayn's PyTorch code, and a masked position never changes an output.

Skipped when Keras is not installed; `make test` installs it (the dev extra), so CI runs them.
"""

import importlib.util
import json
import random
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, run_cli, run_train

if importlib.util.find_spec("keras") is None:  # not importorskip: a broken Keras must fail, not skip
    pytest.skip("keras is not installed (pip install 'aiayn[keras]')", allow_module_level=True)

from aiayn.checkpoint import load_model  # noqa: E402
from aiayn.config import SearchConfig, TrainConfig, preset  # noqa: E402
from aiayn.data.corpus import Corpus  # noqa: E402
from aiayn.inference.search import greedy_search, max_lengths  # noqa: E402
from aiayn.interop import keras_model  # noqa: E402  (first: it picks Keras's backend, torch unless KERAS_BACKEND says)
from aiayn.model import sinusoids  # noqa: E402
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer  # noqa: E402

keras = keras_model.keras

# Reverse a sequence of made-up words (as test_export): a tiny model learns enough of it in 150 updates
# that its outputs depend on the input and end with EOS at varied lengths.
WORDS = "ka lo mi nu pe ri so tu va we xi yo za bo cu de fa gi hu ja".split()
_rng = random.Random(0)
SRC = [" ".join(_rng.choice(WORDS) for _ in range(_rng.randint(3, 10))) for _ in range(2030)]
TGT = [" ".join(reversed(s.split())) for s in SRC]
TEST = SRC[2000:]  # 30 sentences the model has not seen

OPTIONS = {  # the architecture options that change the graph or its weights (ModelConfig fields)
    "paper": {},  # post-norm, sinusoids, one shared vocabulary and matrix (§3.4)
    "pre-norm": {"norm": "pre"},
    "learned-positions": {"positions": "learned"},
    "separate-vocabularies": {"share_embeddings": False, "tie_output": False},
    "gelu-output-bias": {"activation": "gelu", "output_bias": True},  # an imported model's (exact gelu)
}


@pytest.fixture(scope="module", params=list(OPTIONS))
def trained(request, tmp_path_factory):
    """(option name, model directory, the aiayn model, its Keras twin) for one architecture option."""
    name = request.param
    root = tmp_path_factory.mktemp(f"keras-{name}")
    joint = OPTIONS[name].get("share_embeddings", True)
    tokenizer = Tokenizer.train(
        SRC[:2000], TGT[:2000], vocab_size=300, kind="word", joint=joint, min_frequency=1
    )
    config = preset("tiny", **OPTIONS[name])
    config = replace(config, src_vocab_size=tokenizer.src_vocab_size, tgt_vocab_size=tokenizer.tgt_vocab_size)
    # the paper model also has to translate (greedy test); with an output bias, 60 updates learn little
    # more than the bias (the logits hardly depend on the target's tokens)
    updates = 150 if name in ("paper", "gelu-output-bias") else 60
    train_config = TrainConfig(dtype="fp32", max_updates=updates, max_tokens=1000, warmup_steps=50)
    run_train(root / "model", config, train_config, tokenizer, Corpus(SRC[:2000], TGT[:2000]))
    return name, root / "model", load_model(root / "model"), keras_model.from_aiayn(root / "model")


def padded_batch(tokenizer: Tokenizer, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """src (n, S) and tgt_in (n, T) ids of TEST sentences of different lengths, padded with PAD_ID."""
    src_ids = tokenizer.encode_src(TEST[:n])
    tgt_ids = [[BOS_ID] + ids[:-1] for ids in tokenizer.encode_src(TGT[2000 : 2000 + n])]  # shifted right
    assert len({len(x) for x in src_ids}) > 2  # really padded

    def pad(rows):
        out = torch.full((len(rows), max(map(len, rows))), PAD_ID, dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, : len(row)] = torch.tensor(row)
        return out

    return pad(src_ids), pad(tgt_ids)


def keras_logits(model: keras.Model, src: torch.Tensor, tgt_in: torch.Tensor) -> np.ndarray:
    return keras.ops.convert_to_numpy(model([src.int().numpy(), tgt_in.int().numpy()], training=False))


def numpy(x) -> np.ndarray:
    return keras.ops.convert_to_numpy(x)


@torch.no_grad()
def test_logits_equal_aiayn_for_a_padded_batch(trained):
    _, model_dir, ours, theirs = trained
    src, tgt_in = padded_batch(Tokenizer.load(model_dir))
    expected = ours(src, tgt_in).numpy()  # (B, T, V)
    got = keras_logits(theirs, src, tgt_in)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    assert np.abs(expected).max() > 1.0  # trained logits, not a near-zero pair that agrees by accident


def test_every_weight_is_aiayns_once(trained):
    """As many numbers as aiayn's distinct parameters (a tied matrix once), each a copy of one of them."""
    _, _, ours, theirs = trained
    assert sum(int(np.prod(w.shape)) for w in theirs.weights) == ours.num_parameters()
    assert len(theirs.weights) == len(list(ours.parameters()))


def test_greedy_translations_identical(trained):
    name, model_dir, ours, theirs = trained
    if name != "paper":
        pytest.skip("the greedy comparison runs on the longest-trained model")
    tokenizer = Tokenizer.load(model_dir)
    ids = tokenizer.encode_src(TEST)
    src = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(x) for x in ids], batch_first=True, padding_value=PAD_ID
    )
    limits = max_lengths(src, SearchConfig())  # §6.1: source length + 50
    expected = greedy_search(ours, src, max_len=limits)
    got = keras_model.greedy_translate(theirs, ids, max_len=limits.tolist())
    assert got == expected
    assert len({len(x) for x in expected}) > 3  # varied outputs, ended by EOS
    assert tokenizer.decode_tgt(got[:3]) == tokenizer.decode_tgt(expected[:3])


def test_greedy_translate_stops_at_max_len(trained):
    """Per-sentence limits count EOS, as aiayn's: a sentence cut at its limit keeps what it produced."""
    _, model_dir, ours, theirs = trained
    ids = Tokenizer.load(model_dir).encode_src(TEST[:4])
    src = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(x) for x in ids], batch_first=True, padding_value=PAD_ID
    )
    limits = [1, 2, 3, 60]
    got = keras_model.greedy_translate(theirs, ids, max_len=limits)
    assert got == greedy_search(ours, src, max_len=torch.tensor(limits))
    assert [len(x) <= n for x, n in zip(got, limits)] == [True] * 4
    with pytest.raises(ValueError, match="at least 1"):
        keras_model.greedy_translate(theirs, ids, max_len=0)
    assert keras_model.greedy_translate(theirs, [], max_len=5) == []


@torch.no_grad()
def test_a_masked_position_never_changes_an_output(trained):
    _, model_dir, ours, theirs = trained
    src, tgt_in = padded_batch(Tokenizer.load(model_dir))
    batch = keras_logits(theirs, src, tgt_in)
    # padding: each sentence alone, unpadded, gives what it gave in the padded batch
    for i in range(src.size(0)):
        s, t = src[i : i + 1, : int((src[i] != PAD_ID).sum())], tgt_in[i : i + 1]
        np.testing.assert_allclose(keras_logits(theirs, s, t)[0], batch[i], atol=1e-5, rtol=0)
    # causality: changing target position j changes no earlier position's logits
    j = 3
    changed = tgt_in.clone()
    V = ours.config.tgt_vocab_size
    changed[:, j:] = (changed[:, j:] + 1) % (V - 4) + 4  # other real tokens
    other = keras_logits(theirs, src, changed)
    np.testing.assert_allclose(other[:, :j], batch[:, :j], atol=1e-5, rtol=0)
    assert np.abs(other[:, j:] - batch[:, j:]).max() > 1e-4  # the change was seen where it may be
    # a sentence of nothing but padding: finite numbers, not NaN, and the others untouched
    src[0] = PAD_ID
    with_empty = keras_logits(theirs, src, tgt_in)
    assert np.isfinite(with_empty).all()
    np.testing.assert_allclose(with_empty[1:], batch[1:], atol=1e-5, rtol=0)


def test_the_exported_file_loads_in_a_fresh_process(trained, tmp_path):
    """`aiayn export --format keras` writes a .keras file; a process that imports Keras and
    aiayn.interop.keras_model alone (none of aiayn's PyTorch code) loads it and gives aiayn's logits. Every
    option's file is loaded here; a fresh process (5 s) loads the paper's."""
    name, model_dir, ours, _ = trained
    out = tmp_path / "model.keras"
    code, stdout, stderr = run_cli(["export", model_dir, "--format", "keras", "--out", out])
    assert code == 0, stderr
    assert json.loads(stdout) == {"format": "keras", "out": str(out)}
    src, tgt_in = padded_batch(Tokenizer.load(model_dir))
    with torch.no_grad():
        expected = ours(src, tgt_in).numpy()
    loaded = keras.saving.load_model(out)
    np.testing.assert_allclose(keras_logits(loaded, src, tgt_in), expected, atol=1e-4, rtol=0)
    if name != "paper":
        return
    np.save(tmp_path / "src.npy", src.int().numpy())
    np.save(tmp_path / "tgt_in.npy", tgt_in.int().numpy())
    script = f"""
import sys, numpy as np
import aiayn.interop.keras_model, keras
model = keras.saving.load_model({str(out)!r})
logits = model([np.load({str(tmp_path / "src.npy")!r}), np.load({str(tmp_path / "tgt_in.npy")!r})])
np.save({str(tmp_path / "logits.npy")!r}, keras.ops.convert_to_numpy(logits))
loaded = sorted(m for m in sys.modules if m.startswith("aiayn."))
print(keras.backend.backend(), *loaded)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    backend, *modules = done.stdout.split()
    assert backend == "torch"
    assert not {"aiayn.model", "aiayn.training.train", "aiayn.checkpoint", "aiayn.inference.search"} & set(
        modules
    ), modules
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), expected, atol=1e-4, rtol=0)


def test_export_refuses_what_it_cannot_write(trained, tmp_path):
    name, model_dir, _, _ = trained
    if name != "paper":
        pytest.skip("the same checks for every option")
    code, _, stderr = run_cli(["export", model_dir, "--format", "keras", "--out", tmp_path / "model.h5"])
    assert_one_line_error(code, stderr, "model.h5", ".keras")
    existing = tmp_path / "old.keras"
    existing.write_text("not a model")
    code, _, stderr = run_cli(["export", model_dir, "--format", "keras", "--out", existing])
    assert_one_line_error(code, stderr, "old.keras", "--force")
    assert existing.read_text() == "not a model"  # nothing lost
    code, _, stderr = run_cli(
        ["export", model_dir, "--format", "keras", "--out", existing, "--quantization", "int8"]
    )
    assert_one_line_error(code, stderr, "--quantization")
    code, _, _ = run_cli(["export", model_dir, "--format", "keras", "--out", existing, "--force"])
    assert code == 0 and keras.saving.load_model(existing).name == "transformer"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_missing_or_misshapen_weights_are_named():
    model = keras_model.transformer(src_vocab_size=20, tgt_vocab_size=20, d_model=8, d_ff=16, n_heads=2,
                                    n_encoder_layers=1, n_decoder_layers=1)  # fmt: skip
    with pytest.raises(ValueError, match="no tgt_embed.tokens.weight"):
        keras_model.load_aiayn_weights(model, {})
    with pytest.raises(ValueError, match=r"tgt_embed.tokens.weight is \(21, 8\)"):
        keras_model.load_aiayn_weights(model, {"tgt_embed.tokens.weight": np.zeros((21, 8))})


def test_the_pieces_are_aiayns():
    """The constants and the §3.5 table agree with aiayn's own (written twice, so held equal here)."""
    assert (keras_model.PAD_ID, keras_model.BOS_ID, keras_model.EOS_ID) == (PAD_ID, BOS_ID, EOS_ID)
    assert keras_model.LAYER_NORM_EPS == torch.nn.LayerNorm(4).eps
    np.testing.assert_array_equal(keras_model.sinusoids(300, 16), sinusoids(300, 16).numpy())
    # past max_positions the sinusoids extend, as model.py's do; learned positions refuse
    embed = keras_model.Embedding(10, 16, max_positions=8)
    assert numpy(embed(np.ones((1, 20), dtype="int32"))).shape == (1, 20, 16)
    learned = keras_model.Embedding(10, 16, max_positions=8, positions="learned")
    with pytest.raises(ValueError, match="max_positions=8"):
        learned(np.ones((1, 20), dtype="int32"))


def test_it_trains_in_keras():
    """Fine-tuning in Keras: dropout acts only when training, and a few Adam steps lower the loss."""
    keras.utils.set_random_seed(0)
    model = keras_model.transformer(src_vocab_size=30, tgt_vocab_size=30, d_model=16, d_ff=32, n_heads=2,
                                    n_encoder_layers=1, n_decoder_layers=1, dropout=0.3)  # fmt: skip
    rng = np.random.default_rng(0)
    src = rng.integers(4, 30, size=(8, 7)).astype("int32")
    tgt = np.concatenate([np.full((8, 1), BOS_ID), src[:, ::-1]], axis=1).astype("int32")  # reverse
    src[:, 5:] = PAD_ID
    x = [src, tgt[:, :-1]]
    assert np.allclose(numpy(model(x, training=False)), numpy(model(x, training=False)))
    assert not np.allclose(numpy(model(x, training=True)), numpy(model(x, training=True)))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=PAD_ID)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    first = model.evaluate(x, tgt[:, 1:], verbose=0)
    for _ in range(20):
        model.train_on_batch(x, tgt[:, 1:])
    assert model.evaluate(x, tgt[:, 1:], verbose=0) < 0.7 * first
