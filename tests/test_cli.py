"""A shrunken end-to-end run of the `aiayn` command line (train -> translate -> evaluate -> average),
checked against the library and sacreBLEU, and its errors: exit code 2, one line, no traceback."""

import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
import sacrebleu
import safetensors.torch
import torch
from conftest import assert_one_line_error, run_cli, train_argv, write_parallel

from aiayn import checkpoint
from aiayn.cli.main import main
from aiayn.data.synthetic import generate

run = run_cli


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A synthetic corpus, a model trained on it for 20 updates, and a test set."""
    root = tmp_path_factory.mktemp("cli")
    src, tgt = generate(266, seed=5)
    train = write_parallel(root / "train", src[:250], tgt[:250])
    valid = write_parallel(root / "valid", src[250:256], tgt[250:256])
    # Test set: an empty line and a line holding U+2028, which str.splitlines() would split in two.
    test_src = [*src[256:260], "", src[260].replace(" ", "\u2028", 1), src[261]]
    test_ref = [*tgt[256:260], "", tgt[260], tgt[261]]
    (root / "test.en").write_text("".join(line + "\n" for line in test_src), encoding="utf-8")
    (root / "test.xx").write_text("".join(line + "\n" for line in test_ref), encoding="utf-8")
    model = root / "model"
    code, stdout, stderr = run(
        ["train", "--train", train, "--valid", valid, "--src-lang", "en", "--tgt-lang", "xx", "--out", model]
        + ["--preset", "tiny", "--max-updates", 20, "--vocab-size", 300, "--max-tokens", 1500]
        + ["--set", "valid_every=10", "--set", "dtype=fp32", "--quiet"]
    )
    assert code == 0, stderr
    return root, model, json.loads(stdout.splitlines()[-1]), len(test_src)


def test_train_writes_a_model_directory(workdir):
    _, model, result, _ = workdir
    assert result["event"] == "stop" and result["reason"] == "max_updates" and result["step"] == 20
    for name in ("config.json", "model.safetensors", "tokenizer.json", "train.json", "metrics.jsonl"):
        assert (model / name).is_file(), name
    # validations at 10 and 20; for the average of the last 5 (a budgeted run), 4 more over its last 20%
    steps = [checkpoint.step_of(p) for p in checkpoint.list_checkpoints(model)]
    assert steps == [10, 17, 18, 19, 20]
    config = json.loads((model / "config.json").read_text())
    assert config["d_model"] == 64 and config["src_vocab_size"] == 300  # the tiny preset, --vocab-size
    assert json.loads((model / "train.json").read_text())["valid_every"] == 10  # --set reached TrainConfig
    steps = [r["step"] for r in map(json.loads, (model / "metrics.jsonl").open()) if "valid_bleu" in r]
    assert steps == [10, 20]


def test_without_a_preset_the_corpus_size_picks_one_and_says_so(workdir, tmp_path, monkeypatch):
    """250 pairs: the low-resource recipe (its model, batch, schedule peak and vocabulary size), unless a
    flag says otherwise; past LOW_RESOURCE_PAIRS, `small` with its own vocabulary size."""
    from aiayn import config

    root = workdir[0]
    args = ["train", "--train", root / "train", "--valid", root / "valid", "--src-lang", "en", "--tgt-lang", "xx",
            "--max-updates", 1, "--set", "dtype=fp32", "--quiet"]  # fmt: skip
    code, _, stderr = run([*args, "--out", tmp_path / "auto"])
    assert code == 0, stderr
    assert "no --preset: 250 training pairs, so --preset low-resource" in stderr
    chosen = config.RECIPES["low-resource"]
    model = json.loads((tmp_path / "auto" / "config.json").read_text())
    for key, value in config.PRESETS["low-resource"].items():
        assert model[key] == value, key
    trained = config.load_json(config.TrainConfig, tmp_path / "auto" / "train.json")
    settings = {**dataclasses.asdict(trained), **dataclasses.asdict(trained.search)}  # --set's names
    assert {k: settings[k] for k in chosen.train} == dict(chosen.train)
    run_settings = json.loads((tmp_path / "auto" / "run.json").read_text())
    assert f"vocab_size {chosen.vocab_size}," in json.dumps(run_settings)
    code, _, stderr = run([*args, "--out", tmp_path / "flags", "--max-tokens", 999, "--set", "lr_scale=0.25"])
    assert code == 0, stderr
    trained = json.loads((tmp_path / "flags" / "train.json").read_text())
    assert trained["max_tokens"] == 999 and trained["lr_scale"] == 0.25  # the user's flags win
    monkeypatch.setattr(config, "LOW_RESOURCE_PAIRS", 100)
    code, _, stderr = run([*args, "--out", tmp_path / "large"])
    assert code == 0, stderr
    assert "so --preset small" in stderr and "vocab_size 8000," in json.dumps(
        json.loads((tmp_path / "large" / "run.json").read_text())
    )
    assert json.loads((tmp_path / "large" / "train.json").read_text())["max_tokens"] == 4096


def test_the_recipe_takes_bpe_dropout_for_a_budget_of_enough_updates_measured_here(
    workdir, tmp_path, monkeypatch
):
    """The low-resource recipe's BPE-dropout is for budgets that buy bpe_dropout_updates or more (where it
    paid): the same --max-minutes on a fast machine (a measured rate, here given) prepares other
    segmentations and on a slow one does not, each said and kept in run.json; no budget, none; a named
    preset follows the same rule, and --bpe-dropout wins over the recipe without measuring anything."""
    from aiayn import config
    from aiayn.training import calibrate

    chosen = config.RECIPES["low-resource"]
    assert chosen.bpe_dropout > 0 and chosen.bpe_dropout_updates > 0
    minutes = 0.01  # a budget of 0.6 seconds: the runs end at once
    fast, slow = 2 * chosen.bpe_dropout_updates / minutes, chosen.bpe_dropout_updates / 2 / minutes
    root = workdir[0]
    args = ["train", "--train", root / "train", "--valid", root / "valid", "--src-lang", "en", "--tgt-lang", "xx",
            "--max-minutes", minutes, "--set", "dtype=fp32", "--bpe-dropout-views", 2]  # fmt: skip
    for name, rate, flags, expected in (
        ("fast", fast, [], chosen.bpe_dropout),
        ("slow", slow, [], 0.0),
        ("preset", fast, ["--preset", "low-resource"], chosen.bpe_dropout),
        ("off", fast, ["--bpe-dropout", 0], 0.0),
    ):
        measured = []
        monkeypatch.setattr(
            calibrate,
            "updates_per_minute",
            lambda *_, rate=rate, measured=measured: measured.append(rate) or rate,
        )
        code, _, stderr = run([*args, "--out", tmp_path / name, *flags])
        assert code == 0, stderr
        manifest = json.loads((tmp_path / name / "data" / "manifest.json").read_text())
        assert manifest["bpe_dropout"] == expected, name
        assert len(manifest.get("views", [])) == (2 if expected else 0), name
        budget = json.loads((tmp_path / name / "run.json").read_text()).get("budget")
        if name == "off":  # the user's choice: nothing measured
            assert measured == [] and budget is None
            continue
        bought = int(rate * minutes)
        assert budget == {"minutes": minutes, "updates_per_minute": rate, "updates": bought, "dtype": "fp32"}
        assert f"buys about {bought:,} updates" in stderr and "a minute in fp32" in stderr, name
        assert ("recipe's for 250 pairs" in stderr) == (name == "fast"), name  # says why, when it chose
        assert ("no BPE-dropout: the recipe takes it from" in stderr) == (name == "slow"), name
    code, _, stderr = run([*args[:-6], "--max-updates", 1, "--out", tmp_path / "none", *args[-4:]])
    assert code == 0 and "buys about" not in stderr, stderr  # --max-updates: known, not measured
    assert json.loads((tmp_path / "none" / "data" / "manifest.json").read_text())["bpe_dropout"] == 0.0
    monkeypatch.setattr(calibrate, "updates_per_minute", lambda *_: slow)
    for flags in ([], ["--bpe-dropout", 0]):  # source-only, and no BPE-dropout to do
        code, _, stderr = run([*args, "--out", tmp_path / "refused", "--bpe-dropout-source-only", *flags])
        assert code == 2 and "--bpe-dropout-source-only" in stderr and "give --bpe-dropout P" in stderr
        assert "Traceback" not in stderr


def test_translate_one_line_per_input_line(workdir):
    root, model, _, n_lines = workdir
    code, _, stderr = run(
        ["translate", model, "--input", root / "test.en", "--output", root / "hyp.xx", "--quiet"]
    )
    assert code == 0, stderr
    hyps = (root / "hyp.xx").read_text().split("\n")
    assert hyps[-1] == "" and len(hyps) - 1 == n_lines  # one line per input line, newline-terminated
    assert hyps[4] == ""  # the empty line stays empty
    assert f"translated {n_lines} lines" in stderr
    # stdout (no --output) gives the same text
    code, stdout, _ = run(["translate", model, "--input", root / "test.en", "--quiet"])
    assert code == 0 and stdout == (root / "hyp.xx").read_text()


def test_evaluate_prints_json_equal_to_sacrebleu_on_the_translations(workdir):
    root, model, _, _ = workdir
    code, _, stderr = run(
        ["translate", model, "--input", root / "test.en", "--output", root / "hyp2.xx", "--quiet"]
    )
    assert code == 0, stderr
    code, stdout, stderr = run(
        [
            "evaluate",
            model,
            "--src",
            root / "test.en",
            "--ref",
            root / "test.xx",
            "--output",
            root / "eval.xx",
        ]
        + ["--quiet"]
    )
    assert code == 0, stderr
    result = json.loads(stdout.splitlines()[-1])
    # Split on "\n" only: an untrained model emits control characters (form feeds) that splitlines() splits on.
    hyps = (root / "hyp2.xx").read_text().split("\n")[:-1]
    refs = (root / "test.xx").read_text().split("\n")[:-1]
    assert (root / "eval.xx").read_text() == (root / "hyp2.xx").read_text()
    assert result["bleu"] == sacrebleu.corpus_bleu(hyps, [refs]).score
    assert result["chrf"] == sacrebleu.corpus_chrf(hyps, [refs]).score
    assert "tok:13a" in result["bleu_signature"] and "nc:6" in result["chrf_signature"]
    assert result["sentences"] == len(refs)
    assert (
        stdout.splitlines()[0] == f"{result['bleu_detail']}  {result['bleu_signature']}"
    )  # number and signature

    # the same hypotheses scored without a model, and sacreBLEU's options, through both commands
    options = ["--lowercase", "--tokenize", "intl"]
    code, stdout, stderr = run(["score", root / "hyp2.xx", root / "test.xx", *options])
    assert code == 0, stderr
    scored = json.loads(stdout.splitlines()[-1])
    bleu = sacrebleu.metrics.BLEU(lowercase=True, tokenize="intl")
    assert scored["bleu"] == bleu.corpus_score(hyps, [refs]).score
    assert scored["bleu_signature"] == str(bleu.get_signature())
    assert scored["chrf"] == sacrebleu.metrics.CHRF(lowercase=True).corpus_score(hyps, [refs]).score
    code, stdout, stderr = run(
        ["evaluate", model, "--src", root / "test.en", "--ref", root / "test.xx", *options, "--quiet"]
    )
    assert code == 0, stderr
    evaluated = json.loads(stdout.splitlines()[-1])
    assert evaluated["bleu"] == scored["bleu"] and evaluated["bleu_signature"] == scored["bleu_signature"]


def test_score_refuses_files_of_other_lengths(workdir):
    root, _, _, _ = workdir
    (root / "short.xx").write_text("one line\n")
    code, _, stderr = run(["score", root / "short.xx", root / "test.xx"])
    assert code == 2 and f"{root / 'short.xx'} has 1 lines but {root / 'test.xx'} has" in stderr


def test_average_then_translate(workdir):
    root, model, _, n_lines = workdir
    averaged = root / "averaged"
    code, stdout, stderr = run(["average", model, "--last", 2, "--out", averaged])
    assert code == 0, stderr
    assert json.loads(stdout) == {"averaged": 2, "out": str(averaged)}
    steps = [
        safetensors.torch.load_file(str(p / checkpoint.WEIGHTS)) for p in checkpoint.list_checkpoints(model)
    ]
    got = safetensors.torch.load_file(str(averaged / checkpoint.WEIGHTS))
    assert got.keys() == steps[0].keys()
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, (steps[-2][name] + steps[-1][name]) / 2, rtol=0, atol=1e-6)

    code, _, stderr = run(
        ["translate", averaged, "--input", root / "test.en", "--output", root / "avg.xx", "--quiet"]
    )
    assert code == 0, stderr
    assert len((root / "avg.xx").read_text().split("\n")) - 1 == n_lines

    code, _, stderr = run(["average", model, "--last", 6, "--out", root / "six"])
    assert code == 2 and "found 5" in stderr


def test_translate_n_best_from_stdin(workdir, monkeypatch, capsys):
    root, model, _, _ = workdir
    monkeypatch.setattr(sys, "stdin", io.StringIO("A dog runs.\n\nThe cats see a bird.\n"))
    assert main(["translate", str(model), "--n-best", "2", "--beam-size", "2", "--quiet"]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.split("\n")[:-1]]
    assert [r[0] for r in rows] == ["0", "0", "1", "2", "2"]  # an empty line has one (empty) hypothesis
    for first, second in ((rows[0], rows[1]), (rows[3], rows[4])):
        assert float(first[1]) >= float(second[1])


def test_train_refuses_to_overwrite_a_model(workdir):
    root, model, _, _ = workdir
    code, _, stderr = run(
        [
            "train",
            "--train",
            root / "train",
            "--src-lang",
            "en",
            "--tgt-lang",
            "xx",
            "--out",
            model,
            "--quiet",
        ]
    )
    assert code == 2 and "use --resume" in stderr


# --- errors: exit code 2, one line on stderr, no traceback -------------------------------------------


@pytest.fixture(scope="module")
def corpus_prefix(workdir):
    return str(workdir[0] / "train")


@pytest.mark.parametrize(
    "extra,needles",
    [
        (["--set", "nonsense=1"], ["unknown key 'nonsense'"]),
        (["--set", "dropout=high"], ["dropout=high", "expected float"]),
        (["--set", "d_model"], ["expected key=value"]),
        (["--preset", "huge", "--vocab-size", "300"], ["unknown preset 'huge'"]),
        (["--vocab-size", "10"], ["vocab_size=10 is too small"]),
    ],
)
def test_train_config_errors(corpus_prefix, tmp_path, extra, needles):
    assert_one_line_error(*run(train_argv(corpus_prefix, tmp_path / "m", *extra))[::2], *needles)
    assert not (tmp_path / "m").exists()


def test_missing_files(workdir, tmp_path):
    root, model, _, _ = workdir
    missing = tmp_path / "nothing"
    assert_one_line_error(*run(train_argv(str(missing), tmp_path / "m"))[::2], f"{missing}.en")
    assert_one_line_error(*run(["translate", missing, "--input", root / "test.en"])[::2], str(missing))
    assert_one_line_error(*run(["translate", model, "--input", missing])[::2], f"{missing}: no such file")
    code, _, stderr = run(["evaluate", model, "--src", root / "test.en", "--ref", missing])
    assert_one_line_error(code, stderr, f"{missing}: no such file")
    assert_one_line_error(
        *run(["average", missing, "--last", 1, "--out", tmp_path / "a"])[::2], f"{missing}: not a directory"
    )


def test_the_installed_command_exits_2_without_traceback(corpus_prefix, tmp_path):
    """The real process: the console script's exit status and stderr, not just main()'s return value."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiayn",
            *map(str, train_argv(corpus_prefix, tmp_path / "m", "--set", "nope=1")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(proc.returncode, proc.stderr, "unknown key 'nope'")
    assert proc.stdout == ""


# --- What a new user met ----------------------------------------------------------------------------


def test_the_stop_record_is_printed_once_on_stdout(corpus_prefix, tmp_path):
    code, stdout, stderr = run(train_argv(corpus_prefix, tmp_path / "m", *TINY))
    assert code == 0, stderr
    assert stdout.count('"event": "stop"') == 1 and json.loads(stdout)["step"] == 2
    assert f"{tmp_path / 'm'} holds the model of update 2" in stderr


TINY = ["--preset", "tiny", "--vocab-size", 300, "--max-updates", 2, "--valid-fraction", 0.05]


def test_separate_embeddings_over_one_vocabulary(corpus_prefix, tmp_path):
    code, _, stderr = run(train_argv(corpus_prefix, tmp_path / "m", *TINY, "--set", "share_embeddings=false"))
    assert code == 0, stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["share_embeddings"] is False and config["tie_output"] is True
    code, _, stderr = run(
        train_argv(corpus_prefix, tmp_path / "n", *TINY, "--separate-vocab", "--set", "share_embeddings=true")
    )
    assert_one_line_error(code, stderr, "share_embeddings=true needs one vocabulary")


@pytest.mark.parametrize("key", ["eos_id", "pad_id", "bos_id"])
def test_a_special_id_is_not_a_setting(corpus_prefix, tmp_path, key):
    (tmp_path / "ids.yaml").write_text(f"{key}: 5\n")
    for extra in (["--set", f"{key}=5"], ["--config", tmp_path / "ids.yaml"]):
        code, _, stderr = run(train_argv(corpus_prefix, tmp_path / "m", *TINY, *extra))
        assert_one_line_error(code, stderr, f"{key} is not a setting", "tokenizer")
    assert not (tmp_path / "m").exists()


def write_jsonl(path, src: list[str], tgt: list[str]):
    rows = [json.dumps({"translation": {"en": s, "xx": t}}) for s, t in zip(src, tgt)]
    path.write_text("".join(row + "\n" for row in rows))
    return path


def test_valid_hf_reads_the_validation_split(tmp_path):
    """A local dataset with distinct splits: the best model must be chosen on validation data."""
    src, tgt = generate(60, seed=8)
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    write_jsonl(dataset / "train.jsonl", src[:53], tgt[:53])
    write_jsonl(dataset / "validation.jsonl", src[53:], tgt[53:])
    quiet = ["--preset", "tiny", "--vocab-size", 300, "--max-updates", 1]
    for extra in (["--valid", f"hf:{dataset}"], []):  # named, and the default for an hf: --train
        out = tmp_path / f"run{len(extra)}"
        code, _, stderr = run(train_argv(f"hf:{dataset}", out, *quiet, *extra))
        assert code == 0, stderr
        settings = json.loads((out / "run.json").read_text())
        assert settings["train_data"].startswith("53 pairs") and settings["valid_data"].startswith("7 pairs")
    files = [
        "--data-files",
        f"train={dataset / 'train.jsonl'}",
        "--data-files",
        f"validation={dataset / 'validation.jsonl'}",
    ]
    code, _, stderr = run(train_argv("hf:json", tmp_path / "json", *quiet, *files))
    assert code == 0, stderr
    assert json.loads((tmp_path / "json" / "run.json").read_text())["valid_data"].startswith("7 pairs")


def test_pipes_and_stdin_are_inputs(workdir, tmp_path, monkeypatch):
    root, model, _, _ = workdir
    lines = (root / "test.en").read_text(encoding="utf-8")
    expected = run(["translate", model, "--input", root / "test.en", "--quiet"])[1]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    threading.Thread(target=lambda: fifo.write_text(lines, encoding="utf-8"), daemon=True).start()
    assert run(["translate", model, "--input", fifo, "--quiet"])[1] == expected  # what <(...) gives
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines.encode())))
    assert run(["translate", model, "--input", "-", "--quiet"])[1] == expected
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines.encode())))
    code, stdout, _ = run(["evaluate", model, "--src", "-", "--ref", root / "test.xx", "--quiet"])
    assert code == 0 and json.loads(stdout.splitlines()[-1])["sentences"] == lines.count("\n")
    code, _, stderr = run(["evaluate", model, "--src", "-", "--ref", "-"])
    assert_one_line_error(code, stderr, "cannot both be standard input")


def test_tensorboard_when_asked_for(corpus_prefix, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    code, _, stderr = run(train_argv(corpus_prefix, tmp_path / "m", *TINY, "--tensorboard"))
    assert code == 0, stderr
    assert list((tmp_path / "m" / "tensorboard").glob("events.out.tfevents.*"))
    assert not (tmp_path / "n").exists()
    code, _, stderr = run(train_argv(corpus_prefix, tmp_path / "n", *TINY))  # not asked: not written
    assert code == 0 and not (tmp_path / "n" / "tensorboard").exists()


def test_translate_starts_from_the_models_search_json_and_flags_override_it(workdir, tmp_path):
    import argparse
    import shutil

    from aiayn.cli.common import read_model, search_config_from
    from aiayn.config import SearchConfig

    root, model, _, _ = workdir
    own = tmp_path / "own"
    shutil.copytree(model, own, ignore=shutil.ignore_patterns("checkpoints"))
    assert checkpoint.load_search(own) == SearchConfig()  # trained with TrainConfig's default: §6.1's
    own_search = {"beam_size": 3, "alpha": 1.0, "length_penalty": "average"}
    (own / checkpoint.SEARCH).write_text(json.dumps(own_search))

    def flags(**given):
        unset = {"beam_size": None, "alpha": None, "length_penalty": None, "stopping": None}
        return argparse.Namespace(**{"model": own, **unset, **given})

    def search_of(args, **kwargs):
        return search_config_from(args, read_model(args), **kwargs)

    assert search_of(flags()) == SearchConfig(beam_size=3, alpha=1.0, length_penalty="average")
    assert search_of(flags(alpha=0.2), n_best=5) == SearchConfig(
        beam_size=5, alpha=0.2, length_penalty="average", n_best=5
    )
    assert search_of(flags(stopping="exact")).stopping == "exact"
    outputs = {}
    explicit = ["--beam-size", 3, "--alpha", 1.0, "--length-penalty", "average"]
    for name, extra in (("plain", []), ("explicit", explicit)):
        argv = ["translate", own, "--input", root / "test.en", "--output", tmp_path / name, "--quiet"]
        code, _, stderr = run(argv + extra)
        assert code == 0, stderr
        outputs[name] = (tmp_path / name).read_text()
    assert outputs["plain"] == outputs["explicit"]


# --- The stored graphs by default, where there are any; compiled with --compile -------------------------


@pytest.fixture
def decoders(monkeypatch):
    """The compiled decoders translators make, recorded as (kind, decoder): "compile" for --compile's,
    "stored" for compile="stored"'s. Neither compiles anything: both are StoredDecoders, for which a graph
    the store lacks raises NotStored, and the translator decodes that batch eagerly."""
    from aiayn.inference import translate
    from aiayn.inference.compiled import StoredDecoder

    made = []

    class Compiled(StoredDecoder):
        kind = "compile"

        def __init__(self, model, store):
            super().__init__(model, store)
            made.append((self.kind, self))

    class Stored(Compiled):
        kind = "stored"

    monkeypatch.setattr(translate, "CompiledDecoder", Compiled)
    monkeypatch.setattr(translate, "StoredDecoder", Stored)
    return made


def test_translate_decodes_with_the_stored_graphs_by_default_and_eagerly_without(
    workdir, monkeypatch, decoders
):
    """translate and evaluate decode eagerly where the store has none of the model's graphs, saying nothing
    of it, and with a StoredDecoder of them where it has (here told so: `stored`); --no-compile always
    eagerly; --compile with a compiled decoder; every output eager's."""
    from aiayn.inference import translate

    root, model, _, _ = workdir
    has = {"graphs": False}
    monkeypatch.setattr(translate, "stored", lambda model, store: has["graphs"])
    argv = ["translate", model, "--input", root / "test.en"]
    code, eager, _ = run([*argv, "--no-compile"])
    assert code == 0 and decoders == []
    code, output, stderr = run(argv)
    assert code == 0 and output == eager and decoders == []
    assert "compile" not in stderr, stderr
    has["graphs"] = True
    code, output, _ = run([*argv, "--no-compile"])
    assert code == 0 and output == eager and decoders == []
    code, output, stderr = run(argv)
    assert code == 0 and output == eager and [kind for kind, _ in decoders] == ["stored"]
    assert "compile" not in stderr, stderr
    code, output, _ = run([*argv, "--compile"])
    assert code == 0 and output == eager and [kind for kind, _ in decoders] == ["stored", "compile"]
    code, _, _ = run(["evaluate", model, "--src", root / "test.en", "--ref", root / "test.xx", "--quiet"])
    assert code == 0 and [kind for kind, _ in decoders] == ["stored", "compile", "stored"]


# --- Fine-tuning ------------------------------------------------------------------------------------


def test_init_fine_tunes_a_model_with_its_vocabulary_architecture_and_search(
    corpus_prefix, served_model, tmp_path
):
    """`aiayn train --init MODEL_DIR`: the corpus encoded with the model's vocabulary, its architecture
    (dropout as --set gives it) and its search kept, the run its own (its schedule, budget, checkpoints);
    flags that would change the architecture or the vocabulary are refused before OUT exists."""
    init = shutil.copytree(served_model, tmp_path / "init")
    own = {
        "beam_size": 5,
        "alpha": 1.0,
        "length_penalty": "average",
        "max_len_a": 1.0,
        "max_len_b": 40,
        "n_best": 1,
        "stopping": "exact",
    }
    (init / "search.json").write_text(json.dumps(own))  # a search no recipe has
    out = tmp_path / "tuned"
    flags = ["--init", init, "--max-updates", 2, "--valid-fraction", 0.05, "--set", "dtype=fp32"]
    code, _, stderr = run(
        train_argv(corpus_prefix, out, *flags, "--set", "dropout=0.2", "--set", "beam_size=2")
    )
    assert code == 0, stderr
    assert (out / "tokenizer.json").read_text() == (init / "tokenizer.json").read_text()
    tuned, start = (json.loads((d / "config.json").read_text()) for d in (out, init))
    assert tuned == {**start, "dropout": 0.2}
    assert json.loads((out / "search.json").read_text()) == {**own, "beam_size": 2}
    assert json.loads((out / "run.json").read_text())["init"] == str(init.resolve())
    for extra, needles in (
        (["--set", "d_model=32"], ["keeps its model's architecture", "d_model"]),
        (["--preset", "base"], ["keeps its model's architecture", "d_model", "--preset base"]),
        (["--vocab-size", 100], ["brings its own vocabulary", "--vocab-size"]),
        (["--init", tmp_path / "nothing"], [str(tmp_path / "nothing")]),
    ):
        code, _, stderr = run(train_argv(corpus_prefix, tmp_path / "refused", *flags, *extra))
        assert_one_line_error(code, stderr, *needles)
        assert not (tmp_path / "refused").exists()
    # a resume reads its own checkpoint, not the model directory it started from, which may have moved
    init.rename(tmp_path / "moved")
    more = [*flags[:2], "--max-updates", 4, *flags[4:], "--set", "dropout=0.2", "--set", "beam_size=2"]  # fmt: skip
    code, stdout, stderr = run(train_argv(corpus_prefix, out, *more, "--resume"))
    assert code == 0 and json.loads(stdout)["step"] == 4, stderr
    for name in ("search.json", "train.json"):  # the model's search still, for the run's final validation too
        written = json.loads((out / name).read_text())
        assert written.get("search", written) == {**own, "beam_size": 2}, name
