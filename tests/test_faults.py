"""Bad input, faults and long runs: every way in is a clear error or a counted skip, and nothing
that was saved is lost to a crash, a kill, a signal, a non-finite loss or running out of memory.

Tests that already live beside their module are not repeated here: reader errors (data/test_corpus.py), broken
model directories and state files (test_checkpoint.py), config and CLI errors (test_cli.py, test_config.py).
"""

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import assert_one_line_error, fill, run_cli, run_train, train_argv, write_parallel

from aiayn import checkpoint
from aiayn.config import SearchConfig, TrainConfig, preset
from aiayn.data.corpus import Corpus
from aiayn.data.synthetic import generate
from aiayn.inference.translate import Translator
from aiayn.model import Transformer
from aiayn.tokenizer import EOS_ID, Tokenizer
from aiayn.training import train as train_module

SRC, TGT = generate(330, seed=4)


def run(*argv) -> tuple[int, str, str]:
    return run_cli(list(argv))


def tiny_train(prefix, out, *extra) -> list:
    """`aiayn train` arguments for one quick update of a tiny model."""
    tiny = ["--preset", "tiny", "--vocab-size", 300, "--max-updates", 1, "--set", "dtype=fp32"]
    return train_argv(prefix, out, *tiny, *extra)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train(SRC, TGT, vocab_size=300)


def tiny_model(tokenizer: Tokenizer, **overrides) -> Transformer:
    torch.manual_seed(0)
    fields = dict(d_model=32, d_ff=64, dropout=0.0) | overrides
    return Transformer(preset("tiny", vocab_size=tokenizer.src_vocab_size, **fields)).eval()


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("faults") / "model"
    checkpoint.save_model(directory, tiny_model(tokenizer), tokenizer)
    return directory


# --- Bad input: training data --------------------------------------------------------------------------


def test_train_refuses_misaligned_files_before_any_work(tmp_path):
    prefix = write_parallel(tmp_path / "p", SRC[:5], TGT[:5])
    Path(f"{prefix}.xx").write_text("".join(line + "\n" for line in TGT[:4]))
    code, _, stderr = run(*tiny_train(prefix, tmp_path / "m"))
    assert_one_line_error(code, stderr, f"{prefix}.en has 5 lines", f"{prefix}.xx has 4")
    assert not (tmp_path / "m").exists()


def test_train_skips_and_reports_empty_pairs(tmp_path):
    src, tgt = [*SRC[:40], "", " \t", SRC[40]], [*TGT[:40], TGT[41], TGT[42], "   "]
    code, _, stderr = run(*tiny_train(write_parallel(tmp_path / "p", src, tgt), tmp_path / "m"))
    assert code == 0, stderr
    assert "training pairs: {'kept': 40, 'empty': 3, 'too_long': 0}" in stderr


def test_train_non_utf8_is_an_error_unless_replaced(tmp_path):
    prefix = write_parallel(tmp_path / "p", SRC[:40], TGT[:40])
    lines = Path(f"{prefix}.en").read_bytes().split(b"\n")
    lines[6] += b" caf\xe9"  # Latin-1 on line 7
    Path(f"{prefix}.en").write_bytes(b"\n".join(lines))
    code, _, stderr = run(*tiny_train(prefix, tmp_path / "m"))
    assert_one_line_error(code, stderr, f"{prefix}.en:7: not UTF-8", "--encoding-errors replace")
    code, _, stderr = run(*tiny_train(prefix, tmp_path / "m", "--encoding-errors", "replace"))
    assert code == 0, stderr


def corpus_of(tokenizer: Tokenizer, n: int) -> Corpus:
    """The first n pairs, no validation data."""
    return Corpus(SRC[:n], TGT[:n])


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_filters_long_pairs_with_a_count(tokenizer, tmp_path):
    corpus = corpus_of(tokenizer, 40)
    ids = list(zip(tokenizer.encode_src(corpus.train_src), tokenizer.encode_tgt(corpus.train_tgt)))
    max_len = sorted(max(len(s), len(t)) for s, t in ids)[30]
    longer = sum(max(len(s), len(t)) > max_len for s, t in ids)
    cfg = TrainConfig(max_len=max_len, max_updates=1, dtype="fp32")
    run_train(tmp_path, tiny_model(tokenizer).config, cfg, tokenizer, corpus)
    (data,) = [r for r in read_metrics(tmp_path) if r.get("event") == "data"]
    assert data["too_long"] == longer > 0 and data["pairs"] == 40 - longer


BOUNDED = TrainConfig(max_updates=1, dtype="fp32")  # should the check be missing, the test still ends


def test_learned_positions_refuse_what_cannot_fit_before_training(tokenizer, tmp_path):
    model_config = tiny_model(tokenizer, positions="learned", max_positions=64).config
    with pytest.raises(ValueError, match=r"max_len=256 is more than max_positions=64.*--set max_len=64"):
        run_train(tmp_path / "run", model_config, BOUNDED, tokenizer, corpus_of(tokenizer, 40))
    corpus = Corpus(SRC[:40], TGT[:40], ["a short one", " ".join(SRC[:20])], ["one", "two"])
    with pytest.raises(ValueError, match=r"validation line 2 has \d+ tokens, more than max_positions=64"):
        run_train(tmp_path / "run", model_config, replace(BOUNDED, max_len=64), tokenizer, corpus)
    assert not (tmp_path / "run").exists()  # refused before anything was written


# --- Bad input: translation ------------------------------------------------------------------------------


def without_eos(model: Transformer) -> Transformer:
    """EOS gets logit 0 where the other 299 are spread around it: it never wins, outputs run to the limit."""
    with torch.no_grad():
        model.generator.weight[EOS_ID] = 0.0
    return model


def test_sinusoidal_model_translates_inputs_longer_than_max_positions_in_full(tokenizer):
    """The sinusoid table extends (§3.5): the same weights with a table of 1024 give the same output."""
    short_table = without_eos(tiny_model(tokenizer, max_positions=16))
    long_table = tiny_model(tokenizer, max_positions=1024)
    long_table.load_state_dict(short_table.state_dict())
    ids = tokenizer.encode_src([" ".join(SRC[:4]), SRC[5]])
    assert len(ids[0]) > 3 * 16
    config = SearchConfig(beam_size=2, max_len_b=20)
    got = Translator(short_table, tokenizer).translate_ids(ids, config)
    assert [len(h[0].tokens) for h in got] == [len(x) + 20 for x in ids]  # the decoder passes 16 too
    assert got == Translator(long_table, tokenizer).translate_ids(ids, config)


def test_learned_positions_refuse_a_long_input_and_cap_the_output(tokenizer):
    model = without_eos(tiny_model(tokenizer, positions="learned", max_positions=16))
    translator = Translator(model, tokenizer, SearchConfig(beam_size=2))
    long = " ".join(SRC[:3])
    n = len(tokenizer.encode_src([long])[0])
    with pytest.raises(ValueError, match=rf"input line 2 has {n} tokens, more than max_positions=16"):
        translator.translate(["a dog", long, "a cat"])
    # input + 50 tokens would pass the last learned position: outputs stop there instead of failing
    hyps = translator.translate_ids(tokenizer.encode_src(["a dog", "a cat sees"]), SearchConfig(beam_size=2))
    assert [len(h[0].tokens) for h in hyps] == [16, 16]


def test_unknown_characters_and_empty_lines_give_one_output_each_in_order(tokenizer):
    word = Tokenizer.train(SRC, TGT, vocab_size=300, kind="word")
    inputs = ["", "ßüñ 漢字 🙂 \x00\x07", SRC[0], "   ", "</s> <pad> <unk>", "", "\u2028\u0301\ufeff"]
    for tok in (tokenizer, word):
        torch.manual_seed(0)
        model = Transformer(preset("tiny", vocab_size=tok.src_vocab_size, d_model=32, d_ff=64)).eval()
        translator = Translator(model, tok, SearchConfig(beam_size=2, max_len_b=10))
        outputs = translator.translate(inputs)
        assert len(outputs) == len(inputs) and outputs[0] == outputs[5] == ""
        assert outputs == [translator.translate([text])[0] for text in inputs]  # in order


# --- Bad input: the command line -------------------------------------------------------------------------


def test_a_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    assert_one_line_error(*run("translate", tmp_path)[::2], f"{tmp_path}: not a model directory")


@pytest.mark.parametrize(
    "edit,needles",
    [
        (lambda c: {**c, "d_modle": 32}, ["unknown ModelConfig key(s) ['d_modle']"]),
        (lambda c: {**c, "n_heads": "4"}, ["ModelConfig.n_heads: expected an integer, got '4'"]),
        (lambda c: {**c, "dropout": None}, ["ModelConfig.dropout: expected a finite number"]),
    ],
)
def test_translate_with_a_bad_config_json(model_dir, tmp_path, edit, needles):
    broken = tmp_path / "model"
    broken.mkdir()
    for path in model_dir.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    config = broken / checkpoint.CONFIG
    config.write_text(json.dumps(edit(json.loads(config.read_text()))))
    assert_one_line_error(*run("translate", broken, "--quiet")[::2], str(config), *needles)


@pytest.mark.parametrize(
    "extra,needles",
    [
        (["--valid", "{root}/missing"], ["{root}/missing.en"]),
        (["--config", "{root}/missing.yaml"], ["{root}/missing.yaml: no such file"]),
        (["--config", "{root}/typo.yaml"], ["{root}/typo.yaml: unknown key(s) ['warmup']"]),
        (["--set", "positions=absolute"], ["expected one of ['sinusoidal', 'learned']"]),
    ],
)
def test_train_argument_errors(tmp_path, extra, needles):
    (tmp_path / "typo.yaml").write_text("warmup: 100\n")
    prefix = write_parallel(tmp_path / "p", SRC[:20], TGT[:20])
    extra = [e.format(root=tmp_path) for e in extra]
    code, _, stderr = run(*tiny_train(prefix, tmp_path / "m", *extra))
    assert_one_line_error(code, stderr, *(n.format(root=tmp_path) for n in needles))
    assert not (tmp_path / "m").exists()


def test_debug_shows_the_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "aiayn", "--debug", "translate", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.rstrip().endswith(f"ValueError: {tmp_path / 'nope'}: not a directory")


# --- Bad input: files that must not be trusted ------------------------------------------------------------


class RunsCode:
    """Unpickling this calls os.mkdir(marker): what a hostile state.pt could do with any function."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_a_state_file_that_would_run_code_is_refused(model_dir, tmp_path):
    marker = tmp_path / "code-ran"
    state = tmp_path / checkpoint.STATE
    torch.save({"progress": {"step": 1}, "payload": RunsCode(marker)}, state)
    with pytest.raises(ValueError, match=re.escape(f"{state}: cannot read training state")):
        checkpoint.load_state(tmp_path)
    assert not marker.exists()
    torch.load(state, weights_only=False)  # the test has teeth: an unsafe load would have run it
    assert marker.is_dir()


def test_a_tokenizer_of_another_size_is_refused_at_load(model_dir, tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    for path in model_dir.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    Tokenizer.train(SRC, TGT, vocab_size=280).save(directory)
    with pytest.raises(ValueError, match=r"tokenizer vocabulary sizes \(280, 280\) differ .* \(300, 300\)"):
        Translator.load(directory, device="cpu")


# --- Faults: a crash while saving ---------------------------------------------------------------------------


def crash_while_writing_weights(monkeypatch) -> None:
    """safetensors writes half of the file, then the process "dies" (an exception in its place)."""
    real = safetensors.torch.save_file

    def half_then_crash(tensors, filename, *args, **kwargs):
        real(tensors, filename, *args, **kwargs)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])
        raise OSError("simulated crash")

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_crash)


STATE_1 = {"optimizer": {}, "progress": {"step": 1}, "rng": {}}


def test_a_crash_while_saving_keeps_the_previous_checkpoint_and_model(tokenizer, tmp_path, monkeypatch):
    old, new = tiny_model(tokenizer), tiny_model(tokenizer)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(1.0)
    checkpoint.save_model(tmp_path, old, tokenizer)
    checkpoint.save_checkpoint(tmp_path, 1, old, tokenizer, TrainConfig(), STATE_1)
    crash_while_writing_weights(monkeypatch)
    with pytest.raises(OSError, match="simulated crash"):
        checkpoint.save_checkpoint(tmp_path, 2, new, tokenizer, TrainConfig(), STATE_1)
    with pytest.raises(OSError, match="simulated crash"):
        checkpoint.save_model(tmp_path, new, tokenizer)
    monkeypatch.undo()

    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000001"]
    assert checkpoint.load_state(checkpoint.list_checkpoints(tmp_path)[0]) == STATE_1
    for directory in (tmp_path, checkpoint.list_checkpoints(tmp_path)[0]):
        loaded = Translator.load(directory, device="cpu").model
        assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), old.parameters()))
    leftovers = [p.name for p in [*tmp_path.iterdir(), *(tmp_path / "checkpoints").iterdir()]]
    assert not [name for name in leftovers if name.startswith(".")]  # no temporaries left behind


def test_force_starts_over_without_the_old_runs_checkpoints(tmp_path):
    """A forced new run must not keep the old run's checkpoints (a later --resume would pick them up)."""
    prefix = write_parallel(tmp_path / "p", SRC[:40], TGT[:40])
    out = tmp_path / "m"
    assert run(*tiny_train(prefix, out, "--max-updates", 3))[0] == 0
    old_size = Tokenizer.load(out).src_vocab_size
    code, _, stderr = run(*tiny_train(prefix, out, "--force", "--vocab-size", 280))
    assert code == 0, stderr
    assert [p.name for p in checkpoint.list_checkpoints(out)] == ["step_00000001"]
    assert [r["step"] for r in read_metrics(out) if r.get("event") == "stop"] == [1]
    new_size = Translator.load(out, device="cpu").model.config.src_vocab_size  # config and tokenizer agree
    assert new_size == Tokenizer.load(out).src_vocab_size < old_size


def test_resume_of_a_run_killed_before_its_first_checkpoint(model_dir, tmp_path):
    """Such a run left config, tokenizer and weights but no checkpoint: say so, rather than "use --resume"."""
    prefix = write_parallel(tmp_path / "p", SRC[:20], TGT[:20])
    out = tmp_path / "m"
    out.mkdir()
    for path in model_dir.iterdir():
        (out / path.name).write_bytes(path.read_bytes())
    code, _, stderr = run(*tiny_train(prefix, out, "--resume"))
    assert_one_line_error(code, stderr, f"{out} holds a model but no checkpoint to resume from: use --force")


# --- Faults: killed, interrupted ----------------------------------------------------------------------------

# One thread, like the tests in this process, so that the subprocesses compute bit for bit alike.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def cli(*argv) -> list[str]:
    return [sys.executable, "-m", "aiayn", *map(str, argv)]


def run_argv(prefix: Path, out: Path, max_updates: int) -> list:
    flags = ["--valid", f"{prefix}-valid", "--preset", "tiny", "--vocab-size", 300, "--max-tokens", 500]
    settings = [f"--set={s}" for s in ("dtype=fp32", "valid_every=5", "warmup_steps=10", "dropout=0.1")]
    return train_argv(prefix, out, *flags, "--max-updates", max_updates, *settings)


@pytest.fixture(scope="module")
def run_data(tmp_path_factory) -> Path:
    prefix = tmp_path_factory.mktemp("runs") / "train"
    write_parallel(prefix, SRC[:300], TGT[:300])
    write_parallel(Path(f"{prefix}-valid"), SRC[300:310], TGT[300:310])
    return prefix


@contextlib.contextmanager
def training(argv: list, out: Path, step: int) -> Iterator[subprocess.Popen]:
    """`aiayn train` in a subprocess, yielded once it has written a checkpoint at `step` or later;
    killed on the way out if it is still running (a failing test leaves no process behind)."""
    proc = subprocess.Popen(cli(*argv), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any(int(p.name[5:]) >= step for p in checkpoint.list_checkpoints(out)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 60 s"
            time.sleep(0.02)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_sigkill_then_resume_gives_bit_identical_weights(run_data, tmp_path):
    final = f"{checkpoint.CHECKPOINTS}/step_00000030/{checkpoint.WEIGHTS}"
    reference = tmp_path / "uninterrupted"
    code, _, stderr = run(*run_argv(run_data, reference, 30))
    assert code == 0, stderr
    epochs = [r["epoch"] for r in read_metrics(reference) if "valid_bleu" in r]
    assert epochs[1] == 0 and epochs[-1] >= 1  # so killing after update 10 is mid-epoch

    out = tmp_path / "killed"
    with training(run_argv(run_data, out, 30), out, 10) as proc:
        proc.kill()  # SIGKILL: no handler runs, nothing is saved on the way out
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / final).exists()  # it really stopped before the end

    resumed = subprocess.run(
        cli(*run_argv(run_data, out, 30), "--resume"), env=ENV, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr
    resumes = [r for r in read_metrics(out) if r.get("event") == "resume"]
    assert len(resumes) == 1 and 10 <= resumes[0]["step"] < 30
    for kind in ("loss", "valid_bleu"):  # what the killed run logged after its checkpoint is not repeated
        assert [r["step"] for r in read_metrics(out) if kind in r] == [
            r["step"] for r in read_metrics(reference) if kind in r
        ], kind
    want, got = (safetensors.torch.load_file(str(d / final)) for d in (reference, out))
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_a_resumable_checkpoint_and_exits_128_plus_its_number(run_data, tmp_path, sig):
    out = tmp_path / "run"
    with training(run_argv(run_data, out, 100_000), out, 5) as proc:
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig.value, stderr
    assert "Traceback" not in stderr
    result = json.loads(stdout.splitlines()[-1])
    assert result["reason"] == f"signal {sig.name}"
    last = checkpoint.list_checkpoints(out)[-1]
    assert last.name == f"step_{result['step']:08d}"
    assert (
        f"stopped by {sig.name} after update {result['step']}; saved {last}; {out} holds the model" in stderr
    )
    assert "--resume" in stderr
    assert checkpoint.load_state(last)["progress"]["step"] == result["step"]
    Translator.load(last, device="cpu")


# --- Faults: non-finite loss, out of memory -----------------------------------------------------------------


def nan_loss_at(update: int, monkeypatch) -> list[int]:
    """Make the loss NaN at one update (no validation data, so every loss call is a training update)."""
    real, calls = train_module.label_smoothed_loss, []

    def patched(logits, target, epsilon, never=None):
        loss, nll = real(logits, target, epsilon, never)
        calls.append(1)
        return (loss * float("nan"), nll) if len(calls) == update else (loss, nll)

    monkeypatch.setattr(train_module, "label_smoothed_loss", patched)
    return calls


NONFINITE = dict(max_updates=6, valid_every=2, dtype="fp32", max_tokens=300, warmup_steps=4)


def test_a_nonfinite_loss_stops_naming_the_update_and_keeps_the_last_checkpoint(
    tokenizer, tmp_path, monkeypatch
):
    nan_loss_at(5, monkeypatch)
    model_config = tiny_model(tokenizer).config
    with pytest.raises(ValueError, match=r"update 5: the loss is nan \(not finite\).*skip_nonfinite=true"):
        run_train(tmp_path, model_config, TrainConfig(**NONFINITE), tokenizer, corpus_of(tokenizer, 60))
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000004"]
    last = checkpoint.list_checkpoints(tmp_path)[-1]
    assert checkpoint.load_state(last)["progress"]["step"] == 4
    for directory in (last, tmp_path):
        model = Translator.load(directory, device="cpu").model
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skip_nonfinite_skips_the_batch_and_goes_on(tokenizer, tmp_path, monkeypatch):
    calls = nan_loss_at(5, monkeypatch)
    cfg = TrainConfig(skip_nonfinite=True, **NONFINITE)
    result = run_train(tmp_path, tiny_model(tokenizer).config, cfg, tokenizer, corpus_of(tokenizer, 60))
    assert result.step == 6 and len(calls) == 7  # the skipped batch is not an update
    assert {"event": "skip_nonfinite", "update": 5} in read_metrics(tmp_path)
    model = checkpoint.load_model(checkpoint.list_checkpoints(tmp_path)[-1])
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
    ],
)
def test_out_of_memory_names_the_flag_to_lower(tokenizer, tmp_path, monkeypatch, error):
    def forward(self, src, tgt_in, where=None):
        raise error

    monkeypatch.setattr(Transformer, "forward", forward)
    cfg = TrainConfig(max_updates=1, dtype="fp32", max_tokens=300)
    with pytest.raises(ValueError, match=r"update 1: out of memory .*lower --max-tokens \(e\.g\. 150\)"):
        run_train(tmp_path, tiny_model(tokenizer).config, cfg, tokenizer, corpus_of(tokenizer, 20))


def test_other_runtime_errors_are_not_called_out_of_memory(tokenizer, tmp_path, monkeypatch):
    def forward(self, src, tgt_in, where=None):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(Transformer, "forward", forward)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        cfg = TrainConfig(max_updates=1)
        run_train(tmp_path, tiny_model(tokenizer).config, cfg, tokenizer, corpus_of(tokenizer, 20))


# --- A full disk ---------------------------------------------------------------------------------------


def reference_run(tmp_path: Path) -> tuple[Path, list]:
    """Three updates of a tiny model validated at each, uninterrupted, into tmp_path/ref: (the corpus
    prefix, the flags), for a run that a fault interrupts to be compared with."""
    prefix = write_parallel(tmp_path / "c", SRC[:200], TGT[:200])
    flags = [
        "--max-updates",
        3,
        "--set",
        "valid_every=1",
        "--valid",
        write_parallel(tmp_path / "v", SRC[200:220], TGT[200:220]),
    ]
    code, _, stderr = run(*tiny_train(prefix, tmp_path / "ref", *flags))
    assert code == 0, stderr
    return prefix, flags


def assert_same_weights(want: Path, got: Path) -> None:
    """The model directories hold bit-identical weights."""
    a, b = (safetensors.torch.load_file(str(d / "model.safetensors")) for d in (want, got))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("save", ["save_checkpoint", "save_model"])
def test_a_full_disk_at_a_save_is_one_line_and_the_run_resumes_to_the_same_weights(
    small_disk, tmp_path, monkeypatch, save
):
    """The disk fills while update 2's checkpoint, or OUT's model, is written (torch.save's RuntimeError
    and safetensors' SafetensorError were tracebacks): one line naming what was being written and what
    to do; with the space back, --resume ends with the weights of a run that never stopped. A resume on
    the still-full disk is one line too."""
    prefix, flags = reference_run(tmp_path)
    from aiayn.training.run import Run

    owner = checkpoint if save == "save_checkpoint" else Run  # update 2's checkpoint; OUT's first model
    out, real, filler, calls = small_disk / "run", getattr(owner, save), [], []

    def save_on_a_full_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) == (2 if owner is checkpoint else 1) and not filler:
            filler.append(fill(small_disk))
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(owner, save, save_on_a_full_disk)
        code, _, stderr = run(*tiny_train(prefix, out, *flags))
    named = out / "checkpoints" / "step_00000002" if owner is checkpoint else out / "model.safetensors"
    assert_one_line_error(code, stderr, str(named), "disk is full", "--resume")
    code, _, stderr = run(*tiny_train(prefix, out, *flags, "--resume"))
    assert_one_line_error(code, stderr, str(out), "disk is full")
    filler[0].unlink()
    code, _, stderr = run(*tiny_train(prefix, out, *flags, "--resume"))
    assert code == 0, stderr
    assert_same_weights(tmp_path / "ref", out)


def contents(directory: Path) -> dict[str, bytes]:
    """Every file under directory by relative path: what "byte for byte as it was" compares."""
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def test_prepare_and_export_on_a_full_disk_are_one_line_and_keep_what_they_replace(
    small_disk, tmp_path, model_dir
):
    """prepare's corpus and the CTranslate2 and Keras exports, replacing (--force) what an earlier
    command wrote, on a full disk: one line naming the output; the earlier output byte for byte as it
    was; no temporary left on the disk."""
    prefix = write_parallel(tmp_path / "c", SRC[:200], TGT[:200])
    commands = [("prepare", "--train", prefix, "--src-lang", "en", "--tgt-lang", "xx", "--vocab-size", 300,
                 "--out", small_disk / "prepared")]  # fmt: skip
    for package, form, dest in [("ctranslate2", "ctranslate2", "ct2"), ("keras", "keras", "m.keras")]:
        if importlib.util.find_spec(package) is not None:
            commands.append(("export", model_dir, "--format", form, "--out", small_disk / dest))
    for command in commands:
        code, _, stderr = run(*command)
        assert code == 0, stderr
    before = contents(small_disk)
    filler = fill(small_disk)
    for command in commands:
        code, _, stderr = run(*command, "--force")
        assert_one_line_error(code, stderr, str(command[-1]), "disk is full")
    filler.unlink()
    assert contents(small_disk) == before


def test_outputs_on_a_full_disk_are_one_line_and_keep_what_they_replace(small_disk, tmp_path):
    """translate's output, the plots, an average replacing a model (--force) and a shortlist replacing
    a model's vmap.txt, on a full disk: one line naming the file and what to do; what they would have
    replaced byte for byte as it was."""
    prefix = write_parallel(tmp_path / "c", SRC[:200], TGT[:200])
    valid = write_parallel(tmp_path / "v", SRC[200:220], TGT[200:220])
    run_dir = tmp_path / "run"
    flags = ["--max-updates", 2, "--set", "valid_every=1", "--valid", valid]
    code, _, stderr = run(*tiny_train(prefix, run_dir, *flags))
    assert code == 0, stderr
    source = tmp_path / "source.txt"
    source.write_text("".join(line + "\n" for line in SRC[:3]))
    model, translation, plots = small_disk / "model", small_disk / "out.txt", small_disk / "plots"
    commands = [
        ("average", run_dir, "--last", 2, "--out", model, "--force"),
        ("shortlist", model, "--data", run_dir / "data"),
        ("translate", model, "--input", source, "--output", translation),
        ("plot", run_dir, "--out", plots, "--sentence", SRC[0]),
    ]
    for command in commands:
        code, _, stderr = run(*command)
        assert code == 0, stderr
    before = contents(small_disk)
    filler = fill(small_disk)
    for command, named in zip(commands, [model, model / "vmap.txt", translation, plots]):
        code, _, stderr = run(*command)
        assert_one_line_error(code, stderr, str(named), "disk is full")
    filler.unlink()
    assert contents(small_disk) == before


# --- OUT changed under a run -------------------------------------------------------------------------


@pytest.mark.parametrize("change", ["read-only", "model replaced", "out removed"])
def test_out_changed_under_the_run_is_one_line_and_what_was_saved_resumes(
    small_disk, tmp_path, monkeypatch, change
):
    """While a run trains, its disk turns read-only, OUT's model is replaced by a directory, or OUT is
    removed: one line naming the path (never a checkpoint re-made in a new, empty OUT); once the disk
    is writable again or the directory moved away, --resume ends with the weights of a run that never
    stopped."""
    prefix, flags = reference_run(tmp_path)
    out = small_disk / "run"
    from aiayn.training.run import Run

    real, calls = Run.save_checkpoint, []

    def changed_at_the_second(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            if change == "read-only":
                subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
            elif change == "model replaced":
                (out / "model.safetensors").unlink()
                (out / "model.safetensors").mkdir()
            else:
                shutil.rmtree(out)
        return real(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Run, "save_checkpoint", changed_at_the_second)
        code, _, stderr = run(*tiny_train(prefix, out, *flags))
    if change == "out removed":
        assert_one_line_error(code, stderr, str(out), "removed or moved away while the run went on")
        assert not out.exists()
        return
    if change == "read-only":
        assert_one_line_error(
            code, stderr, str(out / "checkpoints" / "step_00000002"), "read-only", "--resume"
        )
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    else:  # the third update's validation is no better: the end of the run rewrites OUT's model
        assert_one_line_error(code, stderr, str(out / "model.safetensors"), "directory is in its place")
        (out / "model.safetensors").rmdir()
    code, _, stderr = run(*tiny_train(prefix, out, *flags, "--resume"))
    assert code == 0, stderr
    assert_same_weights(tmp_path / "ref", out)
