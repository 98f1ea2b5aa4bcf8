"""Configs: the paper's numbers in the presets and defaults, typed fields, loud errors, JSON round trips."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest

from aiayn.config import (
    LOW_RESOURCE_PAIRS,
    RECIPES,
    Choice,
    InferenceOptions,
    ModelConfig,
    SearchConfig,
    TrainConfig,
    choose,
    from_dict,
    load_json,
    parse_overrides,
    preset,
    preset_for_vocabulary,
    save_json,
    split_overrides,
)

# name: (d_model, d_ff, n_heads, n_layers, dropout); base and big from Table 3 of the paper
PRESET_NUMBERS = {
    "tiny": (64, 128, 4, 2, 0.0),
    "small": (256, 1024, 4, 3, 0.1),
    "base": (512, 2048, 8, 6, 0.1),
    "big": (1024, 4096, 16, 6, 0.3),
}


@pytest.mark.parametrize("name", list(PRESET_NUMBERS))
def test_presets_have_the_documented_numbers(name):
    c = preset(name, vocab_size=1000)
    d_model, d_ff, n_heads, n_layers, dropout = PRESET_NUMBERS[name]
    assert (c.d_model, c.d_ff, c.n_heads, c.dropout) == (d_model, d_ff, n_heads, dropout)
    assert c.n_encoder_layers == c.n_decoder_layers == n_layers
    assert c.src_vocab_size == c.tgt_vocab_size == 1000


def test_preset_overrides_and_unknown_names():
    c = preset("base", vocab_size=100, norm="pre", dropout=0.2)
    assert (c.norm, c.dropout, c.d_model) == ("pre", 0.2, 512)
    with pytest.raises(ValueError, match="'huge'"):
        preset("huge", vocab_size=100)
    with pytest.raises(ValueError, match="dropuot"):
        preset("tiny", vocab_size=100, dropuot=0.1)


def test_defaults_are_the_papers():
    m = ModelConfig()
    assert (m.norm, m.positions, m.share_embeddings, m.tie_output) == ("post", "sinusoidal", True, True)  # §3
    assert (m.d_model, m.d_ff, m.n_heads, m.dropout, m.attention_dropout) == (512, 2048, 8, 0.1, 0.0)
    t = TrainConfig()
    assert (t.adam_beta1, t.adam_beta2, t.adam_eps, t.warmup_steps) == (0.9, 0.98, 1e-9, 4000)  # §5.3
    assert t.label_smoothing == 0.1  # §5.4
    s = SearchConfig()
    assert (s.beam_size, s.alpha, s.max_len_a, s.max_len_b) == (4, 0.6, 1.0, 50)  # §6.1


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"d_model": 100, "n_heads": 8}, "n_heads"),  # d_model not divisible by n_heads
        ({"src_vocab_size": 100, "tgt_vocab_size": 200}, "share_embeddings"),
        ({"share_embeddings": True, "tie_output": False}, "tie_output"),
        ({"d_model": 0}, "d_model"),
        ({"n_decoder_layers": 0}, "n_decoder_layers"),
        ({"dropout": 1.0}, "dropout"),
        ({"d_model": 63, "n_heads": 3}, "even d_model"),  # sinusoids pair dimensions 2i, 2i+1
        ({"max_positions": 10**10}, "max_positions must be at most"),  # a table no memory holds
    ],
)
def test_inconsistent_model_configs_are_refused(values, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**values)


@pytest.mark.parametrize(
    ("cls", "values", "named"),
    [
        (SearchConfig, {"alpha": math.nan}, "alpha"),
        (SearchConfig, {"alpha": math.inf}, "alpha"),
        (SearchConfig, {"max_len_a": -1.0}, "max_len_a"),
        (SearchConfig, {"max_len_a": 0.0, "max_len_b": 0}, "not both 0"),
        (ModelConfig, {"dropout": math.nan}, "dropout"),
        (TrainConfig, {"lr_scale": -1.0}, "lr_scale"),
        (TrainConfig, {"lr_scale": 0.0}, "lr_scale"),
        (TrainConfig, {"max_minutes": -1.0}, "max_minutes"),
        (TrainConfig, {"max_minutes": math.inf}, "max_minutes"),
        (TrainConfig, {"clip_norm": -1.0}, "clip_norm"),
        (TrainConfig, {"adam_beta2": 1.0}, "betas"),
        (TrainConfig, {"adam_eps": 0.0}, "eps"),
    ],
)
def test_values_that_mean_nothing_are_refused(cls, values, named):
    with pytest.raises(ValueError, match=named):
        cls(**values)


@pytest.mark.parametrize("key", ["pad_id", "bos_id", "eos_id", "unk_id"])
def test_special_ids_are_the_tokenizers_not_settings(key):
    # One source of truth: overriding an id would make search stop on, or batches pad with, a token
    # the vocabulary does not use for that.
    for refuse in (
        lambda: parse_overrides((ModelConfig, TrainConfig), [f"{key}=5"]),
        lambda: from_dict(ModelConfig, {key: 5}),
        lambda: split_overrides({key: 5}, where="run.yaml"),
    ):
        with pytest.raises(ValueError, match=f"{key} is not a setting.*tokenizer"):
            refuse()
    assert key not in {f.name for f in dataclasses.fields(ModelConfig)}


def test_split_overrides_sends_each_key_to_its_config():
    model, train = split_overrides({"dropout": 0.3, "warmup_steps": 10}, where="x.yaml")
    assert (model, train) == ({"dropout": 0.3}, {"warmup_steps": 10})
    with pytest.raises(ValueError, match="x.yaml: unknown key.*dropuot"):
        split_overrides({"dropuot": 0.3}, where="x.yaml")


@pytest.mark.parametrize("joint", [True, False])
def test_embedding_sharing_follows_the_vocabulary(joint):
    config = preset_for_vocabulary("tiny", 300, 300 if joint else 280, joint)
    assert config.share_embeddings is joint
    # Separate matrices over one vocabulary are a choice; one matrix over two vocabularies is a bug.
    assert preset_for_vocabulary("tiny", 300, 300, True, share_embeddings=False).share_embeddings is False
    with pytest.raises(ValueError, match="share_embeddings=true needs one vocabulary"):
        preset_for_vocabulary("tiny", 300, 300, False, share_embeddings=True)
    with pytest.raises(ValueError, match="src_vocab_size is not a setting"):
        preset_for_vocabulary("tiny", 300, 300, True, src_vocab_size=10)


def test_the_same_values_are_accepted_where_they_make_sense():
    c = ModelConfig(src_vocab_size=100, tgt_vocab_size=200, share_embeddings=False)
    assert (c.src_vocab_size, c.tgt_vocab_size, c.tie_output) == (100, 200, True)
    assert ModelConfig(d_model=63, n_heads=3, positions="learned").d_model == 63


@pytest.mark.parametrize(
    ("cls", "field", "value"),
    [
        (ModelConfig, "d_model", "512"),  # a string for an int
        (ModelConfig, "n_heads", True),  # a bool is an int to Python, not to us
        (ModelConfig, "d_ff", 2048.0),
        (ModelConfig, "dropout", "0.1"),
        (ModelConfig, "dropout", False),
        (ModelConfig, "share_embeddings", 1),
        (ModelConfig, "norm", "middle"),
        (TrainConfig, "warmup_steps", 4000.5),
        (TrainConfig, "dtype", "fp8"),
        (SearchConfig, "beam_size", "4"),
    ],
)
def test_wrong_types_are_refused_naming_the_field(cls, field, value):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        cls(**{field: value})


def test_an_int_for_a_float_becomes_a_float():
    c = ModelConfig(dropout=0)
    assert c.dropout == 0.0 and type(c.dropout) is float


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ModelConfig().dropout = 0.3
    for config in (TrainConfig(), SearchConfig()):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(config, dataclasses.fields(config)[0].name, 1)


def test_a_runs_search_is_a_search_config_set_by_its_field_names_or_as_train_json_holds_it(tmp_path):
    """TrainConfig.search is the model's search (a SearchConfig); its fields are set like TrainConfig's
    own (--set beam_size=5, a recipe's alpha), and the validations during the run decode with it at
    valid_beam_size. train.json holds it as an object; one that holds it flat (as runs made before it was
    an object wrote) reads the same."""
    want = SearchConfig(beam_size=5, alpha=1.0, length_penalty="average")
    flat = {"beam_size": 5, "alpha": 1.0, "length_penalty": "average", "warmup_steps": 7}
    config = from_dict(TrainConfig, flat)
    assert config.search == want and config.warmup_steps == 7
    assert config.valid_search == dataclasses.replace(want, beam_size=1)
    assert parse_overrides((ModelConfig, TrainConfig), ["alpha=1.0", "max_len_b=20"]) == {
        "alpha": 1.0,
        "max_len_b": 20,
    }
    assert split_overrides({"alpha": 1.0, "dropout": 0.2}, where="x") == ({"dropout": 0.2}, {"alpha": 1.0})
    nested = {"search": dataclasses.asdict(want), "warmup_steps": 7}
    assert from_dict(TrainConfig, nested) == config
    assert from_dict(TrainConfig, {**nested, "beam_size": 2}).search.beam_size == 2  # the flat key wins
    path = tmp_path / "train.json"
    path.write_text(json.dumps({**dataclasses.asdict(TrainConfig()), **flat} | {"search": None}))
    with pytest.raises(ValueError, match="train.json: search must be an object"):
        load_json(TrainConfig, path)
    old = {k: v for k, v in dataclasses.asdict(TrainConfig()).items() if k != "search"} | flat
    path.write_text(json.dumps(old))
    assert load_json(TrainConfig, path) == config
    for bad, named in (
        ({"search": {"beem": 4}}, "search: unknown SearchConfig key"),
        ({"alpha": -1}, "alpha"),
    ):
        with pytest.raises(ValueError, match=named):
            from_dict(TrainConfig, bad)
    with pytest.raises(ValueError, match="n_best"):
        TrainConfig(search=SearchConfig(beam_size=2, n_best=2))
    with pytest.raises(ValueError, match="TrainConfig.search: expected a SearchConfig"):
        TrainConfig(search={"beam_size": 4})


def test_from_dict_refuses_unknown_keys():
    assert from_dict(TrainConfig, {"warmup_steps": 100}).warmup_steps == 100
    with pytest.raises(ValueError, match="warmup_stpes"):
        from_dict(TrainConfig, {"warmup_stpes": 100})


def test_parse_overrides_gives_typed_values():
    values = parse_overrides(
        ModelConfig, ["dropout=0.3", "norm=pre", "share_embeddings=false", "d_model = 256"]
    )
    assert parse_overrides((ModelConfig, TrainConfig), ["warmup_steps=7", "d_ff=8"]) == {
        "warmup_steps": 7,
        "d_ff": 8,
    }
    assert values == {"dropout": 0.3, "norm": "pre", "share_embeddings": False, "d_model": 256}
    assert [type(v) for v in values.values()] == [float, str, bool, int]
    assert parse_overrides(ModelConfig, ["tie_output=YES"]) == {"tie_output": True}
    c = from_dict(ModelConfig, {**values, "n_heads": 4})
    assert (c.dropout, c.norm, c.share_embeddings, c.d_model) == (0.3, "pre", False, 256)


@pytest.mark.parametrize(
    ("item", "named"),
    [
        ("dropuot=0.3", "dropuot"),  # unknown key
        ("norm=middle", "middle"),  # not one of the literals
        ("share_embeddings=maybe", "maybe"),
        ("d_model=2.5", "2.5"),
        ("dropout=high", "high"),
        ("dropout", "key=value"),
    ],
)
def test_parse_overrides_refuses_bad_items(item, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        parse_overrides(ModelConfig, [item])


@pytest.mark.parametrize(
    "config",
    [
        ModelConfig(src_vocab_size=100, tgt_vocab_size=200, share_embeddings=False, norm="pre", dropout=0.3),
        TrainConfig(max_tokens=1000, dtype="fp32", max_minutes=2.5, skip_nonfinite=True),
        TrainConfig(search=SearchConfig(beam_size=5, alpha=1.0, length_penalty="average", max_len_b=20)),
        SearchConfig(beam_size=5, alpha=1.0, length_penalty="average", n_best=2),
    ],
)
def test_json_round_trip(tmp_path, config):
    path = tmp_path / "config.json"
    save_json(config, path)
    assert set(json.loads(path.read_text())) == {f.name for f in dataclasses.fields(config)}  # plain JSON
    assert load_json(type(config), path) == config


@pytest.mark.parametrize(
    "text",
    ["{not json", "[1, 2]", '{"d_modle": 512}', b"\xff\xfe\x00"],
    ids=["invalid", "not-an-object", "unknown-key", "not-utf8"],
)
def test_load_json_names_the_bad_file(tmp_path, text):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=re.escape(str(path))):
        load_json(ModelConfig, path)


def test_load_json_names_a_missing_file(tmp_path):
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "missing.json"))):
        load_json(ModelConfig, tmp_path / "missing.json")


def test_load_json_names_the_file_with_a_wrong_typed_value(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"d_model": "512"}')
    with pytest.raises(ValueError, match=re.escape(str(path))):
        load_json(ModelConfig, path)


def test_averaging_needs_a_budget_not_the_budget_schedule():
    """§6.1 averaging takes the checkpoints of the budget's last part: any schedule, as long as the run
    knows where it ends."""
    assert TrainConfig(max_updates=100, schedule="paper").averaged == 5
    assert TrainConfig(max_minutes=30.0).averaged == 5 and TrainConfig(max_minutes=30.0).budgeted
    assert not TrainConfig(max_updates=100, schedule="paper").budgeted
    assert TrainConfig(max_epochs=3).averaged == 0  # epochs are not a budget
    assert TrainConfig(max_updates=100, average_last=1).averaged == 0


def test_one_function_chooses_the_preset_vocabulary_and_bpe_dropout_unless_the_user_did():
    low = RECIPES["low-resource"]
    enough = low.bpe_dropout_updates
    chosen = choose(None, LOW_RESOURCE_PAIRS, updates=enough)  # a corpus this size: low-resource
    assert chosen == Choice("low-resource", low.vocab_size, low.bpe_dropout, enough)
    assert choose(None, LOW_RESOURCE_PAIRS, updates=enough - 1).bpe_dropout == 0.0  # too few updates
    assert choose(None, LOW_RESOURCE_PAIRS).bpe_dropout == 0.0  # no budget
    # a measurement of the updates, asked once and only where the decision depends on it
    asked = []
    measured = lambda name: asked.append(name) or 2 * enough  # noqa: E731
    assert choose(None, LOW_RESOURCE_PAIRS, updates=measured).bpe_dropout == low.bpe_dropout
    assert choose("low-resource", bpe_dropout=0.0, updates=measured).bpe_dropout == 0.0  # the user's
    assert choose("small", updates=measured).bpe_dropout == 0.0  # a recipe without BPE-dropout
    assert asked == ["low-resource"]
    assert choose(None, LOW_RESOURCE_PAIRS + 1).preset == "small"
    assert choose("base", 10, vocab_size=123, bpe_dropout=0.2) == Choice("base", 123, 0.2)  # the user's win
    with pytest.raises(ValueError, match="unknown preset"):
        choose("huge")
    with pytest.raises(ValueError, match="number of training pairs"):
        choose(None)


def test_inference_options_are_checked_where_they_are_made():
    assert InferenceOptions() == InferenceOptions(device="auto", dtype="auto", engine="torch")
    with pytest.raises(ValueError, match="threads must be at least 1"):
        InferenceOptions(threads=0)
    for bad in ({"engine": "onnx"}, {"dtype": "fp8"}, {"compile": "yes"}):
        with pytest.raises(ValueError):
            InferenceOptions(**bad)
