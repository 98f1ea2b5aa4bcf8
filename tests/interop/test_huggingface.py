"""aiayn.interop.huggingface: the transformers export loads with transformers' own from_pretrained and
computes aiayn's log-probabilities for every configuration it exports; greedy and beam tokens of
transformers' generate, its translation pipeline and ONNX Runtime (through Optimum) equal aiayn's."""

import dataclasses
import json
import math
import random
import sys

import pytest
import safetensors.torch
import torch
from conftest import EOS_HEAVY_V, eos_heavy_model, word_tokenizer

transformers = pytest.importorskip("transformers")

from aiayn.checkpoint import CONFIG, SEARCH, WEIGHTS, save_model  # noqa: E402
from aiayn.cli.main import main  # noqa: E402
from aiayn.config import SearchConfig, preset  # noqa: E402
from aiayn.data.synthetic import generate  # noqa: E402
from aiayn.inference.translate import Translator  # noqa: E402
from aiayn.interop.huggingface import (  # noqa: E402
    AIAYN_CONFIG,
    TARGET_TOKENIZER,
    export_onnx,
    export_transformers,
    residual_permutation,
)
from aiayn.model import Transformer, sinusoids  # noqa: E402
from aiayn.tokenizer import EOS_ID, PAD_ID  # noqa: E402

_rng = random.Random(0)
SOURCES = [
    " ".join(f"w{_rng.randrange(EOS_HEAVY_V - 4)}" for _ in range(_rng.randint(1, 20))) for _ in range(40)
]
DEMO = generate(40, seed=77)[0]  # 40 sentences of the demo's synthetic task

EXPORTED = {  # configuration -> the class that holds it
    "post-norm": ({}, "MarianMTModel"),
    "pre-norm": ({"norm": "pre"}, "PegasusForConditionalGeneration"),
    "pre-norm, learned positions": ({"norm": "pre", "positions": "learned"}, "BlenderbotForConditionalGeneration"),
    "two vocabularies, tied output": ({"share_embeddings": False, "src_vocab_size": 30}, "MarianMTModel"),
    "two vocabularies, untied output": (
        {"share_embeddings": False, "tie_output": False, "src_vocab_size": 70},
        "MarianMTModel",
    ),
    # what an imported OPUS-MT model holds: swish (or gelu) and an output bias
    "swish, output bias": ({"activation": "swish", "output_bias": True}, "MarianMTModel"),
    "gelu, output bias, two vocabularies": (
        {"activation": "gelu", "output_bias": True, "share_embeddings": False, "src_vocab_size": 70},
        "MarianMTModel",
    ),
}  # fmt: skip


def random_model(**changes) -> Transformer:
    """A tiny model with random weights, LayerNorm gains and biases far from 1 and 0 (so that a feature
    put in the wrong place shows), an output bias (if any) far from 0, vocabulary 50 (target) unless changed."""
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(preset("tiny", vocab_size=50), **changes)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.7 if name.endswith("weight") else 0.0, 0.3)
            elif name == "generator.bias":
                p.normal_(0.0, 2.0)
    return model


def padded_batch(model: Transformer) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    src = torch.randint(4, model.config.src_vocab_size, (3, 9), generator=generator)
    src[:, -1] = EOS_ID
    src[1, 5:], src[2, 3:] = torch.tensor([EOS_ID, 0, 0, 0]), torch.tensor([EOS_ID] + [PAD_ID] * 5)
    tgt_in = torch.randint(4, model.config.tgt_vocab_size, (3, 6), generator=generator)
    tgt_in[:, 0] = 1
    return src, tgt_in


@pytest.mark.parametrize("name", EXPORTED)
def test_the_export_loads_without_warnings_and_computes_aiayns_log_probabilities(name, tmp_path):
    changes, class_name = EXPORTED[name]
    model = random_model(**changes)
    config = model.config
    save_model(tmp_path / "model", model, word_tokenizer(config.src_vocab_size, config.tgt_vocab_size))
    export_transformers(tmp_path / "model", tmp_path / "hf")

    hf, info = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert type(hf).__name__ == class_name
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    src, tgt_in = padded_batch(model)
    with torch.no_grad():
        want = model(src, tgt_in).log_softmax(-1)
        logits = hf.eval()(input_ids=src, attention_mask=src.ne(PAD_ID), decoder_input_ids=tgt_in).logits
    got = logits.log_softmax(-1)
    torch.testing.assert_close(got[..., : config.tgt_vocab_size], want, atol=1e-4, rtol=0)
    assert (got[..., config.tgt_vocab_size :] == -math.inf).all()  # a padded vocabulary's ids: never chosen
    assert json.loads((tmp_path / "hf" / AIAYN_CONFIG).read_text()) == dataclasses.asdict(config)
    assert (tmp_path / "hf" / TARGET_TOKENIZER).is_dir() == (not config.share_embeddings)


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"positions": "learned"}, "post-norm model with learned positions"),
        (
            {"norm": "pre", "share_embeddings": False, "src_vocab_size": 30},
            "pre-norm model with two vocabularies",
        ),
    ],
)
def test_a_configuration_no_transformers_class_holds_is_refused_with_its_reason(changes, reason, tmp_path):
    model = random_model(**changes)
    save_model(
        tmp_path / "model", model, word_tokenizer(model.config.src_vocab_size, model.config.tgt_vocab_size)
    )
    with pytest.raises(ValueError, match=reason):
        export_transformers(tmp_path / "model", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_marians_sinusoids_are_aiayns_with_the_residual_features_permuted():
    """transformers computes its own table at load ([sin | cos] halves); the export's permutation P
    makes it the paper's interleaved table (§3.5, model.sinusoids), column P[j] in place j."""
    config = transformers.MarianConfig(d_model=64, max_position_embeddings=300)
    marian = transformers.MarianMTModel(config)
    table = marian.model.encoder.embed_positions.weight
    P = residual_permutation(preset("tiny", vocab_size=50))
    assert sorted(P.tolist()) == list(range(64))
    torch.testing.assert_close(table, sinusoids(300, 64)[:, P], atol=2e-6, rtol=0)


# --- A trained model: search, the pipeline and ONNX Runtime ---------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(model directory, its transformers export, aiayn's Translator, the transformers model, tokenizer):
    the eos_heavy_model of two layers a side (which takes both its stacks' loops through the export),
    whose outputs end after 0 to 29 tokens, with a word vocabulary."""
    root = tmp_path_factory.mktemp("hf")
    save_model(root / "model", eos_heavy_model(layers=2), word_tokenizer(EOS_HEAVY_V, EOS_HEAVY_V))
    export_transformers(root / "model", root / "hf")
    out = root / "hf"
    ours = Translator.load(root / "model", dtype="fp32", device="cpu")
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    return root / "model", out, ours, hf, tokenizer


def generated(hf, tokenizer, texts: list[str], search: SearchConfig) -> list[list[int]]:
    """transformers' generate on a padded batch of texts with aiayn's search settings (average length
    penalty, its stopping, aiayn's output limit): each output's ids after the start token, without EOS."""
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    limit = max(search.max_length(n) for n in batch["attention_mask"].sum(1).tolist())
    stopping = True if search.stopping == "beam" else "never"
    beams = dict(num_beams=search.beam_size, length_penalty=search.alpha, early_stopping=stopping)
    with torch.no_grad():
        out = hf.generate(
            **batch, **(beams if search.beam_size > 1 else {"num_beams": 1}), max_new_tokens=limit
        )
    rows = [row[1:].tolist() for row in out]
    return [row[: row.index(EOS_ID)] if EOS_ID in row else row for row in rows]


def ours_ids(translator: Translator, texts: list[str], search: SearchConfig) -> list[list[int]]:
    ids = translator.tokenizer.encode_src(texts)
    return [hyps[0].tokens for hyps in translator.translate_ids(ids, search)]


def test_the_tokenizer_encodes_as_aiayn_does(exported):
    _, _, ours, _, tokenizer = exported
    assert [tokenizer(text)["input_ids"] for text in SOURCES] == ours.tokenizer.encode_src(SOURCES)
    assert tokenizer("a </s> b")["input_ids"] == ours.tokenizer.encode_src(["a </s> b"])[0]  # text, not EOS


# transformers takes one output limit a batch (max_new_tokens), aiayn one a sentence (a * source + b): with
# a = 0 they are the same, and this briefly trained model runs some outputs into it
GREEDY = SearchConfig(beam_size=1, max_len_a=0, max_len_b=30)
BEAM = SearchConfig(beam_size=4, alpha=0.6, length_penalty="average", max_len_a=0, max_len_b=30)
BEAM_EXACT = dataclasses.replace(BEAM, stopping="exact")


@pytest.mark.parametrize("search", [GREEDY, BEAM, BEAM_EXACT], ids=["greedy", "beam 4", "beam 4 exact"])
def test_generate_gives_aiayns_tokens(exported, search):
    _, _, ours, hf, tokenizer = exported
    want = ours_ids(ours, SOURCES, search)
    lengths = {len(tokens) for tokens in want}  # outputs of varied lengths, some cut at the limit
    assert len(lengths) >= 4 and min(lengths) < 5 and max(lengths) == 30
    assert generated(hf, tokenizer, SOURCES, search) == want


def test_the_translation_pipeline_writes_what_aiayn_translate_writes(served_model, tmp_path):
    """On the demo's task (the served model, trained on it briefly): greedy, aiayn's output limit."""
    export_transformers(served_model, tmp_path / "hf")
    (tmp_path / "in.txt").write_text("".join(s + "\n" for s in DEMO), encoding="utf-8")
    main(["translate", str(served_model), "--beam-size", "1", "--dtype", "fp32", "--no-compile", "--quiet",
          "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.txt")])  # fmt: skip
    want = (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    got = []
    for text in DEMO:  # one at a time: aiayn's limit is the sentence's own, input tokens + 50
        limit = SearchConfig().max_length(len(tokenizer(text)["input_ids"]))
        if "translation" in transformers.pipelines.SUPPORTED_TASKS:
            translate = transformers.pipeline("translation", model=str(tmp_path / "hf"), device="cpu")
            got += [translate(text, num_beams=1, max_new_tokens=limit)[0]["translation_text"]]
        else:  # transformers 5 removed the task: what it did, spelt out
            hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
            out = hf.generate(**tokenizer([text], return_tensors="pt"), num_beams=1, max_new_tokens=limit)
            got += tokenizer.batch_decode(out, skip_special_tokens=True)
    assert got == want


def test_the_onnx_export_runs_on_onnx_runtime_with_aiayns_tokens(exported, tmp_path):
    pytest.importorskip("optimum.onnxruntime")
    import onnxruntime
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    model_dir, _, ours, hf, tokenizer = exported
    export_onnx(model_dir, tmp_path / "onnx")
    names = {p.name for p in (tmp_path / "onnx").iterdir()}
    assert {"encoder_model.onnx", "decoder_model.onnx", "config.json", "tokenizer.json"} <= names
    ort = ORTModelForSeq2SeqLM.from_pretrained(tmp_path / "onnx")
    assert generated(ort, tokenizer, SOURCES, GREEDY) == ours_ids(ours, SOURCES, GREEDY)

    # plain ONNX Runtime: the encoder's states are transformers' (in the export's feature order)
    session = onnxruntime.InferenceSession(str(tmp_path / "onnx" / "encoder_model.onnx"))
    batch = tokenizer(SOURCES[:4], return_tensors="np", padding=True)
    (states,) = session.run(
        None, {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    )
    with torch.no_grad():
        want = hf.get_encoder()(input_ids=torch.from_numpy(batch["input_ids"]),
                                attention_mask=torch.from_numpy(batch["attention_mask"])).last_hidden_state  # fmt: skip
    torch.testing.assert_close(torch.from_numpy(states), want, atol=1e-4, rtol=0)


def test_a_model_directory_of_an_older_aiayn_still_exports(exported, tmp_path):
    """Older model directories: special ids in config.json, each layer norm in a Residual wrapper
    (encoder.0.res_attn.norm.weight), no search.json (the model is for §6.1's search, beam 4)."""
    import shutil

    model_dir, _, ours, _, _ = exported
    old = shutil.copytree(model_dir, tmp_path / "old")
    config = json.loads((old / CONFIG).read_text())
    (old / CONFIG).write_text(json.dumps({**config, "pad_id": 0, "bos_id": 1, "eos_id": 2}))
    tensors = {}
    for name, tensor in safetensors.torch.load_file(str(old / WEIGHTS)).items():
        if name.startswith("decoder."):
            name = name.replace("self_attn_norm", "res_self.norm")
        tensors[name.replace("self_attn_norm", "res_attn.norm").replace("feed_forward_norm", "res_ff.norm")
                     .replace("cross_attn_norm", "res_cross.norm")] = tensor  # fmt: skip
    safetensors.torch.save_file(tensors, str(old / WEIGHTS))
    (old / SEARCH).unlink(missing_ok=True)
    export_transformers(old, tmp_path / "hf")
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.generation_config.num_beams == 4
    assert hf.generation_config.early_stopping is True  # the default stopping, "beam"
    src, tgt_in = padded_batch(ours.model)
    with torch.no_grad():
        got = hf(input_ids=src, attention_mask=src.ne(PAD_ID), decoder_input_ids=tgt_in).logits.log_softmax(
            -1
        )
        torch.testing.assert_close(got, ours.model(src, tgt_in).log_softmax(-1), atol=1e-4, rtol=0)


def test_the_cli_exports_and_refuses_as_the_other_exports(served_model, tmp_path, capsys, monkeypatch):
    out = tmp_path / "hf"
    assert main(["export", str(served_model), "--format", "transformers", "--out", str(out)]) in (0, None)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {
        "format": "transformers",
        "out": str(out),
    }
    assert main(["export", str(served_model), "--format", "transformers", "--out", str(out)]) == 2
    assert "already exists; use --force" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["export", str(served_model), "--format", "transformers", "--out", str(tmp_path / "x")]) == 2
    assert "pip install 'aiayn[transformers]'" in capsys.readouterr().err
