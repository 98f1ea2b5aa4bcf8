"""Tests for aiayn.interop.ctranslate2: a briefly trained model and its CTranslate2 export translate alike (greedy and
exact beam search token for token, beam with a length penalty equal or aiayn's better), per-token
log-probabilities agree for pre-norm, separate vocabularies and learned positions, and the CLI."""

import json
import random

import pytest
import torch
from conftest import run_train

ctranslate2 = pytest.importorskip("ctranslate2")

from aiayn.checkpoint import save_model  # noqa: E402
from aiayn.cli.main import main  # noqa: E402
from aiayn.config import SearchConfig, TrainConfig, preset  # noqa: E402
from aiayn.data.corpus import Corpus  # noqa: E402
from aiayn.data.synthetic import generate  # noqa: E402
from aiayn.inference.translate import Translator  # noqa: E402
from aiayn.interop.ctranslate2 import AIAYN_CONFIG, CTranslate2Translator, export_ctranslate2  # noqa: E402
from aiayn.model import Transformer  # noqa: E402
from aiayn.tokenizer import BOS_ID, Tokenizer  # noqa: E402

# Reverse a sequence of made-up words: a tiny model learns enough of it in 150 updates that its outputs
# depend on the input and end with EOS at varied lengths, so search has real choices to make.
WORDS = "ka lo mi nu pe ri so tu va we xi yo za bo cu de fa gi hu ja".split()
_rng = random.Random(0)
SRC = [" ".join(_rng.choice(WORDS) for _ in range(_rng.randint(3, 10))) for _ in range(3030)]
TGT = [" ".join(reversed(s.split())) for s in SRC]
TEST = SRC[3000:]  # 30 sentences the model has not seen


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(model directory, its CTranslate2 export, aiayn Translator, CTranslate2Translator)."""
    root = tmp_path_factory.mktemp("export")
    tokenizer = Tokenizer.train(SRC[:3000], TGT[:3000], vocab_size=300, kind="word", min_frequency=1)
    corpus = Corpus(SRC[:3000], TGT[:3000])
    config = preset("tiny", vocab_size=tokenizer.src_vocab_size)
    train_config = TrainConfig(dtype="fp32", max_updates=250, max_tokens=1000, warmup_steps=100)
    run_train(root / "model", config, train_config, tokenizer, corpus)
    export_ctranslate2(root / "model", root / "ct2")
    ours = Translator.load(root / "model", dtype="fp32", device="cpu")  # CTranslate2's float32
    theirs = CTranslate2Translator(root / "ct2", threads=1)
    return root / "model", root / "ct2", ours, theirs


def both(trained, config: SearchConfig):
    _, _, ours, theirs = trained
    ids = ours.tokenizer.encode_src(TEST)
    return ours.translate_ids(ids, config), theirs.translate_ids(ids, config)


def test_export_writes_a_ctranslate2_directory(trained):
    model_dir, ct2_dir, ours, _ = trained
    names = {p.name for p in ct2_dir.iterdir()}
    assert {"model.bin", "config.json", "shared_vocabulary.json", "tokenizer.json", AIAYN_CONFIG} <= names
    config = json.loads((ct2_dir / "config.json").read_text())
    assert config["decoder_start_token"] == "<s>" and config["eos_token"] == "</s>"
    assert config["add_source_eos"] is False and config["add_source_bos"] is False  # ids carry their EOS
    assert config["layer_norm_epsilon"] == 1e-5  # nn.LayerNorm's
    vocabulary = json.loads((ct2_dir / "shared_vocabulary.json").read_text())
    assert vocabulary == ours.tokenizer.src_tokens() and vocabulary[:4] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert json.loads((ct2_dir / AIAYN_CONFIG).read_text()) == json.loads(
        (model_dir / "config.json").read_text()
    )


def test_greedy_equals_aiayn(trained):
    ours, theirs = both(trained, SearchConfig(beam_size=1))
    assert [h[0].tokens for h in theirs] == [h[0].tokens for h in ours]
    lengths = [len(h[0].tokens) for h in ours]
    limits = [len(ids) + 50 for ids in trained[2].tokenizer.encode_src(TEST)]  # §6.1 input length + 50
    assert len(set(lengths)) > 3  # varied outputs
    # most end with EOS (how many depends on the kernels its 250 updates ran: 25 of 30 capped at AVX2)
    assert sum(n < limit for n, limit in zip(lengths, limits)) >= 0.75 * len(TEST)
    for a, b in zip(ours, theirs):  # the same length penalty (gnmt) applied to the same log-probability
        assert b[0].log_prob == pytest.approx(a[0].log_prob, abs=1e-4)
        assert b[0].score == pytest.approx(a[0].score, abs=1e-4)


def test_exact_beam_search_equals_aiayn(trained):
    """alpha=0, one best: both stop only when no live hypothesis can win (CTranslate2 when its best
    candidate ends in EOS), so they agree exactly. With n_best > 1 CTranslate2 may stop earlier."""
    config = SearchConfig(beam_size=4, alpha=0.0)
    ours, theirs = both(trained, config)
    assert [[h.tokens for h in n] for n in theirs] == [[h.tokens for h in n] for n in ours]
    greedy, _ = both(trained, SearchConfig(beam_size=1))
    assert sum(a[0].tokens != g[0].tokens for a, g in zip(ours, greedy)) >= 3  # the beam mattered


def test_beam_with_length_penalty_equal_or_aiayn_better(trained):
    """CTranslate2 stops at beam_size finished hypotheses; aiayn searches on while one could still win,
    so any difference must be aiayn's output scoring higher."""
    config = SearchConfig(beam_size=4, alpha=0.6, length_penalty="average")
    ours, theirs = both(trained, config)
    same = 0
    for a, b in zip(ours, theirs):
        if a[0].tokens == b[0].tokens:
            same += 1
            assert b[0].score == pytest.approx(a[0].score, abs=1e-4)
        else:
            assert a[0].score > b[0].score
    assert same >= 25


def test_gnmt_length_penalty_refused_for_beams(trained):
    _, _, ours, theirs = trained
    with pytest.raises(ValueError, match="GNMT"):
        theirs.translate_ids(ours.tokenizer.encode_src(TEST[:2]), SearchConfig(beam_size=4))


def test_translate_text_with_empty_lines(trained):
    _, _, ours, theirs = trained
    texts = [TEST[0], "", TEST[1], "xx unknown", TEST[2]]
    assert theirs.translate(texts, beam_size=1) == ours.translate(texts, beam_size=1)
    assert theirs.translate(texts, beam_size=1)[1] == ""


def test_cli_export(trained, tmp_path, capsys):
    model_dir, _, ours, _ = trained
    out = tmp_path / "ct2"
    assert main(["export", str(model_dir), "--format", "ctranslate2", "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out) == {"format": "ctranslate2", "out": str(out)}
    theirs = CTranslate2Translator(out, threads=1)
    assert theirs.translate(TEST[:5], beam_size=1) == ours.translate(TEST[:5], beam_size=1)
    assert main(["export", str(model_dir), "--out", str(out)]) == 2  # exists: needs --force
    assert "--force" in capsys.readouterr().err
    assert main(["export", str(model_dir), "--out", str(out), "--force", "--quantization", "int9"]) == 2
    assert main(["export", str(model_dir), "--out", str(model_dir), "--force"]) == 2
    assert (model_dir / "model.safetensors").is_file()
    assert main(["export", str(model_dir), "--out", str(out), "--force", "--quantization", "int8"]) == 0
    assert len(CTranslate2Translator(out, threads=1).translate(TEST[:5], beam_size=1)) == 5


# --- Options, on untrained models: the per-token log-probabilities must agree -----------------------

V_SRC, V_TGT = generate(200, seed=3)


@pytest.mark.parametrize(
    "norm, joint, positions, activation",
    [("pre", True, "sinusoidal", "relu"), ("post", False, "learned", "relu"), ("pre", False, "sinusoidal", "gelu"),
     ("post", True, "sinusoidal", "swish")],  # swish and gelu with an output bias: an imported model's
)  # fmt: skip
def test_variants_score_like_aiayn(tmp_path, norm, joint, positions, activation):
    tokenizer = Tokenizer.train(V_SRC, V_TGT, vocab_size=300, joint=joint)
    torch.manual_seed(0)
    config = preset(
        "tiny",
        src_vocab_size=tokenizer.src_vocab_size,
        tgt_vocab_size=tokenizer.tgt_vocab_size,
        share_embeddings=joint,
        tie_output=joint,  # separate vocabularies: an output projection of its own, too
        norm=norm,
        positions=positions,
        max_positions=96,
        activation=activation,
        output_bias=activation != "relu",
    )
    model = Transformer(config).eval()
    with torch.no_grad():  # LayerNorm gains and biases away from 1 and 0, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            elif name == "generator.bias":
                p.normal_(0.0, 2.0)
    save_model(tmp_path / "model", model, tokenizer)
    export_ctranslate2(tmp_path / "model", tmp_path / "ct2")
    theirs = CTranslate2Translator(tmp_path / "ct2", threads=1)
    names = {p.name for p in (tmp_path / "ct2").iterdir()}
    assert ("shared_vocabulary.json" in names) == joint

    src, tgt = tokenizer.encode_src(V_SRC[:8]), tokenizer.encode_tgt(V_TGT[:8])
    src_tokens, tgt_tokens = tokenizer.src_tokens(), tokenizer.tgt_tokens()
    scored = theirs.engine.score_batch(
        [[src_tokens[i] for i in x] for x in src], [[tgt_tokens[i] for i in y[:-1]] for y in tgt]
    )
    with torch.no_grad():
        for x, y, result in zip(src, tgt, scored):
            logits = model(torch.tensor([x]), torch.tensor([[BOS_ID, *y[:-1]]]))  # (1, T, V)
            expected = logits[0].log_softmax(-1).gather(1, torch.tensor(y)[:, None])[:, 0]  # (T,), EOS last
            assert torch.allclose(torch.tensor(result.log_probs), expected, atol=1e-4)

    search = SearchConfig(beam_size=1, max_len_a=0.0, max_len_b=20)
    ours = Translator(model, tokenizer, dtype="fp32").translate_ids(src, search)
    assert [h[0].tokens for h in theirs.translate_ids(src, search)] == [h[0].tokens for h in ours]
    with pytest.raises(ValueError, match="max_positions"):  # 100 output positions > the 96 exported
        theirs.translate_ids(src[:1], SearchConfig(beam_size=1, max_len_a=0.0, max_len_b=100))


def test_sentences_of_mixed_lengths_are_one_call_and_equal_one_by_one(trained, monkeypatch):
    """CTranslate2 takes one maximum length per call; grouping by length would split a server's batch
    of mixed lengths into calls of one or two sentences. One call, plus one per limit some output
    reached, gives what each sentence alone gives."""
    _, _, ours, theirs = trained
    ids = ours.tokenizer.encode_src(TEST)
    assert len({len(x) for x in ids}) > 5  # many different limits
    engine, calls = theirs.engine, []

    class Counting:
        def translate_batch(self, batch, **kwargs):
            calls.append(len(batch))
            return engine.translate_batch(batch, **kwargs)

    for config in (SearchConfig(beam_size=1), SearchConfig(beam_size=4, alpha=0.0)):
        alone = [theirs.translate_ids([x], config)[0] for x in ids]
        calls.clear()
        monkeypatch.setattr(theirs, "engine", Counting())
        together = theirs.translate_ids(ids, config)
        monkeypatch.setattr(theirs, "engine", engine)
        assert [[h.tokens for h in n] for n in together] == [[h.tokens for h in n] for n in alone]
        reached = {len(x) + 50 for x, n in zip(ids, alone) if len(n[0].tokens) + 1 >= len(x) + 50}
        assert calls[0] == len(ids) and len(calls) == 1 + len(reached), calls
