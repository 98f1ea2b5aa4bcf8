"""Installing only what is used: the core (prepare, train, translate, evaluate) imports and runs with every
optional package missing, and each command or flag that needs one ends, before any work, with one line
naming the `pip install 'aiayn[EXTRA]'` that brings it.

A package is made missing in a child process by setting sys.modules[NAME] = None (import then raises
ImportError and importlib.util.find_spec answers None). One child runs every case, a few seconds in all."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_one_line_error, free_port, write_lines, write_parallel

from aiayn import checkpoint
from aiayn.config import preset
from aiayn.data.synthetic import generate
from aiayn.extras import need
from aiayn.model import Transformer
from aiayn.tokenizer import Tokenizer

# What the extras bring, and what uvicorn and FastAPI pull in beside them
OPTIONAL = (
    "fastapi", "starlette", "pydantic", "uvicorn", "httptools", "uvloop", "prometheus_client", "datasets",
    "matplotlib", "ctranslate2", "keras", "tensorboard", "transformers", "optimum", "onnx", "onnxruntime",
    "sentencepiece",
)  # fmt: skip
SERVE = ("fastapi", "uvicorn", "prometheus_client")
# The modules that belong to an extra: the rest of the package is the core
EXTRA_MODULES = ("serving", "interop", "inference.plots", "training.demo")

# In the child: the core's modules imported with every optional package missing, then each case,
# {"missing": [...], "argv": [...]}, through aiayn's main() in this one process.
CHILD = """
import contextlib, io, json, pkgutil, sys, traceback
import aiayn
cases = json.loads(open(sys.argv[1]).read())
optional, extra_modules = cases.pop(0)
for name in optional:
    sys.modules[name] = None
core = [m.name for m in pkgutil.walk_packages(aiayn.__path__, "aiayn.")
        if not any(m.name.startswith("aiayn." + e) for e in extra_modules)]
for name in core:
    __import__(name)
from aiayn.cli.main import main
for name in optional:
    del sys.modules[name]
results = []
for case in cases:
    for name in case["missing"]:
        sys.modules[name] = None
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(case["argv"])
        except BaseException:  # what main() let through: the case fails, not the others
            code = None
            traceback.print_exc()
    for name in case["missing"]:
        del sys.modules[name]
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps({"core": core, "results": results}))
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A tiny untrained model, a small parallel corpus and a test set."""
    root = tmp_path_factory.mktemp("extras")
    src, tgt = generate(330, seed=4)
    write_parallel(root / "train", src[:300], tgt[:300])
    write_lines(root / "test.en", src[300:])
    write_lines(root / "test.xx", tgt[300:])
    tokenizer = Tokenizer.train(src, tgt, vocab_size=300)
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=tokenizer.src_vocab_size, d_model=32, d_ff=64)).eval()
    checkpoint.save_model(root / "model", model, tokenizer)
    (root / "opus").mkdir()  # what aiayn import recognises as OPUS-MT's, before reading any of it
    (root / "opus" / "config.json").write_text("{}")
    (root / "opus" / "source.spm").write_bytes(b"")
    return root


TRAIN = (
    "train --train {root}/train --src-lang en --tgt-lang xx --preset tiny --vocab-size 300 --max-updates 1 "
)
# case: (missing packages, the command ({root}: the work directory), the line's start, its extra, what
# must not exist after it)
REFUSALS = {
    **{
        f"serve without {name}": (
            (name,), "serve {root}/model --port {port}", f"aiayn serve needs the {name} package", "serve", None,
        )
        for name in SERVE
    },
    "serve --engine ctranslate2": (
        ("ctranslate2",), "serve {root}/model --port {port} --engine ctranslate2",
        "--engine ctranslate2 needs the ctranslate2 package", "ctranslate2", None,
    ),
    "plot": (
        ("matplotlib",), "plot {root}/model --sentence bird --out {root}/plots",
        "aiayn plot needs the matplotlib package", "plots", "plots",
    ),
    "demo": (("matplotlib",), "demo --out {root}/demo", "aiayn demo needs the matplotlib package", "plots", "demo"),
    "train --tensorboard": (
        ("tensorboard",), TRAIN + "--out {root}/tb --tensorboard",
        "--tensorboard needs the tensorboard package", "tensorboard", "tb",
    ),
    "train --train hf:": (
        ("datasets",), TRAIN + "--out {root}/hf --train hf:opus_books:de-en",
        "hf:opus_books:de-en (a Hugging Face dataset) needs the datasets package", "hf", "hf",
    ),
    "train --valid hf:": (
        ("datasets",), TRAIN + "--out {root}/hfv --valid hf:json",
        "hf:json (a Hugging Face dataset) needs the datasets package", "hf", "hfv",
    ),
    "prepare --train hf:": (
        ("datasets",), "prepare --train hf:wmt14 --src-lang de --tgt-lang en --out {root}/prep",
        "hf:wmt14 (a Hugging Face dataset) needs the datasets package", "hf", "prep",
    ),
    "export --format ctranslate2": (
        ("ctranslate2",), "export {root}/model --format ctranslate2 --out {root}/ct2",
        "--format ctranslate2 needs the ctranslate2 package", "ctranslate2", "ct2",
    ),
    "export --format transformers": (
        ("transformers",), "export {root}/model --format transformers --out {root}/hf",
        "--format transformers needs the transformers package", "transformers", "hf",
    ),
    "export --format onnx": (
        ("onnxruntime",), "export {root}/model --format onnx --out {root}/onnx",
        "--format onnx needs the onnxruntime package", "onnx", "onnx",
    ),
    "import": (
        ("transformers",), "import {root}/model --out {root}/imported",
        "aiayn import needs the transformers package", "transformers", "imported",
    ),
    "import of OPUS-MT's": (
        ("sentencepiece",), "import {root}/opus --out {root}/imported-opus",
        "a SentencePiece vocabulary (source.spm) needs the sentencepiece package", "sentencepiece", "imported-opus",
    ),
    "export --format keras": (
        ("keras",), "export {root}/model --format keras --out {root}/m.keras",
        "--format keras needs the keras package", "keras", "m.keras",
    ),
}  # fmt: skip
# The core's commands, run with every optional package missing
CORE = {
    "train": TRAIN + "--out {root}/core-run --set dtype=fp32",
    "translate": "translate {root}/model --input {root}/test.en --output {root}/hyp.xx",
    "evaluate": "evaluate {root}/model --src {root}/test.en --ref {root}/test.xx",
}


@pytest.fixture(scope="module")
def child(workdir) -> dict:
    """Every case run once in one child process: {"core": modules imported, case: its code, stdout, stderr}."""
    port = free_port()  # (nothing listens: each serve stops before it binds)
    cases = [(missing, command) for missing, command, *_ in REFUSALS.values()]
    cases += [(OPTIONAL, command + " --quiet") for command in CORE.values()]
    spec = workdir / "cases.json"
    spec.write_text(json.dumps([[OPTIONAL, EXTRA_MODULES], *(
        {"missing": missing, "argv": [a.format(root=workdir, port=port) for a in command.split()]}
        for missing, command in cases
    )]))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(spec)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.splitlines()[-1])
    return {"core": answer["core"], **dict(zip([*REFUSALS, *CORE], answer["results"]))}


def test_the_core_imports_without_any_extra(child):
    """Every module outside serving/, interop/, the plots and the demo, with every optional package missing
    (the child would have failed otherwise); the command line's main among them."""
    assert "aiayn.cli.main" in child["core"] and "aiayn.data.corpus" in child["core"]
    assert len(child["core"]) > 20, child["core"]


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_command_that_needs_an_extra_says_which_before_any_work(workdir, child, case):
    _, _, line, extra, after = REFUSALS[case]
    result = child[case]
    assert_one_line_error(result["code"], result["stderr"], f"{line}: pip install 'aiayn[{extra}]'")
    assert result["stderr"].startswith("aiayn: error: "), result["stderr"]  # nothing said before it
    assert result["stdout"] == ""
    if after is not None:
        assert not (workdir / after).exists()


def test_train_translate_and_evaluate_run_on_the_core_alone(workdir, child):
    for name in ("train", "translate", "evaluate"):
        assert child[name]["code"] == 0, (name, child[name]["stderr"][-2000:])
    assert (workdir / "core-run" / "config.json").is_file()
    hypotheses = (workdir / "hyp.xx").read_text(encoding="utf-8").splitlines()
    assert len(hypotheses) == 30
    assert "bleu" in json.loads(child["evaluate"]["stdout"].splitlines()[-1])


def test_need_names_the_first_missing_package_and_its_extra(monkeypatch):
    need("--format keras", "keras", "json", "sys")  # installed: nothing to say
    monkeypatch.setitem(sys.modules, "fastapi", None)
    with pytest.raises(ValueError) as raised:
        need("aiayn serve", "serve", "json", "fastapi", "no_such_module_here")
    assert str(raised.value) == "aiayn serve needs the fastapi package: pip install 'aiayn[serve]'"
