"""The `aiayn` command: its parser, assembled from the command groups' modules, and main(), which turns a
user's mistake into one `aiayn: error:` line."""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
from types import MappingProxyType

from aiayn import __version__
from aiayn.cli import models, serve, train, translate
from aiayn.precision import cpu_class
from aiayn.training.distributed import env_rank

DESCRIPTION = """\
The Transformer of "Attention Is All You Need": train a translation model on your parallel text,
translate with it, score it with sacreBLEU, look inside it, serve it and export it.

A corpus becomes a model directory, which every other command takes:

  aiayn train --train data/train --valid data/val --src-lang de --tgt-lang en --out runs/de-en --max-minutes 30
  aiayn translate runs/de-en --input test.de --output test.hyp.en
  aiayn evaluate runs/de-en --src test.de --ref test.en
  aiayn serve runs/de-en

`aiayn COMMAND --help` shows a command's flags and an example. Guides: docs/README.md."""

# An example a command, shown under its --help (tests/test_docs.py parses each with this parser)
EXAMPLES = MappingProxyType(
    {
        "prepare": "aiayn prepare --train data/train --valid data/val --src-lang de --tgt-lang en --out data/de-en",
        "train": "aiayn train --train data/train --valid data/val --src-lang de --tgt-lang en --out runs/de-en "
        "--max-minutes 30",
        "translate": "aiayn translate runs/de-en --input test.de --output test.hyp.en",
        "evaluate": "aiayn evaluate runs/de-en --src test.de --ref test.en",
        "score": "aiayn score test.hyp.en test.en",
        "average": "aiayn average runs/de-en --last 5 --out runs/de-en-avg",
        "shortlist": "aiayn shortlist runs/de-en",
        "export": "aiayn export runs/de-en --format ctranslate2 --out runs/de-en-ct2",
        "import": "aiayn import Helsinki-NLP/opus-mt-de-en --out runs/opus-de-en",
        "plot": 'aiayn plot runs/de-en --sentence "Ein Hund rennt."',
        "serve": "aiayn serve runs/de-en --port 8000",
        "demo": "aiayn demo --out runs/demo",
    }
)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="aiayn", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--version", action="version", version=f"aiayn {__version__}")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = ap.add_subparsers(dest="command", required=True)
    for add in (
        train.add_prepare,
        train.add_train,
        translate.add_translate,
        translate.add_evaluate,
        translate.add_score,
        models.add_average,
        models.add_shortlist,
        models.add_export,
        models.add_import,
        translate.add_plot,
        serve.add_serve,
        train.add_demo,
    ):
        add(sub)  # one function a command (in its group's module), in the order `aiayn --help` lists them
    for name, command in sub.choices.items():
        command.epilog = f"example:\n  {EXAMPLES[name]}"
        command.formatter_class = argparse.RawDescriptionHelpFormatter
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parser().parse_args(argv)
    args.argv = argv
    try:
        cpu_class()  # a CPU class named by AIAYN_CPU_CLASS that is none: refused before any work
        return args.func(args) or 0
    except (ValueError, OSError) as e:
        # ValueError: the library's word for a user's mistake. OSError: the system refused a file
        # (a full disk, a permission) after the checks; both are one line, without a traceback.
        if args.debug:
            raise
        text = str(e) if isinstance(e, ValueError) else storage_line(e, args.command)
        rank = f"rank {env_rank()}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"aiayn: error: {rank}{text}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (reading data, translating): no traceback
        if args.debug:
            raise
        print("aiayn: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT.value


# What to do about a file the system refused, by errno: the message names the path, this says the way on.
ADVICE = MappingProxyType(
    {
        errno.ENOSPC: "the disk is full: free some space (or write elsewhere) and run the command again",
        errno.EDQUOT: "the disk quota is used up: free some space (or write elsewhere) and run the command again",
        errno.EROFS: "the file system is read-only: write elsewhere",
        errno.EACCES: "permission denied: write elsewhere, or change the permissions",
        errno.EPERM: "not permitted: write elsewhere, or change the permissions",
        errno.ENOENT: "it is not there (removed while the command ran?)",
        errno.EISDIR: "a directory is in its place: move that away and run the command again",
        errno.ENOTDIR: "a file is in the place of a directory on that path: move it away and run the command again",
        errno.EEXIST: "a file is in the place of the directory: move it away and run the command again",
    }
)


def storage_line(e: OSError, command: str) -> str:
    """An OSError as one line: the path, the system's word and what to do; a training run adds that
    what it saved is intact."""
    line = f"{e.filename or ''}: {e.strerror or e}"
    if e.errno in ADVICE:
        line += f" ({ADVICE[e.errno]})"
    if command == "train" and e.errno != errno.ENOENT:  # (a directory that vanished took its files along)
        line += "; what was saved is intact (to continue from the last checkpoint: the same command plus --resume)"
    return line


if __name__ == "__main__":
    sys.exit(main())
