"""The `aiayn` command line: thin wrappers that parse flags, build configs and call the library."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from aiayn import checkpoint
from aiayn.config import (
    PRESETS,
    ModelConfig,
    SearchConfig,
    TrainConfig,
    from_dict,
    load_json,
    parse_overrides,
    preset,
)


def overrides(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """--config YAML and --set key=value, split into ModelConfig and TrainConfig fields."""
    items: list[str] = []
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ValueError(f"{path}: no such file")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of key: value")
        items += [f"{k}={v}" for k, v in loaded.items()]
    items += args.set
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    model_items, train_items = [], []
    for item in items:
        key = item.partition("=")[0].strip()
        if key in model_fields:
            model_items.append(item)
        elif key in train_fields:
            train_items.append(item)
        else:
            raise ValueError(
                f"--set {item!r}: unknown key {key!r}; known keys: {sorted(model_fields | train_fields)}"
            )
    return parse_overrides(ModelConfig, model_items), parse_overrides(TrainConfig, train_items)


def train_config_from(args: argparse.Namespace, train_overrides: dict[str, Any]) -> TrainConfig:
    flags = {
        "max_minutes": args.max_minutes,
        "max_epochs": args.max_epochs,
        "max_updates": args.max_updates,
        "max_tokens": args.max_tokens,
    }
    return from_dict(TrainConfig, {**{k: v for k, v in flags.items() if v is not None}, **train_overrides})


def cmd_train(args: argparse.Namespace) -> int:
    from aiayn.data import clean_pairs, read_pairs, split_valid
    from aiayn.tokenizer import Tokenizer
    from aiayn.train import Corpus, train

    model_overrides, train_overrides = overrides(args)
    train_config = train_config_from(args, train_overrides)
    preset(args.preset)  # an unknown name fails now, not after reading data and training a tokenizer
    out = Path(args.out)
    src, tgt = read_pairs(args.train, args.src_lang, args.tgt_lang, errors=args.encoding_errors)
    src, tgt, report = clean_pairs(src, tgt)
    print(f"training pairs: {report}", file=sys.stderr)
    if args.valid:
        valid_src, valid_tgt = read_pairs(
            args.valid, args.src_lang, args.tgt_lang, errors=args.encoding_errors
        )
        valid_src, valid_tgt, valid_report = clean_pairs(valid_src, valid_tgt)
        print(f"validation pairs: {valid_report}", file=sys.stderr)
    elif args.valid_fraction:
        src, tgt, valid_src, valid_tgt = split_valid(src, tgt, args.valid_fraction, train_config.seed)
    else:
        valid_src, valid_tgt = [], []

    resuming = args.resume and bool(checkpoint.list_checkpoints(out))
    if resuming:
        tokenizer = Tokenizer.load(out)
        model_config = load_json(ModelConfig, out / checkpoint.CONFIG)
    else:
        if (out / checkpoint.CONFIG).exists() and not args.force:
            if args.resume:  # e.g. a run killed before its first checkpoint
                raise ValueError(f"{out} holds no checkpoint to resume from: use --force to start over")
            raise ValueError(
                f"{out} already holds a model: use --resume to continue it or --force to start over"
            )
        tokenizer = Tokenizer.train(
            src, tgt, vocab_size=args.vocab_size, kind=args.tokenizer, joint=not args.separate_vocab
        )
        model_config = preset(
            args.preset,
            src_vocab_size=tokenizer.src_vocab_size,
            tgt_vocab_size=tokenizer.tgt_vocab_size,
            share_embeddings=tokenizer.joint,
            **model_overrides,
        )
    corpus = Corpus(tokenizer.encode_src(src), tokenizer.encode_tgt(tgt), valid_src, valid_tgt)
    result = train(
        out, model_config, train_config, tokenizer, corpus, resume=resuming, progress=not args.quiet
    )
    print(json.dumps(result))
    if result["reason"].startswith("signal "):
        # Ctrl-C (SIGINT) or SIGTERM: train() finished the update in progress and saved a checkpoint. The
        # exit status is the shell's 128 + signal number, so a script sees that the run did not finish.
        name = result["reason"].removeprefix("signal ")
        print(
            f"aiayn: stopped by {name} after update {result['step']}; saved "
            f"{checkpoint.list_checkpoints(out)[-1]}. Continue with the same command plus --resume",
            file=sys.stderr,
        )
        return 128 + signal.Signals[name].value
    return 0


def search_config_from(args: argparse.Namespace) -> SearchConfig:
    fields = {"beam_size": args.beam_size, "alpha": args.alpha, "length_penalty": args.length_penalty}
    return from_dict(SearchConfig, {k: v for k, v in fields.items() if v is not None})


def load_translator(args: argparse.Namespace):
    from aiayn.translate import Translator

    return Translator.load(args.model, search_config_from(args), dtype=args.dtype)


def read_input(path: str | None) -> list[str]:
    from aiayn.data import read_lines, split_lines

    if path is None or path == "-":
        return split_lines(sys.stdin.read())
    return read_lines(path)


def as_lines(texts: list[str]) -> str:
    """One line out per text: a translation holding a line break (byte-level BPE can emit one) must
    not shift the lines after it."""
    return "".join(t.replace("\r", " ").replace("\n", " ") + "\n" for t in texts)


def cmd_translate(args: argparse.Namespace) -> None:
    translator = load_translator(args)
    lines = read_input(args.input)
    start = time.perf_counter()
    if args.n_best > 1:
        n_best = translator.translate_n_best(lines, args.n_best)
        output = [f"{i}\t{score:.4f}\t{text}" for i, group in enumerate(n_best) for text, score in group]
    else:
        output = translator.translate(lines, progress=not args.quiet)
    seconds = time.perf_counter() - start
    text = as_lines(output)
    if args.output:
        checkpoint.atomic_write(Path(args.output), lambda p: p.write_text(text, encoding="utf-8"))
    else:
        sys.stdout.write(text)
    print(
        f"translated {len(lines)} lines in {seconds:.1f} s ({len(lines) / max(seconds, 1e-9):.1f} lines/s)",
        file=sys.stderr,
    )


def cmd_evaluate(args: argparse.Namespace) -> None:
    from aiayn.data import read_lines
    from aiayn.evaluate import evaluate

    translator = load_translator(args)
    result = evaluate(translator, read_lines(args.src), read_lines(args.ref), progress=not args.quiet)
    hypotheses = result.pop("hypotheses")
    if args.output:
        checkpoint.atomic_write(
            Path(args.output), lambda p: p.write_text(as_lines(hypotheses), encoding="utf-8")
        )
    print(result["bleu_detail"])
    print(f"chrF2 = {result['chrf']:.2f}  {result['chrf_signature']}")
    print(json.dumps(result))


def cmd_average(args: argparse.Namespace) -> None:
    dest = checkpoint.average(args.model, args.last, args.out)
    print(json.dumps({"averaged": args.last, "out": str(dest)}))


def cmd_export(args: argparse.Namespace) -> None:
    from aiayn.export import export_ctranslate2  # needs the optional ctranslate2 package

    dest = export_ctranslate2(args.model, args.out, quantization=args.quantization, force=args.force)
    print(json.dumps({"format": args.format, "out": str(dest)}))


def cmd_plot(args: argparse.Namespace) -> None:
    from aiayn.plots import plot_attention, plot_curves

    out = Path(args.out or args.model)
    paths = []
    metrics = Path(args.model) / "metrics.jsonl"
    if metrics.exists():
        paths.append(plot_curves(metrics, out / "curves.png"))
    if args.sentence:
        paths += plot_attention(load_translator(args), args.sentence, out)
    print(json.dumps({"plots": [str(p) for p in paths]}))


def cmd_demo(args: argparse.Namespace) -> None:
    from aiayn.demo import run_demo

    print(json.dumps(run_demo(Path(args.out), minutes=args.minutes)))


def search_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (what `aiayn train --out` wrote)")
    p.add_argument("--beam-size", type=int, help="1 = greedy (default 4, §6.1)")
    p.add_argument("--alpha", type=float, help="length penalty weight (default 0.6)")
    p.add_argument(
        "--length-penalty", choices=["gnmt", "average"], help="gnmt (paper) or average (fairseq/HF)"
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "fp32", "bf16", "int8"],
        default="fp32",
        help="auto: bf16 on CUDA or AMX; int8: CPU",
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="aiayn", description=__doc__)
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model on parallel text")
    p.add_argument(
        "--train", required=True, help="PREFIX (PREFIX.SRC, PREFIX.TGT, .gz ok), FILE.tsv or hf:NAME[:CONFIG]"
    )
    p.add_argument("--valid", help="validation data, same forms as --train")
    p.add_argument("--valid-fraction", type=float, help="hold out this fraction of --train instead")
    p.add_argument("--src-lang", required=True)
    p.add_argument("--tgt-lang", required=True)
    p.add_argument("--out", required=True, help="model directory to write")
    p.add_argument("--preset", default="small", help=", ".join(PRESETS))
    p.add_argument("--max-minutes", type=float)
    p.add_argument("--max-epochs", type=int)
    p.add_argument("--max-updates", type=int)
    p.add_argument("--max-tokens", type=int, help="target tokens per micro-batch")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--tokenizer", choices=["bpe", "word"], default="bpe")
    p.add_argument("--separate-vocab", action="store_true", help="one vocabulary per language")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--config", help="YAML file of KEY: VALUE overrides")
    p.add_argument(
        "--encoding-errors",
        choices=["strict", "replace"],
        default="strict",
        help="bytes that are not UTF-8: strict = error naming file and line, replace = U+FFFD",
    )
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument(
        "--force", action="store_true", help="start over: replace the model, checkpoints and metrics in --out"
    )
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("translate", help="translate lines (stdin to stdout by default)")
    search_flags(p)
    p.add_argument("--input", help="file to translate (default stdin)")
    p.add_argument("--output", help="file to write (default stdout)")
    p.add_argument("--n-best", type=int, default=1, help="write N-best lists: index<TAB>score<TAB>text")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_translate)

    p = sub.add_parser("evaluate", help="sacreBLEU and chrF of a model on a test set")
    search_flags(p)
    p.add_argument("--src", required=True)
    p.add_argument("--ref", required=True)
    p.add_argument("--output", help="also write the translations here")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("average", help="average the last N checkpoints (§6.1)")
    p.add_argument("model")
    p.add_argument("--last", type=int, required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_average)

    p = sub.add_parser("export", help="write a model directory for another inference engine")
    p.add_argument("model", help="model directory (what `aiayn train --out` wrote)")
    p.add_argument("--format", choices=["ctranslate2"], default="ctranslate2")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--quantization", help="CTranslate2 weight type, e.g. int8 or float16 (default float32)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("plot", help="loss/BLEU curves and attention heatmaps as PNG")
    search_flags(p)
    p.add_argument("--sentence", help="source sentence whose attention to draw")
    p.add_argument("--out", help="directory for the PNG files (default: the model directory)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("demo", help="train and show a model on the built-in synthetic task")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--minutes", type=float, default=2.5, help="training time budget")
    p.set_defaults(func=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:
        if args.debug:
            raise
        print(f"aiayn: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (reading data, translating): no traceback
        if args.debug:
            raise
        print("aiayn: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT.value


if __name__ == "__main__":
    sys.exit(main())
