"""Every `aiayn` command walked with bad paths and bad values: each is one `aiayn: error:` line naming
the file, line or value, with exit status 2 and no traceback; none hangs, none is accepted silently.

The cases come from a black-box probe of the command line (about 235 inputs; 99 went wrong before
they were mended: tracebacks, hangs, values taken silently, data destroyed). Runs in this process, so a case
that trained or translated by mistake would show as a wrong exit status, not as a slow test.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import assert_one_line_error, run_cli, write_lines

from aiayn.data.synthetic import generate

TRAIN = ["--src-lang", "en", "--tgt-lang", "xx", "--preset", "tiny", "--vocab-size", 300, "--max-updates", 2]


@pytest.fixture(scope="module")
def w(tmp_path_factory) -> Path:
    """A world of inputs: a corpus, a trained tiny model and its damaged copies, odd files."""
    w = tmp_path_factory.mktemp("walk")
    src, tgt = generate(300, seed=1)
    write_lines(w / "c.en", src), write_lines(w / "c.xx", tgt)
    write_lines(w / "v.en", src[:5]), write_lines(w / "v.xx", tgt[:5])
    write_lines(w / "one.en", ["the dog"]), write_lines(w / "one.xx", tgt[:1])
    (w / "empty.en").write_text(""), (w / "empty.xx").write_text("")
    (w / "blank.en").write_text("\n\n"), (w / "blank.xx").write_text("\n\n")
    (w / "badutf.en").write_bytes(b"hello \xff\xfe world\n"), (w / "badutf.xx").write_text("x\n")
    write_lines(w / "mis.en", src[:3]), write_lines(w / "mis.xx", tgt[:2])
    (w / "bad.tsv").write_text("a\tb\nno tab here\n")
    (w / "gz.en.gz").write_bytes(b"\x1f\x8b not really gzip"), write_lines(w / "gz.xx", ["x"])
    (w / "afile").write_text("")
    (w / "adir").mkdir()
    (w / "bad.yaml").write_text("dropout: [0.1\n")
    (w / "list.yaml").write_text("- a\n- b\n")
    (w / "unk.yaml").write_text("nosuchkey: 1\n")
    (w / "badval.yaml").write_text('dropout: "abc"\n')
    (w / "ids.yaml").write_text("eos_id: 5\n")
    (w / "badutf.yaml").write_bytes(b"dropout: \xff\n")
    code, _, stderr = run_cli(["train", "--train", w / "c", *TRAIN, "--valid", w / "v", "--out", w / "m"] + [
        "--set", "valid_every=1", "--quiet"])  # fmt: skip
    assert code == 0, stderr
    m = w / "m"
    damaged = (
        "bad_config",
        "typed_config",
        "short_weights",
        "other_shape",
        "no_tok",
        "bad_tok",
        "bad_state",
        "short_ckpt",
    )
    for name in damaged:
        shutil.copytree(m, w / name)
    ckpt_weights = w / "short_ckpt/checkpoints/step_00000002/model.safetensors"
    ckpt_weights.write_bytes(ckpt_weights.read_bytes()[:1000])
    (w / "bad_config/config.json").write_text("{bad")
    config = json.loads((m / "config.json").read_text())
    (w / "typed_config/config.json").write_text(json.dumps({**config, "n_heads": "4"}))
    (w / "short_weights/model.safetensors").write_bytes((m / "model.safetensors").read_bytes()[:1000])
    (w / "other_shape/config.json").write_text(json.dumps({**config, "d_model": 32, "d_ff": 64}))
    (w / "no_tok/tokenizer.json").unlink()
    (w / "bad_tok/tokenizer.json").write_text('{"version": "1.0", "model":')
    (w / "bad_state/checkpoints/step_00000002/state.pt").write_bytes(b"garbage")
    # A run whose two checkpoints have the same config.json but weights of different shapes.
    shutil.copytree(m, w / "mixed")
    weights = w / "mixed/checkpoints/step_00000002/model.safetensors"
    tensors = safetensors.torch.load_file(str(weights))
    tensors["encoder.0.feed_forward.w_1.bias"] = torch.zeros(7)
    safetensors.torch.save_file(tensors, str(weights))
    (w / "metrics_dir").mkdir()
    shutil.copytree(m, w / "metrics_dir/run")
    (w / "metrics_dir/run/metrics.jsonl").unlink()
    (w / "metrics_dir/run/metrics.jsonl").mkdir()
    return w


T = "train --train {w}/c --src-lang en --tgt-lang xx --preset tiny --vocab-size 300 --max-updates 2 --quiet"
TR = "translate {w}/m --input {w}/one.en --quiet --beam-size 1"
EV = "evaluate {w}/m --src {w}/one.en --ref {w}/one.xx --quiet --beam-size 1"

CASES = {  # name: (command, words the one error line must hold)
    # train: configs and values
    "yaml malformed": (f"{T} --out {{w}}/o --config {{w}}/bad.yaml", ["bad.yaml:2", "not valid YAML"]),
    "yaml a list": (f"{T} --out {{w}}/o --config {{w}}/list.yaml", ["list.yaml: expected a mapping"]),
    "yaml unknown key": (f"{T} --out {{w}}/o --config {{w}}/unk.yaml", ["unk.yaml: unknown key(s) ['nosuchkey']"]),
    "yaml bad value": (f"{T} --out {{w}}/o --config {{w}}/badval.yaml", ["dropout: expected a finite number"]),
    "yaml special id": (f"{T} --out {{w}}/o --config {{w}}/ids.yaml", ["eos_id is not a setting"]),
    "yaml not utf-8": (f"{T} --out {{w}}/o --config {{w}}/badutf.yaml", ["badutf.yaml: not UTF-8"]),
    "yaml missing": (f"{T} --out {{w}}/o --config {{w}}/nope.yaml", ["nope.yaml: no such file"]),
    "yaml a directory": (f"{T} --out {{w}}/o --config {{w}}/adir", ["adir: is a directory"]),
    "set special id": (f"{T} --out {{w}}/o --set eos_id=5", ["eos_id is not a setting"]),
    "set vocab size": (f"{T} --out {{w}}/o --set src_vocab_size=270", ["src_vocab_size is not a setting here"]),
    "set max_positions huge": (f"{T} --out {{w}}/o --set max_positions=10000000000", ["max_positions must be at most"]),
    "set d_ff huge": (f"{T} --out {{w}}/o --set d_ff=10000000000", ["parameters", "d_ff=10000000000"]),
    "set d_model huge": (f"{T} --out {{w}}/o --set d_model=1000000 --set n_heads=1", ["parameters", "d_model=1000000"]),
    "set lr_scale negative": (f"{T} --out {{w}}/o --set lr_scale=-1", ["lr_scale must be positive"]),
    "set lr_scale nan": (f"{T} --out {{w}}/o --set lr_scale=nan", ["lr_scale", "finite"]),
    "set clip_norm negative": (f"{T} --out {{w}}/o --set clip_norm=-1", ["clip_norm must not be negative"]),
    "set seed negative": (f"{T} --out {{w}}/o --set seed=-1", ["seed must not be negative"]),
    "set adam beta": (f"{T} --out {{w}}/o --set adam_beta1=1.5", ["betas in [0, 1)"]),
    "max minutes negative": (f"{T} --out {{w}}/o --max-minutes -1", ["max_minutes must not be negative"]),
    "max minutes nan": (f"{T} --out {{w}}/o --max-minutes nan", ["max_minutes", "finite"]),
    "max tokens 0": (f"{T} --out {{w}}/o --max-tokens 0", ["max_tokens must be at least 1"]),
    "vocab size 5": (f"{T} --out {{w}}/o --vocab-size 5", ["vocab_size=5 is too small"]),
    "preset unknown": (f"{T} --out {{w}}/o --preset huge", ["unknown preset 'huge'"]),
    "share over two vocabularies": (f"{T} --out {{w}}/o --separate-vocab --set share_embeddings=true", ["needs one vocabulary"]),
    # train: data
    "train missing": ("train --train {w}/nope --src-lang en --tgt-lang xx --out {w}/o", ["no 'en' file for prefix"]),
    "train misaligned": ("train --train {w}/mis --src-lang en --tgt-lang xx --out {w}/o", ["mis.en has 3 lines", "mis.xx has 2"]),
    "train not utf-8": ("train --train {w}/badutf --src-lang en --tgt-lang xx --out {w}/o", ["badutf.en:1: not UTF-8"]),
    "train bad tsv": ("train --train {w}/bad.tsv --src-lang en --tgt-lang xx --out {w}/o", ["bad.tsv:2: expected source<TAB>target"]),
    "train bad gzip": ("train --train {w}/gz --src-lang en --tgt-lang xx --out {w}/o", ["gz.en.gz: not a readable gzip file"]),
    "train empty": ("train --train {w}/empty --src-lang en --tgt-lang xx --out {w}/o", ["no training pairs left"]),
    "train a directory": ("train --train {w}/adir --src-lang en --tgt-lang xx --out {w}/o", ["adir: is a directory"]),
    "valid empty": (f"{T} --out {{w}}/o --valid {{w}}/empty", ["empty: no validation pairs"]),
    "valid and fraction": (f"{T} --out {{w}}/o --valid {{w}}/v --valid-fraction 0.1", ["not both"]),
    "valid fraction 0": (f"{T} --out {{w}}/o --valid-fraction 0", ["fraction must be in (0, 1)"]),
    "hf empty name": ("train --train hf: --src-lang en --tgt-lang xx --out {w}/o", ["expected hf:NAME"]),
    "hf builder without files": ("train --train hf:json --src-lang en --tgt-lang xx --out {w}/o", ["hf:json reads local files", "--data-files"]),
    "hf empty directory": ("train --train hf:{w}/adir --src-lang en --tgt-lang xx --out {w}/o", ["adir"]),
    "data files malformed": (f"{T} --out {{w}}/o --data-files pairs.jsonl", ["expected SPLIT=PATH"]),
    # train: the run directory
    "out a file": (f"{T} --out {{w}}/afile", ["afile: exists and is not a directory"]),
    "out under a file": (f"{T} --out {{w}}/afile/m", ["afile is not a directory"]),
    "out holds a run": (f"{T} --out {{w}}/m", ["already holds a run", "--resume", "--force"]),
    "resume other settings": (f"{T} --out {{w}}/m --resume --valid {{w}}/v --set d_model=32", ["cannot resume", "model.d_model"]),
    "resume a model": (f"{T} --out {{w}}/bad_state/checkpoints/step_00000002 --resume", ["holds a model but no checkpoint"]),
    "resume corrupt state": (f"{T} --out {{w}}/bad_state --resume --valid {{w}}/v --set valid_every=1", ["state.pt: cannot read training state"]),
    "device unknown": (f"{T} --out {{w}}/o --device tpu", ["unknown device 'tpu'"]),
    "device cuda without a gpu": (f"{T} --out {{w}}/o --device cuda", ["CUDA is not available"]),
    "device a gpu that is not there": (f"{T} --out {{w}}/o --device cuda:99", ["device 'cuda:99'"]),
    "dtype fp16 on the cpu": (f"{T} --out {{w}}/o --device cpu --set dtype=fp16 --max-updates 1", ["fp16 is for CUDA"]),
    "nproc 0": (f"{T} --out {{w}}/o --nproc 0", ["--nproc must be at least 1"]),
    "data missing": ("train --data {w}/nope --out {w}/o", ["not a prepared corpus"]),
    "data and train": (f"{T} --out {{w}}/o --data {{w}}/m/data", ["--train", "--data", "not both"]),
    "neither data nor train": ("train --out {w}/o --src-lang en --tgt-lang xx", ["--train", "--data", "is needed"]),
    "train without languages": ("train --train {w}/c --out {w}/o", ["--train needs --src-lang and --tgt-lang"]),
    "data of other languages": ("train --data {w}/m/data --src-lang de --out {w}/o", ["--src-lang de, but", "prepared for en"]),
    # prepare
    "prepare out exists": ("prepare --train {w}/c --src-lang en --tgt-lang xx --out {w}/m", ["already exists; use --force"]),
    "prepare sample 0": ("prepare --train {w}/c --src-lang en --tgt-lang xx --out {w}/o --tokenizer-sample 0", ["--tokenizer-sample must be at least 1"]),
    "prepare train missing": ("prepare --train {w}/nope --src-lang en --tgt-lang xx --out {w}/o", ["no 'en' file"]),
    "prepare vocab size 5": ("prepare --train {w}/c --src-lang en --tgt-lang xx --out {w}/o --vocab-size 5", ["vocab_size=5 is too small"]),
    # translate
    "translate device unknown": ("translate {w}/m --input {w}/one.en --device tpu", ["unknown device 'tpu'"]),
    "translate fp16 on the cpu": ("translate {w}/m --input {w}/one.en --device cpu --dtype fp16", ["fp16 is for CUDA"]),
    "model missing": ("translate {w}/nope --input {w}/one.en", ["nope: not a directory"]),
    "model a file": ("translate {w}/afile --input {w}/one.en", ["afile: not a directory"]),
    "model no config": ("translate {w}/adir --input {w}/one.en", ["not a model directory (no config.json)"]),
    "model bad config": ("translate {w}/bad_config --input {w}/one.en", ["bad_config/config.json: not valid JSON"]),
    "model typed config": ("translate {w}/typed_config --input {w}/one.en", ["ModelConfig.n_heads: expected an integer"]),
    "model short weights": ("translate {w}/short_weights --input {w}/one.en", ["model.safetensors: cannot read model weights"]),
    "model other shape": ("translate {w}/other_shape --input {w}/one.en", ["weights do not fit config.json"]),
    "model no tokenizer": ("translate {w}/no_tok --input {w}/one.en", ["no tokenizer in"]),
    "model bad tokenizer": ("translate {w}/bad_tok --input {w}/one.en", ["tokenizer.json is not a valid tokenizer file"]),
    "input missing": ("translate {w}/m --input {w}/nope.en", ["nope.en: no such file"]),
    "input a directory": ("translate {w}/m --input {w}/adir", ["adir: is a directory"]),
    "input not utf-8": (f"{TR.replace('one.en', 'badutf.en')}", ["badutf.en:1: not UTF-8", "--encoding-errors replace"]),
    "output missing dir": (f"{TR} --output {{w}}/nodir/out.txt", ["nodir does not exist"]),
    "output a directory": (f"{TR} --output {{w}}/adir", ["adir: is a directory"]),
    "output under a file": (f"{TR} --output {{w}}/afile/out.txt", ["afile is not a directory"]),
    "output empty name": (f"{TR} --output=", ["file name is empty"]),
    "alpha nan": (f"{TR} --alpha nan", ["alpha", "finite"]),
    "alpha inf": (f"{TR} --alpha inf", ["alpha", "finite"]),
    "alpha negative": (f"{TR} --alpha -1", ["alpha must not be negative"]),
    "beam 0": (f"{TR.replace('--beam-size 1', '--beam-size 0')}", ["beam_size must be at least 1"]),
    "beam wider than the vocabulary": (f"{TR.replace('--beam-size 1', '--beam-size 100000')}", ["beam_size=100000 is more than the 300"]),
    "n-best 0": (f"{TR} --n-best 0", ["n_best must be in [1"]),
    "n-best negative": (f"{TR} --n-best -2", ["n_best must be in [1"]),
    "int8 as a dtype is fine but nan alpha is not": (f"{TR} --dtype int8 --alpha nan", ["alpha"]),
    # evaluate
    "eval src empty": ("evaluate {w}/m --src {w}/empty.en --ref {w}/empty.xx", ["empty.en: empty, nothing to evaluate"]),
    "eval refs blank": ("evaluate {w}/m --src {w}/blank.en --ref {w}/blank.xx", ["blank.xx: all 2 reference lines are blank"]),
    "eval misaligned": ("evaluate {w}/m --src {w}/c.en --ref {w}/one.xx", ["c.en has 300 lines but", "one.xx has 1"]),
    "eval ref missing": ("evaluate {w}/m --src {w}/one.en --ref {w}/nope.xx", ["nope.xx: no such file"]),
    "eval both stdin": ("evaluate {w}/m --src - --ref -", ["cannot both be standard input"]),
    "eval output missing dir": (f"{EV} --output {{w}}/nodir/h.txt", ["nodir does not exist"]),
    "eval alpha nan": (f"{EV} --alpha nan", ["alpha", "finite"]),
    # average
    "average missing run": ("average {w}/nope --last 1 --out {w}/o", ["nope: not a directory"]),
    "average last 0": ("average {w}/m --last 0 --out {w}/o", ["at least 1, got 0"]),
    "average too many": ("average {w}/m --last 5 --out {w}/o", ["the last 5 checkpoints, found 2"]),
    "average into its run": ("average {w}/m --last 1 --out {w}/m", ["cannot be written into the run it reads"]),
    "average onto a model": ("average {w}/m --last 1 --out {w}/bad_config", ["already exists; use --force"]),
    "average out a file": ("average {w}/m --last 1 --out {w}/afile", ["afile: exists and is not a directory"]),
    "average mixed shapes": ("average {w}/mixed --last 2 --out {w}/o", ["its tensors differ in names or shapes"]),
    "average bad weights": ("average {w}/short_ckpt --last 1 --out {w}/o", ["model.safetensors: cannot read model weights"]),
    # plot
    "plot missing model": ("plot {w}/nope", ["nope: no metrics.jsonl"]),
    "plot out a file": ("plot {w}/m --out {w}/afile", ["afile: exists and is not a directory"]),
    "plot metrics a directory": ("plot {w}/metrics_dir/run", ["no metrics.jsonl"]),
    "plot blank sentence": ("plot {w}/m --sentence ' '", ["--sentence is blank"]),
    "plot alpha nan": ("plot {w}/m --sentence 'the dog' --alpha nan", ["alpha", "finite"]),
    "plot not a model": ("plot {w}/adir --sentence 'the dog'", ["not a model directory"]),
    # demo
    "demo 0 minutes": ("demo --out {w}/o --minutes 0", ["more than 0 minutes"]),
    "demo negative minutes": ("demo --out {w}/o --minutes -1", ["more than 0 minutes"]),
    "demo nan minutes": ("demo --out {w}/o --minutes nan", ["more than 0 minutes"]),
    "demo out a file": ("demo --out {w}/afile", ["afile: exists and is not a directory"]),
}  # fmt: skip


def argv(template: str, w: Path) -> list[str]:
    import shlex

    return shlex.split(template.format(w=w))


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_bad_input_is_one_line(w, name):
    if name == "device cuda without a gpu" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is no mistake here")
    template, needles = CASES[name]
    code, _, stderr = run_cli(argv(template, w))
    assert_one_line_error(code, stderr, *needles)
    assert not (w / "o").exists()  # refused before anything was written


def test_the_cases_cover_every_command():
    commands = {template.split()[0] for template, _ in CASES.values()}
    assert commands == {
        "prepare",
        "train",
        "translate",
        "evaluate",
        "average",
        "plot",
        "demo",
    }  # export: below


def test_export_is_walked_too(w, tmp_path):
    pytest.importorskip("ctranslate2")
    parent = tmp_path / "parent"
    shutil.copytree(w / "m", parent / "model")
    (parent / "notes.txt").write_text("precious")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["export", parent / "model", "--out", parent, "--force"], ["cannot replace the model directory"]),
        (["export", w / "m", "--out", empty, "--force"], []),  # an empty directory may be replaced
        (["export", w / "m", "--out", w / "bad_config", "--force"], ["replaces only an earlier export"]),
        (["export", w / "m", "--out", w / "afile", "--force"], ["afile: exists and is not a directory"]),
        (["export", w / "m", "--out", w / "afile/x"], ["afile is not a directory"]),
        (["export", w / "short_weights", "--out", tmp_path / "x"], ["cannot read model weights"]),
        (
            ["export", w / "m", "--out", tmp_path / "y", "--quantization", "int3"],
            ["unknown quantization 'int3'"],
        ),
    ]
    for command, needles in cases:
        code, _, stderr = run_cli(command)
        if needles:
            assert_one_line_error(code, stderr, *needles)
        else:
            assert code == 0, stderr
    assert (parent / "notes.txt").read_text() == "precious" and (parent / "model" / "config.json").is_file()


def test_outputs_that_are_not_regular_files_are_written_to_not_replaced(w, tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    code, _, stderr = run_cli(argv(f"{TR} --output {link}", w))
    assert code == 0, stderr
    assert link.is_symlink() and target.read_text() != "old"  # through the link, which stays
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    code, _, stderr = run_cli(argv(f"{TR} --output {fifo}", w))
    assert code == 0, stderr
    assert reader.communicate(timeout=30)[0].decode() == target.read_text()
    assert fifo.is_fifo()  # still a pipe, not a file in its place


needs_setpriv = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to drop DAC override"
)


@needs_setpriv
def test_permissions_as_a_user_without_override(w, tmp_path):
    """As root the permission bits are not enforced; without CAP_DAC_OVERRIDE they are, as for a user."""
    unreadable = tmp_path / "noperm.en"
    shutil.copy(w / "one.en", unreadable)
    unreadable.chmod(0)
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    readonly.chmod(0o555)
    drop = [
        "setpriv",
        "--bounding-set",
        "-dac_override,-dac_read_search",
        "--inh-caps",
        "-dac_override,-dac_read_search",
    ]
    cases = [
        (["translate", w / "m", "--input", unreadable], [f"{unreadable}: not readable"]),
        (
            ["translate", w / "m", "--input", w / "one.en", "--output", readonly / "x"],
            [f"{readonly} is not writable"],
        ),
        (["train", "--train", w / "c", *TRAIN, "--out", readonly / "m"], [f"{readonly} is not writable"]),
    ]
    for command, needles in cases:
        proc = subprocess.run(
            [*drop, sys.executable, "-m", "aiayn", *map(str, command)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert_one_line_error(proc.returncode, proc.stderr, *needles)
