"""Tests for aiayn.checkpoint: save -> load gives identical logits and keeps ties, averaging is the mean,
writes are atomic, and every way a model directory can be broken is a ValueError naming it."""

import json
import os
import re
import subprocess
import sys

import pytest
import safetensors.torch
import torch

from aiayn import checkpoint
from aiayn.config import ModelConfig, SearchConfig, TrainConfig, preset
from aiayn.data.synthetic import generate
from aiayn.inference.translate import Translator
from aiayn.model import Transformer
from aiayn.tokenizer import PAD_ID, Tokenizer

SRC, TGT = generate(80, seed=1)


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Tokenizer]:
    return {
        "joint": Tokenizer.train(SRC, TGT, vocab_size=300),
        "separate": Tokenizer.train(SRC, TGT, vocab_size=290, joint=False),
    }


# (tokenizer, share_embeddings, tie_output): §3.4 all three matrices shared, two tied, none tied
LAYOUTS = [("joint", True, True), ("separate", False, True), ("separate", False, False)]


def make_model(tokenizer: Tokenizer, share: bool, tie: bool, seed: int = 0) -> Transformer:
    """A tiny model whose weights are all moved away from their initial values (pad rows included)."""
    torch.manual_seed(seed)
    config = preset(
        "tiny",
        src_vocab_size=tokenizer.src_vocab_size,
        tgt_vocab_size=tokenizer.tgt_vocab_size,
        share_embeddings=share,
        tie_output=tie,
        d_model=32,
        d_ff=64,
        dropout=0.1,
    )
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def batch(tokenizer: Tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded (src, tgt_in) pair of batches from real sentences of different lengths."""
    src_ids, tgt_ids = tokenizer.encode_src(SRC[:4]), tokenizer.encode_tgt(TGT[:4])
    S, T = max(map(len, src_ids)), max(map(len, tgt_ids))
    src = torch.tensor([s + [PAD_ID] * (S - len(s)) for s in src_ids])  # (B, S)
    tgt_in = torch.tensor([[1, *t[:-1]] + [PAD_ID] * (T - len(t)) for t in tgt_ids])  # (B, T)
    return src, tgt_in


def assert_ties(model: Transformer, share: bool, tie: bool) -> None:
    assert (model.generator.weight is model.tgt_embed.tokens.weight) == tie
    assert (model.src_embed is model.tgt_embed) == share
    if not tie:
        assert not torch.equal(model.generator.weight, model.tgt_embed.tokens.weight)


# --- save -> load ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=["shared", "separate-tied", "separate-untied"])
def test_save_load_gives_identical_logits_and_keeps_ties(tokenizers, tmp_path, layout):
    name, share, tie = layout
    tokenizer = tokenizers[name]
    model = make_model(tokenizer, share, tie)
    src, tgt_in = batch(tokenizer)
    with torch.no_grad():
        want = model(src, tgt_in)  # (B, T, V)
    checkpoint.save_model(tmp_path, model, tokenizer)

    loaded = checkpoint.load_model(tmp_path)
    assert not loaded.training
    assert loaded.config == model.config
    assert_ties(loaded, share, tie)
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    with torch.no_grad():
        assert torch.equal(loaded(src, tgt_in), want)

    translator = Translator.load(tmp_path, device="cpu")
    assert translator.tokenizer.joint == tokenizer.joint
    assert_ties(translator.model, share, tie)
    with torch.no_grad():
        assert torch.equal(translator.model(src, tgt_in), want)
    texts = SRC[10:13]
    assert translator.translate(texts, beam_size=2) == Translator(model, tokenizer).translate(
        texts, beam_size=2
    )


def test_tied_matrix_is_stored_once(tokenizers, tmp_path):
    model = make_model(tokenizers["joint"], True, True)
    checkpoint.save_model(tmp_path, model, tokenizers["joint"])
    stored = safetensors.torch.load_file(str(tmp_path / checkpoint.WEIGHTS))
    embedding_like = [n for n, t in stored.items() if t.shape == model.generator.weight.shape]
    assert len(embedding_like) == 1


def test_saved_files_are_readable_by_others(tokenizers, tmp_path):
    """A model directory is meant to be shared (like the tokenizer files): not private mkstemp modes."""
    tokenizer = tokenizers["joint"]
    model = make_model(tokenizer, True, True)
    step = checkpoint.save_checkpoint(tmp_path, 3, model, tokenizer, TrainConfig(), {"x": torch.ones(1)})
    checkpoint.save_model(tmp_path / "model", model, tokenizer)
    for path in [step, *step.iterdir(), *(tmp_path / "model").iterdir()]:
        mode = path.stat().st_mode
        assert mode & 0o044 == 0o044, (path, oct(mode))


# --- averaging (§6.1) --------------------------------------------------------------------------------


def set_weights(model: Transformer, make) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(make(p))


def test_average_checkpoints_of_hand_set_weights_is_their_mean(tokenizers, tmp_path):
    tokenizer = tokenizers["separate"]
    a, b = make_model(tokenizer, False, False), make_model(tokenizer, False, False)
    set_weights(a, lambda p: torch.full_like(p, 1.0))
    set_weights(b, lambda p: torch.full_like(p, 4.0))
    checkpoint.save_model(tmp_path / "a", a, tokenizer)
    checkpoint.save_model(tmp_path / "b", b, tokenizer)
    averaged = checkpoint.average_checkpoints([tmp_path / "a", tmp_path / "b"])
    assert averaged.keys() == dict(a.named_parameters()).keys()
    for name, tensor in averaged.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, torch.full_like(tensor, 2.5)), name


def test_average_checkpoints_of_random_weights(tokenizers, tmp_path):
    tokenizer = tokenizers["joint"]
    models = [make_model(tokenizer, True, True, seed=s) for s in (1, 2, 3)]
    for i, model in enumerate(models):
        checkpoint.save_model(tmp_path / str(i), model, tokenizer)
    averaged = checkpoint.average_checkpoints([tmp_path / str(i) for i in range(3)])
    states = [m.state_dict() for m in models]  # every name of a tied matrix
    for name, tensor in averaged.items():
        want = sum(s[name].detach().double() for s in states) / 3
        torch.testing.assert_close(tensor.double(), want, rtol=0, atol=1e-7)
    one = checkpoint.average_checkpoints([tmp_path / "1"])
    assert all(torch.equal(one[n], states[1][n]) for n in one)


def test_average_last_checkpoints_of_a_run(tokenizers, tmp_path):
    """`aiayn average`: the last N of OUT/checkpoints, by step, into a loadable model that is still tied."""
    tokenizer = tokenizers["joint"]
    models = {step: make_model(tokenizer, True, True, seed=step) for step in (2, 10, 30)}
    for step in (10, 2, 30):  # written out of order: the step, not the write time, decides
        checkpoint.save_checkpoint(tmp_path, step, models[step], tokenizer, TrainConfig(), {})
    dest = checkpoint.average(tmp_path, 2, tmp_path / "avg")
    averaged = checkpoint.load_model(dest)
    assert_ties(averaged, True, True)
    for name, p in averaged.named_parameters():
        want = (dict(models[10].named_parameters())[name] + dict(models[30].named_parameters())[name]) / 2
        torch.testing.assert_close(p, want, rtol=0, atol=1e-6)
    assert Tokenizer.load(dest).src_vocab_size == tokenizer.src_vocab_size
    assert checkpoint.load_search(dest) == SearchConfig()  # the run's: TrainConfig's default, §6.1's
    recipe = TrainConfig(search=SearchConfig(beam_size=5, alpha=1.0, length_penalty="average"))
    checkpoint.save_checkpoint(tmp_path, 40, models[30], tokenizer, recipe, {})
    dest = checkpoint.average(tmp_path, 2, tmp_path / "avg2")
    assert checkpoint.load_search(dest) == recipe.search  # the newest checkpoint's search travels along

    with pytest.raises(ValueError, match="found 4"):
        checkpoint.average(tmp_path, 5, tmp_path / "too_many")
    for last in (0, -1):  # checkpoints[-0:] would silently average them all
        with pytest.raises(ValueError, match="at least 1"):
            checkpoint.average(tmp_path, last, tmp_path / "none")


def test_average_refuses_different_configs(tokenizers, tmp_path):
    tokenizer = tokenizers["separate"]
    checkpoint.save_model(tmp_path / "a", make_model(tokenizer, False, True), tokenizer)
    checkpoint.save_model(tmp_path / "b", make_model(tokenizer, False, False), tokenizer)
    with pytest.raises(ValueError, match="different configs"):
        checkpoint.average_checkpoints([tmp_path / "a", tmp_path / "b"])
    with pytest.raises(ValueError, match="no checkpoints"):
        checkpoint.average_checkpoints([])


# --- atomic writes and checkpoint listing -------------------------------------------------------------


def test_atomic_write_replaces_the_file(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("old")
    checkpoint.atomic_write(path, lambda p: p.write_text("new"))
    assert path.read_text() == "new"
    assert os.listdir(tmp_path) == ["f.txt"]


@pytest.mark.parametrize("partial", [False, True])
def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path, partial):
    path = tmp_path / "f.txt"
    path.write_text("old")

    def failing(p):
        if partial:
            p.write_text("half of the ne")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.atomic_write(path, failing)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.txt"]  # no temporary file left behind

    with pytest.raises(RuntimeError):
        checkpoint.atomic_write(tmp_path / "new.txt", failing)
    assert os.listdir(tmp_path) == ["f.txt"]  # and no half-written new file


def state(**progress) -> dict:
    """A training state of the shape load_state accepts."""
    return {"optimizer": {}, "progress": progress, "rng": {}}


def test_list_checkpoints_sorts_by_step_and_ignores_leftovers(tokenizers, tmp_path):
    tokenizer = tokenizers["joint"]
    model = make_model(tokenizer, True, True)
    assert checkpoint.list_checkpoints(tmp_path) == []
    for step in (100, 9, 20):
        checkpoint.save_checkpoint(tmp_path, step, model, tokenizer, TrainConfig(), state(step=step))
    root = tmp_path / checkpoint.CHECKPOINTS
    (root / ".step_00000200.k3j2.tmp").mkdir()  # an interrupted save
    (root / ".step_00000200.k3j2.tmp" / checkpoint.CONFIG).write_text("{")
    (root / "notes.txt").write_text("not a checkpoint")
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "step_00000009",
        "step_00000020",
        "step_00000100",
    ]
    assert checkpoint.load_state(root / "step_00000020")["progress"] == {"step": 20}
    assert (root / "step_00000020" / checkpoint.TRAIN_CONFIG).is_file()


def test_save_checkpoint_overwrites_the_same_step_and_leaves_no_temporaries(tokenizers, tmp_path):
    tokenizer = tokenizers["joint"]
    checkpoint.save_checkpoint(
        tmp_path, 5, make_model(tokenizer, True, True, seed=1), tokenizer, TrainConfig(), state(v=1)
    )
    model = make_model(tokenizer, True, True, seed=2)
    checkpoint.save_checkpoint(tmp_path, 5, model, tokenizer, TrainConfig(), state(v=2))
    root = tmp_path / checkpoint.CHECKPOINTS
    assert os.listdir(root) == ["step_00000005"]
    assert checkpoint.load_state(root / "step_00000005")["progress"] == {"v": 2}
    loaded = checkpoint.load_model(root / "step_00000005")
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), model.parameters()))


def test_prune_checkpoints_keeps_the_newest_and_the_protected_ones(tokenizers, tmp_path):
    tokenizer = tokenizers["joint"]
    model = make_model(tokenizer, True, True)
    for step in range(1, 7):
        checkpoint.save_checkpoint(tmp_path, step, model, tokenizer, TrainConfig(), {})
    root = tmp_path / checkpoint.CHECKPOINTS
    checkpoint.prune_checkpoints(tmp_path, 2, keep=[root / "step_00000001", root / "step_00000003"])
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "step_00000001",
        "step_00000003",
        "step_00000005",
        "step_00000006",
    ]
    checkpoint.prune_checkpoints(tmp_path, 1)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000006"]


# --- load errors -------------------------------------------------------------------------------------


@pytest.fixture
def saved(tokenizers, tmp_path):
    directory = tmp_path / "model"
    checkpoint.save_model(directory, make_model(tokenizers["joint"], True, True), tokenizers["joint"])
    return directory


def test_search_json_round_trips_defaults_to_the_papers_and_never_outlives_its_model(saved, tokenizers):
    assert not (saved / checkpoint.SEARCH).exists() and checkpoint.load_search(saved) == SearchConfig()
    model, tokenizer = checkpoint.load_model(saved), tokenizers["joint"]
    search = SearchConfig(beam_size=6, alpha=1.2, length_penalty="average", max_len_b=20)
    checkpoint.save_model(saved, model, tokenizer, search)
    assert checkpoint.load_search(saved) == search
    assert Translator.load(saved, device="cpu").search_config == search
    assert Translator.load(saved, SearchConfig(beam_size=2), device="cpu").search_config.beam_size == 2
    checkpoint.save_model(saved, model, tokenizer)  # a model saved without one: the old one goes
    assert not (saved / checkpoint.SEARCH).exists()
    (saved / checkpoint.SEARCH).write_text(json.dumps({"beam_size": 4, "alpha": -1.0}))
    with pytest.raises(ValueError, match=re.escape(str(saved / checkpoint.SEARCH))):
        checkpoint.load_search(saved)


def test_languages_json_round_trips_and_never_outlives_its_model(saved, tokenizers):
    """languages.json holds what save_model was given, ModelDir.read gives it back, and a directory saved
    without languages (or made before they were kept) has none: None, and no file left behind."""
    model, tokenizer = checkpoint.load_model(saved), tokenizers["joint"]
    assert not (saved / checkpoint.LANGUAGES).exists() and checkpoint.ModelDir.read(saved).languages is None
    multilingual = checkpoint.Languages(("en",), ("de", "pt_br", "zh_Hant"),
                                        {"de": ">>de<<", "pt_br": ">>pt_br<<", "zh_Hant": ">>zh_Hant<<"})  # fmt: skip
    checkpoint.save_model(saved, model, tokenizer, languages=multilingual)
    assert json.loads((saved / checkpoint.LANGUAGES).read_text()) == {
        "source": ["en"],
        "target": ["de", "pt_br", "zh_Hant"],
        "tags": {"de": ">>de<<", "pt_br": ">>pt_br<<", "zh_Hant": ">>zh_Hant<<"},
    }
    read = checkpoint.ModelDir.read(saved).languages
    assert read == multilingual and hash(read) == hash(multilingual)
    assert read.pairs() == (("en", "de"), ("en", "pt_br"), ("en", "zh_Hant"))
    assert read.prefix("pt_br") == ">>pt_br<< "
    with pytest.raises(ValueError, match=r"^fr: not a language the model writes \(it translates en -> de, "):
        read.prefix("fr")
    with pytest.raises(TypeError):
        read.tags["fr"] = ">>fr<<"  # frozen, as the dataclass is
    checkpoint.save_model(saved, model, tokenizer)  # a model saved without them: the old file goes
    assert not (saved / checkpoint.LANGUAGES).exists() and checkpoint.ModelDir.read(saved).languages is None


def test_a_model_without_tags_has_no_prefix_and_serves_its_pairs():
    languages = checkpoint.Languages(("de", "en"), ("en",), {})
    assert languages.pairs() == (("de", "en"),)  # (en -> en is no translation)
    assert languages.prefix("en") == ""
    with pytest.raises(ValueError, match="^de: not a language the model writes"):
        languages.prefix("de")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{", "not valid JSON"),
        ('["en"]', "expected a JSON object"),
        ('{"source": ["en"], "target": ["de"]}', "expected source and target"),
        ('{"source": "en", "target": ["de"], "tags": {}}', "expected source and target"),
        ('{"source": ["EN"], "target": ["de"], "tags": {}}', "source 'EN' is not a language code"),
        ('{"source": ["en"], "target": ["german"], "tags": {}}', "target 'german' is not a language code"),
        ('{"source": [], "target": ["de"], "tags": {}}', "no source language"),
        ('{"source": ["en"], "target": ["de", "fr"], "tags": {"de": ">>de<<"}}', "must name each target"),
        ('{"source": ["en"], "target": ["de"], "tags": {"de": ">> de <<"}}', "must be one token"),
    ],
)
def test_a_damaged_languages_json_is_an_error_naming_it(saved, text, needle):
    (saved / checkpoint.LANGUAGES).write_text(text)
    with pytest.raises(
        ValueError, match=re.escape(str(saved / checkpoint.LANGUAGES)) + ".*" + re.escape(needle)
    ):
        checkpoint.ModelDir.read(saved)


def test_averaging_keeps_the_languages_of_the_checkpoints(tokenizers, tmp_path):
    tokenizer, languages = tokenizers["joint"], checkpoint.Languages(("en",), ("xx",), {})
    for step in (1, 2):
        model = make_model(tokenizer, True, True, seed=step)
        checkpoint.save_checkpoint(tmp_path / "run", step, model, tokenizer, TrainConfig(), {}, languages)
    checkpoint.average(tmp_path / "run", 2, tmp_path / "averaged")
    assert checkpoint.ModelDir.read(tmp_path / "averaged").languages == languages


def test_a_model_directory_is_read_once_where_its_use_begins(saved, tokenizers):
    """ModelDir.read holds what the directory says (the configuration, tokenizer and search that were
    saved) and its model has the saved weights; what is given a ModelDir reads none of that again: with
    the directory's config, search and tokenizer files gone after the read, a translator still loads from
    it, with the search it held, and translates as one loaded from the whole directory."""
    tokenizer = tokenizers["joint"]
    search = SearchConfig(beam_size=2, alpha=1.0, length_penalty="average", max_len_b=8)
    saved_model = checkpoint.load_model(saved)
    checkpoint.save_model(saved, saved_model, tokenizer, search)
    model_dir = checkpoint.ModelDir.read(saved)
    assert checkpoint.ModelDir.read(model_dir) is model_dir
    assert (model_dir.path, model_dir.config, model_dir.search) == (saved, saved_model.config, search)
    assert model_dir.tokenizer.files() == tokenizer.files()
    for name, tensor in model_dir.model().state_dict().items():
        assert torch.equal(tensor, saved_model.state_dict()[name]), name
    whole = Translator.load(saved, device="cpu").translate(SRC[:3])
    for name in [checkpoint.CONFIG, checkpoint.SEARCH, *tokenizer.files()]:
        (saved / name).unlink()
    translator = Translator.load(model_dir, device="cpu")
    assert translator.search_config == search and translator.translate(SRC[:3]) == whole
    with pytest.raises(ValueError, match=re.escape(f"{saved}: not a model directory")):
        checkpoint.ModelDir.read(saved)


def test_load_missing_directory(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'nope'}: not a directory")):
        checkpoint.load_model(tmp_path / "nope")


def test_load_directory_without_config(saved):
    (saved / checkpoint.CONFIG).unlink()
    with pytest.raises(ValueError, match=re.escape(f"{saved}: not a model directory")):
        checkpoint.load_model(saved)
    with pytest.raises(ValueError, match=re.escape(str(saved))):
        Translator.load(saved, device="cpu")


@pytest.mark.parametrize("keep", [0, 7, 0.5])
def test_load_truncated_weights(saved, keep):
    path = saved / checkpoint.WEIGHTS
    data = path.read_bytes()
    path.write_bytes(data[: int(keep * len(data)) if isinstance(keep, float) else keep])
    with pytest.raises(ValueError, match=re.escape(f"{path}: cannot read model weights")):
        checkpoint.load_model(saved)


def test_load_missing_weights(saved):
    (saved / checkpoint.WEIGHTS).unlink()
    with pytest.raises(ValueError, match=re.escape(f"{saved / checkpoint.WEIGHTS}: no such file")):
        checkpoint.load_model(saved)


def test_load_weights_of_another_config(saved, tokenizers):
    bigger = Transformer(preset("tiny", vocab_size=tokenizers["joint"].src_vocab_size))  # d_model 64, not 32
    safetensors.torch.save_model(bigger, str(saved / checkpoint.WEIGHTS))
    with pytest.raises(ValueError, match=re.escape(str(saved / checkpoint.WEIGHTS))):
        checkpoint.load_model(saved)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: {**c, "d_modle": 32}, "unknown ModelConfig key"),  # a typo is never ignored
        (lambda c: {**c, "d_model": "32"}, "d_model: expected an integer"),
        (lambda c: {**c, "share_embeddings": "yes"}, "share_embeddings: expected true or false"),
        (lambda c: {**c, "norm": "middle"}, "norm: expected one of"),
        (lambda c: [c], "expected a JSON object"),
    ],
)
def test_load_bad_config(saved, edit, message):
    path = saved / checkpoint.CONFIG
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(ValueError, match=message):
        checkpoint.load_model(saved)


def test_load_config_that_is_not_json(saved):
    (saved / checkpoint.CONFIG).write_text('{"d_model": 32,')
    with pytest.raises(ValueError, match=re.escape(f"{saved / checkpoint.CONFIG}: not valid JSON")):
        checkpoint.load_model_config(saved)


def test_load_state_errors(saved):
    with pytest.raises(ValueError, match="not a training checkpoint"):
        checkpoint.load_state(saved)
    (saved / checkpoint.STATE).write_bytes(b"PK\x03\x04 truncated zip")
    with pytest.raises(
        ValueError, match=re.escape(f"{saved / checkpoint.STATE}: cannot read training state")
    ):
        checkpoint.load_state(saved)


def test_saved_config_rebuilds_the_same_model(saved):
    config = checkpoint.load_model_config(saved)
    assert isinstance(config, ModelConfig)
    assert json.loads((saved / checkpoint.CONFIG).read_text())["d_model"] == config.d_model == 32


def test_a_model_directory_of_an_earlier_version_still_loads(saved):
    """Older model directories: config.json held the special ids and each layer norm sat in a Residual wrapper
    (encoder.0.res_attn.norm.weight): such directories load with the same numbers."""
    want = checkpoint.load_model(saved).state_dict()
    config = json.loads((saved / checkpoint.CONFIG).read_text())
    (saved / checkpoint.CONFIG).write_text(json.dumps({**config, "pad_id": 0, "bos_id": 1, "eos_id": 2}))
    old_names = {
        "self_attn_norm": "res_attn.norm",
        "feed_forward_norm": "res_ff.norm",
        "cross_attn_norm": "res_cross.norm",
    }
    tensors = {}
    for name, tensor in safetensors.torch.load_file(str(saved / checkpoint.WEIGHTS)).items():
        if name.startswith("decoder."):
            name = name.replace("self_attn_norm", "res_self.norm")
        for new, old in old_names.items():
            name = name.replace(new, old)
        tensors[name] = tensor
    assert "encoder.0.res_attn.norm.weight" in tensors and "decoder.0.res_self.norm.weight" in tensors
    safetensors.torch.save_file(tensors, str(saved / checkpoint.WEIGHTS))
    got = checkpoint.load_model(saved).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    (saved / checkpoint.CONFIG).write_text(json.dumps({**config, "eos_id": 5}))
    with pytest.raises(ValueError, match="eos_id=5, but the tokenizer's eos_id is 2"):
        checkpoint.load_model(saved)


def test_the_same_weights_give_the_same_file(saved):
    """Written again by another process, byte for byte (safetensors' own list of tied names came out in
    an order that changed from process to process)."""
    again = saved.parent / "again.safetensors"
    code = f"from aiayn import checkpoint; checkpoint.write_weights(checkpoint.load_model({str(saved)!r}), {str(again)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert again.read_bytes() == (saved / checkpoint.WEIGHTS).read_bytes()
