"""Shared test settings and helpers: one thread (tiny models run faster without threading overhead
on 2 cores), running the CLI in-process, and checking its one-line errors."""

import contextlib
import io

import torch

from aiayn.cli import main
from aiayn.prepare import MANIFEST, open_prepared, prepare_corpus
from aiayn.run import Run
from aiayn.train import Result, train

torch.set_num_threads(1)


def run_cli(argv: list) -> tuple[int, str, str]:
    """aiayn's main() in this process; (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code: int, stderr: str, *needles: str) -> None:
    """Exit status 2, no traceback, exactly one `aiayn: error:` line, last, holding every needle."""
    assert code == 2 and "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("aiayn: error: ")]
    assert len(errors) == 1 and stderr.rstrip("\n").endswith(errors[0]), stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


def train_argv(prefix, out, *extra) -> list:
    """`aiayn train` on PREFIX.en / PREFIX.xx into OUT, quietly, with `extra` flags after (they win)."""
    return [
        "train",
        "--train",
        prefix,
        "--src-lang",
        "en",
        "--tgt-lang",
        "xx",
        "--out",
        out,
        "--quiet",
        *extra,
    ]


def run_train(out, model_config, train_config, tokenizer, corpus, mode: str = "new", **kwargs) -> Result:
    """train() into OUT on the CPU, quietly, opening OUT as `aiayn train` with that mode would: the
    corpus is prepared into OUT/data with this tokenizer (or, resuming, OUT/data is used)."""
    run = Run.open(out, mode, progress=False)
    if run.resuming and (run.data_dir / MANIFEST).is_file():
        data = open_prepared(run.data_dir)
    else:
        data = prepare_corpus(run.data_dir, corpus, tokenizer=tokenizer, say=lambda line: None)
    return train(run, model_config, train_config, data, device=torch.device("cpu"), **kwargs)
