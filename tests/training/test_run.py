"""The run directory (aiayn/training/run.py) and the ways work could be lost or be wrong.

Each test of a way to lose work failed on the code before the run directory had one owner (checked by
running this file against that code with its calls adapted to the old API); two more
(--force replacing the whole run, a resume changing only limits) guard against refusing too much.
Through the command line where a user would meet the problem, through the library where the state
to set up is easier to reach that way.
"""

import json
import os
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import safetensors.torch
import torch
from conftest import assert_one_line_error, run_cli, run_train, train_argv, write_parallel

from aiayn import checkpoint
from aiayn.config import TrainConfig, preset
from aiayn.data.corpus import Corpus
from aiayn.data.prepare import prepare_corpus
from aiayn.data.synthetic import generate
from aiayn.inference import plots
from aiayn.inference.translate import Translator
from aiayn.model import Transformer
from aiayn.tokenizer import Tokenizer
from aiayn.training.run import RUN_FILE, Progress, Run

SRC, TGT = generate(320, seed=7)


def tiny(prefix, out, *extra) -> list:
    """`aiayn train` of a tiny model for 2 updates, validating at each."""
    flags = ["--preset", "tiny", "--vocab-size", 300, "--max-updates", 2, "--max-tokens", 400]
    return train_argv(prefix, out, *flags, "--set", "dtype=fp32", "--set", "valid_every=1", *extra)


@pytest.fixture
def data(tmp_path) -> Path:
    # few: an untrained model decodes to its limit
    write_parallel(tmp_path / "valid", SRC[300:306], TGT[300:306])
    return write_parallel(tmp_path / "train", SRC[:300], TGT[:300])


def trained(data: Path, out: Path, *extra) -> Path:
    code, _, stderr = run_cli(tiny(data, out, "--valid", f"{data.parent}/valid", *extra))
    assert code == 0, stderr
    return out


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under a directory, by relative path: to show nothing changed."""
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# --- Starting: a new run, --force ------------------------------------------------------------------


def test_a_new_run_refuses_a_directory_holding_checkpoints_or_metrics_without_a_model(data, tmp_path):
    out = trained(data, tmp_path / "run")
    (out / checkpoint.CONFIG).unlink()  # e.g. a run whose model was removed, or one killed early
    before = snapshot(out)
    code, _, stderr = run_cli(tiny(data, out))
    assert_one_line_error(
        code, stderr, f"{out} already holds a run", "checkpoints", "metrics.jsonl", "--force"
    )
    assert snapshot(out) == before


def test_force_checks_the_inputs_before_removing_the_old_run(data, tmp_path):
    out = trained(data, tmp_path / "run")
    before = snapshot(out)
    # Every pair is longer than max_len: found only once the data is read and tokenized.
    code, _, stderr = run_cli(tiny(data, out, "--force", "--set", "max_len=2"))
    assert_one_line_error(code, stderr, "no training pair has at most max_len=2")
    assert snapshot(out) == before


def test_force_replaces_the_whole_old_run(data, tmp_path):
    out = trained(data, tmp_path / "run", "--max-updates", 3)
    (out / checkpoint.CHECKPOINTS / "step_00000099").mkdir()  # a stray one, as a later --resume would find
    code, _, stderr = run_cli(tiny(data, out, "--force", "--vocab-size", 280))
    assert code == 0, stderr
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["step_00000001", "step_00000002"]
    assert [r["step"] for r in read_metrics(out) if r.get("event") == "stop"] == [2]
    assert Translator.load(out, device="cpu").model.config.src_vocab_size == 280


def failing(stage: str, monkeypatch) -> None:
    """Make the next run fail at `stage`, after OUT has been prepared for it (a replaced run set aside)."""
    from aiayn.training import train as train_module

    def fail(*args, **kwargs):
        raise ValueError(f"failed at {stage}")

    if stage == "batching":
        monkeypatch.setattr(train_module, "update_groups", fail)
    elif stage == "first update":
        monkeypatch.setattr(train_module, "train_step", fail)
    elif stage == "first validation":
        monkeypatch.setattr(train_module.Validation, "__call__", fail)
    elif stage == "first model: disk full":

        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(checkpoint, "write_weights", full)
    else:  # a signal before the first update
        real = train_module.stop_reason

        def stop_reason(state, cfg, run, signals):
            return (
                train_module.Stop("signal", "SIGINT") if state.step == 0 else real(state, cfg, run, signals)
            )

        monkeypatch.setattr(train_module, "stop_reason", stop_reason)


@pytest.mark.parametrize(
    "stage", ["batching", "first update", "first validation", "first model: disk full", "signal"]
)
def test_force_that_fails_before_its_first_model_puts_the_old_run_back_byte_for_byte(
    data, tmp_path, monkeypatch, stage
):
    """--force sets the old run aside until the new one has written a model; anything that ends the new
    run before that puts it back as it was (and says so), so that it still resumes. (It was removed
    when the new run began: a failure after that left OUT with neither.)"""
    out = trained(data, tmp_path / "run")
    (out / "notes.txt").write_text("the user's own file\n")
    before = snapshot(out)
    with monkeypatch.context() as patch:
        failing(stage, patch)
        code, _, stderr = run_cli(tiny(data, out, "--force", "--vocab-size", 280))
    assert code != 0 and "Traceback" not in stderr, stderr
    assert "holds the run it held before --force again, as it was" in stderr
    if stage == "signal":
        assert code == 130 and "before the new run had a model" in stderr
    else:
        assert_one_line_error(
            code, stderr, "No space left on device" if "disk" in stage else f"failed at {stage}"
        )
    assert snapshot(out) == before and not (out / ".replaced-run").exists()
    code, _, stderr = run_cli(
        tiny(data, out, "--valid", f"{data.parent}/valid", "--resume", "--max-updates", 3)
    )
    assert code == 0, stderr
    assert [r["step"] for r in read_metrics(out) if r.get("event") == "stop"] == [2, 3]


def test_a_force_run_killed_before_its_first_model_gets_the_old_run_back_at_the_next_start(data, tmp_path):
    """A replacement killed (no error handling ran) while the old run is set aside: the next command on
    OUT puts it back before deciding anything; killed after its first model, the old run is removed."""
    out = trained(data, tmp_path / "run")
    before = snapshot(out)
    run = Run.open(out, "force", progress=False)
    from aiayn.training.run import set_aside

    set_aside(run.out)
    (out / RUN_FILE).write_text("{}")  # the replacement had begun
    code, _, stderr = run_cli(
        tiny(data, out, "--valid", f"{data.parent}/valid", "--resume", "--max-updates", 3)
    )
    assert code == 0, stderr
    records = read_metrics(out)
    assert [r["step"] for r in records if r.get("event") == "stop"] == [2, 3]  # the old run, resumed
    assert {k: v for k, v in snapshot(out).items() if k in before and "step_00000002" in k} == {
        k: v for k, v in before.items() if "step_00000002" in k
    }
    set_aside(out)  # now killed just after the replacement's first model
    shutil.copytree(out / ".replaced-run", tmp_path / "new")
    for name in os.listdir(tmp_path / "new"):
        os.replace(tmp_path / "new" / name, out / name)
    Run.open(out, "resume", progress=False)
    assert not (out / ".replaced-run").exists() and (out / checkpoint.CONFIG).is_file()


# --- Resuming ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,needles",
    [
        (["--set", "d_model=32"], ["model.d_model: 64 in", "32 now"]),
        (["--preset", "small"], ["model.d_ff: 128 in", "1024 now"]),
        (["--src-lang", "xx", "--tgt-lang", "en"], ["en -> xx then, xx -> en now", "--train:"]),
        (["--vocab-size", 280], ["tokenizer:", "vocab_size 300", "vocab_size 280"]),
        (["--max-tokens", 500], ["train.max_tokens: 400 in", "500 now"]),
        (["--valid-fraction", 0.1], ["--valid-fraction None then, 0.1 now", "--valid", "then, none now"]),
    ],
)
def test_a_resume_with_other_settings_is_refused_naming_each(data, tmp_path, extra, needles):
    out = trained(data, tmp_path / "run")
    before = snapshot(out)
    code, _, stderr = run_cli([*tiny(data, out, "--valid", f"{data.parent}/valid", "--resume"), *extra])
    if "--valid-fraction" in map(str, extra):  # instead of --valid: refused as both, so drop --valid
        argv = tiny(data, out, "--resume", *extra)
        code, _, stderr = run_cli(argv)
    assert_one_line_error(code, stderr, "cannot resume", *needles)
    assert snapshot(out) == before


def test_a_resume_with_other_micro_batches_per_update_is_told_what_to_set(data, tmp_path):
    out = trained(data, tmp_path / "run", "--set", "accumulate=2")  # 1 process x 2 micro-batches
    code, _, stderr = run_cli(
        tiny(data, out, "--valid", f"{data.parent}/valid", "--resume", "--max-updates", 3)
    )
    assert_one_line_error(
        code, stderr, "train.micro_batches_per_update: 2 in", "1 now", "--set accumulate=2 resumes it"
    )


def test_a_resume_may_change_limits(data, tmp_path):
    out = trained(data, tmp_path / "run")
    code, _, stderr = run_cli(
        tiny(data, out, "--valid", f"{data.parent}/valid", "--resume", "--max-updates", 3)
    )
    assert code == 0, stderr
    assert [r["step"] for r in read_metrics(out) if r.get("event") == "stop"] == [2, 3]


def test_metrics_written_after_the_last_checkpoint_are_not_repeated_on_resume(tmp_path):
    """A run killed after update 4 whose last checkpoint is update 2 redoes 3 and 4: their records
    must appear once."""
    tokenizer = Tokenizer.train(SRC, TGT, vocab_size=300)
    config = preset("tiny", vocab_size=tokenizer.src_vocab_size)
    corpus = Corpus(SRC[:300], TGT[:300], SRC[300:], TGT[300:])
    cfg = TrainConfig(max_updates=4, valid_every=2, max_tokens=400, dtype="fp32")
    out = tmp_path / "run"
    run_train(out, config, cfg, tokenizer, corpus)
    shutil.rmtree(checkpoint.checkpoint_path(out, 4))  # killed before the checkpoint of update 4 landed
    run_train(out, config, cfg, tokenizer, corpus, mode="resume")
    steps = [r["step"] for r in read_metrics(out) if "valid_bleu" in r]
    assert steps == [2, 4]


def test_a_resume_removes_what_a_killed_save_left_behind(data, tmp_path):
    out = trained(data, tmp_path / "run")
    leftovers = [
        out / checkpoint.CHECKPOINTS / ".step_00000003.k2j3.tmp",
        out / ".model.safetensors.x81.tmp",
        out / ".config.json.a1.tmp",
    ]
    leftovers[0].mkdir()
    (leftovers[0] / "config.json").write_text("{")
    for path in leftovers[1:]:
        path.write_bytes(b"half")
    code, _, stderr = run_cli(
        tiny(data, out, "--valid", f"{data.parent}/valid", "--resume", "--max-updates", 3)
    )
    assert code == 0, stderr
    assert not [p for p in leftovers if p.exists()]


def test_resume_of_a_run_killed_before_its_first_checkpoint_starts_over(data, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_FILE).write_text("{}")  # what Run.begin writes before the first update
    (out / "train.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"event": "data"}\n')
    code, _, stderr = run_cli(tiny(data, out, "--resume"))
    assert code == 0, stderr
    assert read_metrics(out)[0]["event"] == "data" and "pairs" in read_metrics(out)[0]


# --- Checkpoints: the best one is kept ----------------------------------------------------------------


def test_pruning_never_removes_the_checkpoint_of_the_model_in_out(tmp_path):
    tokenizer = Tokenizer.train(SRC, TGT, vocab_size=300)
    model = Transformer(preset("tiny", vocab_size=tokenizer.src_vocab_size))
    optimizer = torch.optim.Adam(model.parameters())
    run = Run.open(tmp_path / "run", progress=False)
    data = prepare_corpus(run.data_dir, Corpus(SRC, TGT), tokenizer=tokenizer, say=lambda line: None)
    run.begin({}, model, optimizer, data, TrainConfig(keep_last=2))
    for step in range(1, 6):
        run.save_checkpoint(model, optimizer, Progress(step=step, best_step=2))
    run.log.close()
    names = [p.name for p in checkpoint.list_checkpoints(tmp_path / "run")]
    assert names == ["step_00000002", "step_00000004", "step_00000005"]


# --- The model a run leaves ----------------------------------------------------------------------------


def test_a_run_that_stops_before_its_first_validation_leaves_its_trained_model(tmp_path):
    """No validation was due (once per epoch, and the epoch is longer than the run): the run validates
    as it stops, and OUT holds the weights it trained, not the random ones it started from."""
    tokenizer = Tokenizer.train(SRC, TGT, vocab_size=300)
    config = preset("tiny", vocab_size=tokenizer.src_vocab_size)
    corpus = Corpus(SRC[:300], TGT[:300], SRC[300:], TGT[300:])
    out = tmp_path / "run"
    result = run_train(
        out, config, TrainConfig(max_updates=3, max_tokens=300, dtype="fp32"), tokenizer, corpus
    )
    assert result.model_step == 3 and result.model_validated
    assert [r["step"] for r in read_metrics(out) if "valid_bleu" in r] == [3]
    torch.manual_seed(1)  # train() seeds with TrainConfig.seed, then builds the model
    initial = Transformer(config).state_dict()
    saved = safetensors.torch.load_file(str(out / checkpoint.WEIGHTS))
    last = safetensors.torch.load_file(str(checkpoint.checkpoint_path(out, 3) / checkpoint.WEIGHTS))
    assert all(torch.equal(saved[name], last[name]) for name in saved)
    assert not torch.equal(
        saved["encoder.0.self_attn.in_proj.weight"], initial["encoder.0.self_attn.in_proj.weight"]
    )


def test_a_crash_while_replacing_a_model_directory_leaves_the_old_one_whole(tmp_path, monkeypatch):
    """config.json, tokenizer and weights are one set: never the new config beside the old weights."""
    old_tok, new_tok = Tokenizer.train(SRC, TGT, vocab_size=300), Tokenizer.train(SRC, TGT, vocab_size=280)
    old = Transformer(preset("tiny", vocab_size=300))
    new = Transformer(preset("tiny", vocab_size=280))
    checkpoint.save_model(tmp_path, old, old_tok)
    before = snapshot(tmp_path)

    def crash(*args, **kwargs):
        raise OSError("simulated crash while writing the weights")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError, match="simulated crash"):
        checkpoint.save_model(tmp_path, new, new_tok)
    assert snapshot(tmp_path) == before  # the old set, whole, and no temporary files
    assert Translator.load(tmp_path, device="cpu").model.config.src_vocab_size == 300


def test_a_crash_while_drawing_a_plot_keeps_the_old_picture(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        '{"step": 10, "loss": 3.0}\n{"step": 10, "valid_loss": 2.0, "valid_bleu": 5.0, "minutes": 1}\n'
    )
    png = plots.plot_curves(metrics, tmp_path / "curves.png")
    before = snapshot(tmp_path)
    real = plt.Figure.savefig

    def half_then_crash(self, path, *args, **kwargs):
        real(self, path, *args, **kwargs)
        Path(path).write_bytes(Path(path).read_bytes()[:100])
        raise OSError("simulated crash")

    monkeypatch.setattr(plt.Figure, "savefig", half_then_crash)
    with pytest.raises(OSError, match="simulated crash"):
        plots.plot_curves(metrics, png)
    assert snapshot(tmp_path) == before


# --- average ---------------------------------------------------------------------------------------


def test_average_never_writes_into_the_run_it_reads(data, tmp_path):
    out = trained(data, tmp_path / "run")
    before = snapshot(out)
    for dest in (out, checkpoint.checkpoint_path(out, 2)):
        code, _, stderr = run_cli(["average", out, "--last", 2, "--out", dest, "--force"])
        assert_one_line_error(code, stderr, "cannot be written into the run it reads")
    other = tmp_path / "other"
    other.mkdir()
    code, _, stderr = run_cli(["average", out, "--last", 2, "--out", other])
    assert_one_line_error(code, stderr, f"{other} already exists; use --force")
    assert snapshot(out) == before
    assert run_cli(["average", out, "--last", 2, "--out", tmp_path / "avg"])[0] == 0


def test_average_refuses_checkpoints_of_different_tokenizers(tmp_path):
    first = Tokenizer.train(SRC[:150], TGT[:150], vocab_size=300)
    second = Tokenizer.train(SRC[150:], TGT[150:], vocab_size=300)  # the same size, other merges
    model = Transformer(preset("tiny", vocab_size=300))
    state = {"optimizer": {}, "progress": {}, "rng": {}}
    checkpoint.save_checkpoint(tmp_path, 1, model, first, TrainConfig(), state)
    checkpoint.save_checkpoint(tmp_path, 2, model, second, TrainConfig(), state)
    with pytest.raises(ValueError, match="different tokenizers"):
        checkpoint.average(tmp_path, 2, tmp_path / "avg")
    assert not (tmp_path / "avg").exists()


def test_average_refuses_weights_of_another_shape(tmp_path):
    tokenizer = Tokenizer.train(SRC, TGT, vocab_size=300)
    model = Transformer(preset("tiny", vocab_size=300))
    state = {"optimizer": {}, "progress": {}, "rng": {}}
    for step in (1, 2):
        checkpoint.save_checkpoint(tmp_path, step, model, tokenizer, TrainConfig(), state)
    weights = checkpoint.checkpoint_path(tmp_path, 2) / checkpoint.WEIGHTS
    tensors = safetensors.torch.load_file(str(weights))
    tensors["encoder.0.feed_forward.w_1.bias"] = torch.zeros(7)
    safetensors.torch.save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="step_00000002/model.safetensors: its tensors differ"):
        checkpoint.average(tmp_path, 2, tmp_path / "avg")


# --- Outputs are checked before the work -----------------------------------------------------------


def test_outputs_are_checked_before_any_translation(data, tmp_path, monkeypatch):
    out = trained(data, tmp_path / "run")
    calls = []
    monkeypatch.setattr(Translator, "translate", lambda self, *a, **k: calls.append(1) or [])
    missing = tmp_path / "no" / "such" / "dir" / "out.txt"
    for argv in (
        ["translate", out, "--input", f"{data}.en", "--output", missing],
        ["evaluate", out, "--src", f"{data}.en", "--ref", f"{data}.xx", "--output", missing],
        ["translate", out, "--input", f"{data}.en", "--output", tmp_path],
    ):
        code, _, stderr = run_cli(argv)
        assert_one_line_error(code, stderr, str(argv[-1]))
    assert calls == []


def test_evaluate_prints_its_scores_before_writing_the_translations(data, tmp_path, monkeypatch):
    out = trained(data, tmp_path / "run")
    real = os.replace

    def full_disk(src, dst):
        if str(dst).endswith("hyps.txt"):
            raise OSError(28, "No space left on device", str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", full_disk)
    argv = ["evaluate", out, "--src", f"{data}.en", "--ref", f"{data}.xx", "--output", tmp_path / "hyps.txt"]
    code, stdout, stderr = run_cli([*argv, "--quiet", "--beam-size", 1])
    assert_one_line_error(code, stderr, "No space left on device")
    assert "BLEU" in stdout and json.loads(stdout.splitlines()[-1])["sentences"] == 300
