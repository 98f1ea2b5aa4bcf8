"""`aiayn translate`, `evaluate`, `score` and `plot`: what a model directory is used for on the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiayn.cli.common import (
    as_lines,
    encoding_flag,
    load_translator,
    read_model,
    say,
    scoring_flags,
    search_config_from,
    search_flags,
)
from aiayn.data.corpus import STDIN, input_path, read_lines
from aiayn.extras import need
from aiayn.files import check_writable_dir, check_writable_file, write_output

if TYPE_CHECKING:
    from aiayn.checkpoint import ModelDir
    from aiayn.inference.translate import Translator


def add_translate(sub: Any) -> None:
    p = sub.add_parser("translate", help="translate lines (stdin to stdout by default)")
    search_flags(p)
    p.add_argument("--input", help="file or pipe to translate (default and -: stdin)")
    p.add_argument("--output", help="file to write (default stdout)")
    p.add_argument("--n-best", type=int, default=1, help="write N-best lists: index<TAB>score<TAB>text")
    p.add_argument(
        "--tgt-lang",
        metavar="CODE",
        help="the language to translate into: a multilingual model's tag for it (>>fr<<) goes in front of "
        "each line (default: none, as the lines are)",
    )
    encoding_flag(p)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_translate)


def cmd_translate(args: argparse.Namespace) -> None:
    model = read_model(args)
    search_config = search_config_from(args, model, args.n_best)
    source = input_path(args.input or STDIN)
    if args.output is not None:
        check_writable_file(args.output)
    prefix = target_prefix(model, args.tgt_lang)
    translator = load_translator(args, model, search_config)
    lines = [prefix + line if line.strip() else line for line in read_lines(source, args.encoding_errors)]
    compile_ahead(args, translator, lines, args.n_best)
    start = time.perf_counter()
    if args.n_best > 1:
        n_best = translator.translate_n_best(lines, args.n_best)
        output = [f"{i}\t{score:.4f}\t{text}" for i, group in enumerate(n_best) for text, score in group]
    else:
        output = translator.translate(lines, progress=not args.quiet)
    seconds = time.perf_counter() - start
    if args.output is not None:
        write_output(args.output, as_lines(output))
    else:
        sys.stdout.write(as_lines(output))
    say(f"translated {len(lines)} lines in {seconds:.2f} s ({len(lines) / max(seconds, 1e-9):.1f} lines/s)")


def target_prefix(model: ModelDir, code: str | None) -> str:
    """What --tgt-lang CODE puts in front of each source line (Languages.prefix): the model's tag for it,
    or nothing for a model without tags that writes it; a ValueError for a language it does not write,
    or for a model whose languages are unknown."""
    if code is None:
        return ""
    if model.languages is None:
        raise ValueError(
            f"{model.path}: its languages are unknown (no languages.json), so --tgt-lang {code} cannot be "
            "checked; leave it out (and write a tag such as >>fr<< in the text where the model needs one)"
        )
    try:
        return model.languages.prefix(code)
    except ValueError as e:
        raise ValueError(f"{model.path}: --tgt-lang {e}") from None


def compile_ahead(args: argparse.Namespace, translator: Translator, lines: list[str], n_best: int) -> None:
    """--compile: the graphs these lines' batches decode with, compiled first by two worker processes
    sharing the cores (Translator.compile_ahead), each graph's line on stderr unless --quiet."""
    if args.compile is not True or translator.compiled is None:
        return
    config = translator.search_config.with_n_best(n_best)
    quiet = getattr(args, "quiet", False)
    translator.compile_ahead(
        translator.tokenizer.encode_src(lines), config, (lambda line: None) if quiet else say
    )


def add_evaluate(sub: Any) -> None:
    p = sub.add_parser("evaluate", help="sacreBLEU and chrF of a model on a test set")
    search_flags(p)
    p.add_argument("--src", required=True, help="source lines: a file, a pipe or - (stdin)")
    p.add_argument("--ref", required=True, help="reference lines: a file, a pipe or - (stdin)")
    p.add_argument("--output", help="also write the translations here")
    scoring_flags(p)
    encoding_flag(p)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_evaluate)


def cmd_evaluate(args: argparse.Namespace) -> None:
    from aiayn.inference.evaluate import evaluate

    model = read_model(args)
    search_config = search_config_from(args, model)
    src, ref = input_path(args.src), input_path(args.ref)
    if src == ref == STDIN:
        raise ValueError("--src and --ref cannot both be standard input")
    if args.output is not None:
        check_writable_file(args.output)
    sources, references = read_lines(src, args.encoding_errors), read_lines(ref, args.encoding_errors)
    for path, lines in ((src, sources), (ref, references)):
        if not lines:
            raise ValueError(f"{path}: empty, nothing to evaluate")
    if not any(line.strip() for line in references):
        raise ValueError(f"{ref}: all {len(references)} reference lines are blank")
    if len(sources) != len(references):
        raise ValueError(f"{src} has {len(sources)} lines but {ref} has {len(references)}")
    translator = load_translator(args, model, search_config)
    compile_ahead(args, translator, sources, 1)
    result = evaluate(translator, sources, references, not args.quiet, args.lowercase, args.tokenize)
    hypotheses = result.pop("hypotheses")
    print_scores(result)
    if args.output is not None:
        write_output(args.output, as_lines(hypotheses))


def add_score(sub: Any) -> None:
    p = sub.add_parser("score", help="sacreBLEU and chrF of a file of translations against references")
    p.add_argument("hypotheses", metavar="HYP", help="translations, a line each: a file, a pipe or -")
    p.add_argument("references", metavar="REF", help="references, as many lines")
    scoring_flags(p)
    encoding_flag(p)
    p.set_defaults(func=cmd_score)


def cmd_score(args: argparse.Namespace) -> None:
    from aiayn.inference.evaluate import score

    hyp, ref = input_path(args.hypotheses), input_path(args.references)
    if hyp == ref == STDIN:
        raise ValueError("HYP and REF cannot both be standard input")
    hypotheses, references = read_lines(hyp, args.encoding_errors), read_lines(ref, args.encoding_errors)
    if not references:
        raise ValueError(f"{ref}: empty, nothing to score")
    if len(hypotheses) != len(references):
        raise ValueError(f"{hyp} has {len(hypotheses)} lines but {ref} has {len(references)}")
    print_scores(score(hypotheses, references, args.lowercase, args.tokenize))


def print_scores(result: dict) -> None:
    """sacreBLEU's line for BLEU and for chrF, each with its signature, then the JSON."""
    print(f"{result['bleu_detail']}  {result['bleu_signature']}")
    print(f"chrF2 = {result['chrf']:.2f}  {result['chrf_signature']}")
    print(json.dumps(result))


def add_plot(sub: Any) -> None:
    p = sub.add_parser("plot", help="loss/BLEU curves and attention heatmaps as PNG")
    search_flags(p)
    p.add_argument("--sentence", help="source sentence whose attention to draw")
    p.add_argument("--out", help="directory for the PNG files (default: the model directory)")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> None:
    need("aiayn plot", "plots", "matplotlib")
    from aiayn.inference.plots import plot_attention, plot_curves
    from aiayn.training.log import METRICS

    if args.sentence is not None and not args.sentence.strip():
        raise ValueError("--sentence is blank: give the source sentence whose attention to draw")
    metrics = Path(args.model) / METRICS
    if args.sentence is None and not metrics.is_file():
        raise ValueError(
            f"{args.model}: no {METRICS} to plot curves from; give --sentence for attention maps"
        )
    model = read_model(args) if args.sentence is not None else None  # curves alone need no model
    out = check_writable_dir(args.out or args.model, "plot directory")
    paths = []
    if metrics.is_file():
        paths.append(plot_curves(metrics, out / "curves.png"))
    if model is not None:
        search_config = replace(search_config_from(args, model), beam_size=1)  # the maps: the greedy output's
        paths += plot_attention(load_translator(args, model, search_config), args.sentence, out)
    print(json.dumps({"plots": [str(p) for p in paths]}))
