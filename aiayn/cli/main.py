"""The `aiayn` command: its parser, assembled from the command groups' modules, and main(), which turns a
user's mistake into one `aiayn: error:` line."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from aiayn.cli import models, serve, train, translate
from aiayn.training.distributed import env_rank


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="aiayn",
        description="The Transformer of 'Attention Is All You Need': train, translate, evaluate, serve, export",
    )
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
        translate.add_plot,
        serve.add_serve,
        train.add_demo,
    ):
        add(sub)  # one function a command (in its group's module), in the order `aiayn --help` lists them
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args) or 0
    except (ValueError, OSError) as e:
        # ValueError: the library's word for a user's mistake. OSError: the system refused a file
        # (a full disk, a permission) after the checks; both are one line, without a traceback.
        if args.debug:
            raise
        text = str(e) if isinstance(e, ValueError) else f"{e.filename or ''}: {e.strerror or e}"
        rank = f"rank {env_rank()}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        print(f"aiayn: error: {rank}{text}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (reading data, translating): no traceback
        if args.debug:
            raise
        print("aiayn: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT.value


if __name__ == "__main__":
    sys.exit(main())
