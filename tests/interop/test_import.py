"""Importing transformers' Marian models (OPUS-MT's architecture): aiayn's model of a MarianMTModel gives
its log-probabilities, the special ids reordered to aiayn's; the export's inverse gives back the export;
what aiayn cannot hold exactly is refused with its reason."""

import dataclasses

import pytest
import torch
from conftest import assert_one_line_error, run_cli

from aiayn.config import preset
from aiayn.interop.huggingface import from_transformers, hf_state_dict, id_order, to_transformers
from aiayn.model import Transformer
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID

transformers = pytest.importorskip("transformers")

V = 60  # OPUS-MT's layout: </s> 0, <unk> 1, pieces, <pad> (the decoder's start) last


def marian(tmp_path, activation="swish", shared=True, dtype=torch.float32, **changes):
    """A MarianMTModel with random weights, LayerNorms and final_logits_bias far from their initial values,
    saved with save_pretrained in dtype and loaded back in float32, as `aiayn import` reads a directory."""
    torch.manual_seed(0)
    config = transformers.MarianConfig(
        vocab_size=V, decoder_vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4, max_position_embeddings=64,
        activation_function=activation, pad_token_id=V - 1, decoder_start_token_id=V - 1, eos_token_id=0,
        share_encoder_decoder_embeddings=shared, tie_word_embeddings=shared, scale_embedding=True, **changes,
    )  # fmt: skip
    hf = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        hf.final_logits_bias.normal_(0.0, 2.0)
        for name, p in hf.named_parameters():
            if "layer_norm" in name:
                p.normal_(0.7 if name.endswith("weight") else 0.0, 0.3)
    hf.to(dtype).save_pretrained(tmp_path / "hf")
    return transformers.MarianMTModel.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()


def test_the_ids_are_reordered_to_aiayns_specials():
    # OPUS-MT's: aiayn's PAD a row of its own, BOS the model's pad (its decoder start), EOS 0, UNK 1
    assert id_order(6, pad=5, start=5, eos=0, unk=1) == [None, 5, 0, 1, 2, 3, 4]
    # aiayn's own export: nothing moves, so export -> import is the identity
    assert id_order(6, pad=PAD_ID, start=BOS_ID, eos=EOS_ID, unk=UNK_ID) == list(range(6))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        id_order(6, pad=6, start=6, eos=0, unk=1)
    with pytest.raises(ValueError, match="must be other ids"):
        id_order(6, pad=5, start=5, eos=1, unk=1)


@pytest.mark.parametrize(
    ("activation", "shared", "dtype"),
    [("swish", True, torch.float32), ("relu", False, torch.float32), ("swish", False, torch.float16),
     ("gelu", True, torch.float16)],
    ids=["swish", "relu, two vocabularies", "swish, two vocabularies, fp16", "gelu, fp16"],
)  # fmt: skip
def test_the_imported_model_gives_marians_log_probabilities_on_a_padded_batch(
    tmp_path, activation, shared, dtype
):
    hf = marian(tmp_path, activation, shared, dtype)
    model, src_order, tgt_order = from_transformers(hf)
    config = model.config
    assert (config.activation, config.output_bias, config.share_embeddings) == (activation, True, shared)
    assert config.src_vocab_size == config.tgt_vocab_size == V + 1  # aiayn's PAD added
    # a padded batch in Marian's ids: two sentences, the second padded with Marian's pad
    generator = torch.Generator().manual_seed(3)
    src = torch.randint(2, V - 1, (2, 9), generator=generator)
    src[:, -1], src[1, 5:] = 0, torch.tensor([0, V - 1, V - 1, V - 1])
    tgt_in = torch.randint(2, V - 1, (2, 6), generator=generator)
    tgt_in[:, 0] = V - 1  # Marian decodes from its pad
    ours_of = {j: i for i, j in enumerate(src_order) if j is not None}
    ours_of[V - 1] = PAD_ID  # the source's padding: aiayn's PAD
    ours_src = torch.tensor([[ours_of[int(j)] for j in row] for row in src])
    tgt_of = {j: i for i, j in enumerate(tgt_order) if j is not None}
    ours_tgt = torch.tensor([[tgt_of[int(j)] for j in row] for row in tgt_in])
    assert (ours_tgt[:, 0] == BOS_ID).all() and (ours_src[1, 6:] == PAD_ID).all()
    with torch.no_grad():
        want = hf(input_ids=src, attention_mask=src.ne(V - 1), decoder_input_ids=tgt_in).logits.log_softmax(
            -1
        )
        got = model(ours_src, ours_tgt).log_softmax(-1)
    torch.testing.assert_close(got[..., [tgt_of[j] for j in range(V)]], want, atol=1e-4, rtol=0)
    assert torch.isneginf(got[..., PAD_ID]).all()  # aiayn's own PAD row: never predicted


def test_an_imported_model_exports_again_with_its_log_probabilities(tmp_path):
    """An OPUS-MT-shaped model imported, then exported to transformers: the export checks its log-probabilities
    against the imported model's (its own PAD row, never predicted, included), which are Marian's."""
    model, _, _ = from_transformers(marian(tmp_path))
    again = to_transformers(model)  # raises unless the log-probabilities agree
    assert again.config.activation_function == "swish" and torch.isneginf(again.final_logits_bias[0, PAD_ID])


def test_export_then_import_gives_back_the_export():
    """aiayn -> transformers -> aiayn -> transformers: the same weights each way (the ids do not move)."""
    torch.manual_seed(0)
    original = Transformer(dataclasses.replace(preset("tiny", vocab_size=50), activation="swish")).eval()
    exported = to_transformers(original)
    imported, src_order, _ = from_transformers(exported, unk_id=UNK_ID)
    assert src_order == list(range(50))
    first, second = hf_state_dict(original), hf_state_dict(imported)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize(
    ("changes", "reason"),
    [({"activation_function": "gelu_new"}, "activation_function 'gelu_new'"),
     ({"scale_embedding": False}, "scale_embedding is false"),
     ({"decoder_ffn_dim": 32}, "encoder_ffn_dim=64 and decoder_ffn_dim=32")],
)  # fmt: skip
def test_what_aiayn_cannot_hold_exactly_is_refused_with_its_reason(tmp_path, changes, reason):
    config = marian(tmp_path).config.to_dict()
    config.update(changes)
    hf = transformers.MarianMTModel(transformers.MarianConfig(**config)).eval()
    with pytest.raises(ValueError, match=reason):
        from_transformers(hf)
    pegasus = to_transformers(Transformer(dataclasses.replace(preset("tiny", vocab_size=20), norm="pre")))
    with pytest.raises(ValueError, match="imports Marian models"):
        from_transformers(pegasus)


def test_aiayn_import_makes_a_model_directory_of_an_export_and_refuses_what_it_cannot_read(tmp_path):
    """`aiayn import` of what `aiayn export --format transformers` wrote: a model directory with the model's
    config, weights, vocabulary and search, whose export is the first export again; a damaged or partial
    SOURCE is a one-line error and leaves no OUT."""
    from aiayn.checkpoint import load_model, load_search, save_model
    from aiayn.config import SearchConfig
    from aiayn.tokenizer import Tokenizer

    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(preset("tiny", vocab_size=50), activation="swish")).eval()
    tokenizer = Tokenizer.train([" ".join(f"w{i}" for i in range(46))], [" ".join(f"w{i}" for i in range(46))],
                                vocab_size=50, kind="word", min_frequency=1)  # fmt: skip
    save_model(
        tmp_path / "model", model, tokenizer, SearchConfig(beam_size=5, alpha=1.0, length_penalty="average")
    )
    assert (
        run_cli(["export", tmp_path / "model", "--format", "transformers", "--out", tmp_path / "hf"])[0] == 0
    )
    code, out, err = run_cli(["import", tmp_path / "hf", "--out", tmp_path / "back"])
    assert code == 0, err
    back = load_model(tmp_path / "back")
    assert back.config == model.config  # no output bias: the export's is zero
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert Tokenizer.load(tmp_path / "back").encode_src(["w3 w9 w44"]) == tokenizer.encode_src(["w3 w9 w44"])
    search = load_search(tmp_path / "back")
    assert (search.beam_size, search.alpha, search.length_penalty) == (5, 1.0, "average")
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a partial copy
    (tmp_path / "spm").mkdir()
    (tmp_path / "spm" / "config.json").write_text("{}")
    (tmp_path / "spm" / "source.spm").write_bytes(b"")
    for source, needles in (
        (tmp_path / "hf", [str(tmp_path / "hf"), "cannot load it"]),
        (tmp_path / "nothing", [str(tmp_path / "nothing"), "no such directory"]),
        (tmp_path / "spm", [str(tmp_path / "spm"), "no target.spm"]),
    ):
        code, _, err = run_cli(["import", source, "--out", tmp_path / "refused"])
        assert_one_line_error(code, err, *needles)
        assert not (tmp_path / "refused").exists()


def test_an_imported_model_trains_with_a_finite_loss(tmp_path):
    """Fine-tuning an OPUS-MT-shaped import: its own PAD row (output bias -inf) is the one class it can
    never produce, which label smoothing leaves out, so an update's loss is finite and the row stays -inf."""
    from aiayn.config import TrainConfig
    from aiayn.training.train import make_optimizer, never_produced, train_step

    model, _, _ = from_transformers(marian(tmp_path))
    assert never_produced(model).nonzero().flatten().tolist() == [PAD_ID]
    cfg = TrainConfig(dtype="fp32")
    tgt = torch.randint(4, V, (2, 6))
    tgt_in, tgt_out = (
        torch.cat([torch.full((2, 1), BOS_ID), tgt], 1),
        torch.cat([tgt, torch.full((2, 1), EOS_ID)], 1),
    )
    loss, tokens = train_step(model.train(), make_optimizer(model, cfg), [[torch.randint(4, V, (2, 5)), tgt_in, tgt_out]], 1e-3, cfg)  # fmt: skip
    assert tokens == 14 and torch.isfinite(torch.tensor(loss))
    assert torch.isneginf(model.generator.bias[PAD_ID]) and torch.isfinite(model.generator.bias[1:]).all()


def test_opus_mt_names_give_the_languages_groups_do_not():
    from aiayn.interop.huggingface import opus_mt_name

    assert opus_mt_name("opus-mt-de-en") == (("de",), ("en",))
    assert opus_mt_name("opus-mt-tc-big-en-fr") == (("en",), ("fr",))
    assert opus_mt_name("opus-mt-en-pt_br") == (("en",), ("pt_br",))
    assert opus_mt_name("opus-mt-en-ROMANCE") == (("en",), ())  # a group, not a language
    assert opus_mt_name("opus-mt-mul-en") == ((), ("en",))
    assert opus_mt_name("opus-mt-tc-big-zle-en") == ((), ("en",))  # ISO 639-5's East Slavic
    assert opus_mt_name("my-model") == ((), ())


def test_aiayn_import_takes_the_languages_from_the_flags_the_name_or_an_aiayn_export(tmp_path):
    """A directory named opus-mt-en-de is en -> de, one named otherwise has no languages.json (and a line
    says how to give them), --src-lang and --tgt-lang win over the name, and an aiayn export of a model
    with languages brings them back."""
    import shutil

    from aiayn.checkpoint import LANGUAGES, Languages, ModelDir, save_model
    from aiayn.tokenizer import Tokenizer

    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=50)).eval()
    words = [" ".join(f"w{i}" for i in range(46))]
    tokenizer = Tokenizer.train(words, words, vocab_size=50, kind="word", min_frequency=1)
    save_model(tmp_path / "model", model, tokenizer, languages=Languages(("xx",), ("en", "fr")))
    code, _, err = run_cli(
        ["export", tmp_path / "model", "--format", "transformers", "--out", tmp_path / "hf"]
    )
    assert code == 0, err
    assert (tmp_path / "hf" / LANGUAGES).is_file()
    code, _, err = run_cli(["import", tmp_path / "hf", "--out", tmp_path / "back"])
    assert code == 0, err
    assert ModelDir.read(tmp_path / "back").languages == Languages(("xx",), ("en", "fr"))
    (tmp_path / "hf" / LANGUAGES).unlink()
    shutil.copytree(tmp_path / "hf", tmp_path / "opus-mt-en-de")
    for source, flags, expected in (
        ("hf", [], None),
        ("opus-mt-en-de", [], Languages(("en",), ("de",))),
        ("opus-mt-en-de", ["--src-lang", "de", "--tgt-lang", "en"], Languages(("de",), ("en",))),
        ("opus-mt-en-de", ["--tgt-lang", "fr,it"], Languages(("en",), ("fr", "it"))),
        ("hf", ["--src-lang", "de", "--tgt-lang", "en"], Languages(("de",), ("en",))),
    ):
        out = tmp_path / "imports" / f"{source}{''.join(flags)}"
        code, _, err = run_cli(["import", tmp_path / source, "--out", out, *flags])
        assert code == 0, err
        assert ModelDir.read(out).languages == expected, (source, flags)
        assert (out / LANGUAGES).is_file() == (expected is not None)
        unknown = f"aiayn: the languages of {source} are unknown, so {out} records none"
        assert (unknown in err) == (expected is None), err
    code, _, err = run_cli(["import", tmp_path / "hf", "--out", tmp_path / "refused", "--src-lang", "en,EN"])
    assert_one_line_error(code, err, "--src-lang en,EN", "'EN' is not a language code")
    assert not (tmp_path / "refused").exists()
