"""The `aiayn` command line: thin wrappers that parse flags, check paths, build configs and call the library.

Every path and value is checked before the work it is for; a user's mistake is one `aiayn: error:` line
naming the file, line or value, with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import typing
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import yaml

from aiayn.config import (
    LOW_RESOURCE_PAIRS,
    PRESETS,
    InferenceOptions,
    ModelConfig,
    SearchConfig,
    ServeConfig,
    TrainConfig,
    choose,
    from_dict,
    parse_overrides,
    preset_for_vocabulary,
    recipe,
    split_overrides,
)
from aiayn.data.corpus import STDIN, input_path, read_lines
from aiayn.files import check_replaceable, check_writable_dir, check_writable_file, write_output
from aiayn.inference.evaluate import TOKENIZERS
from aiayn.precision import DEFAULT_DTYPE, Dtype, resolve_device, resolve_dtype
from aiayn.training.distributed import env_rank


def say(text: str) -> None:
    print(text, file=sys.stderr)


# --- train ----------------------------------------------------------------------------------------


def config_file(path: str | None) -> dict[str, Any]:
    """--config YAML: a mapping of config fields to values, passed to the configs as YAML typed them."""
    if path is None:
        return {}
    path = input_path(path)
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as e:  # a syntax error: yaml knows where
        where = f"{path}:{e.problem_mark.line + 1}" if e.problem_mark is not None else str(path)
        raise ValueError(f"{where}: not valid YAML ({e.problem or e})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict) or not all(isinstance(k, str) for k in loaded):
        raise ValueError(f"{path}: expected a mapping of key: value")
    return loaded


def cmd_train(args: argparse.Namespace) -> int:
    """`aiayn train`: every input checked before OUT changes, the data prepared (rank 0), the preset that
    the corpus picks, then the training loop; the exit status says how it stopped. Long for a reason: the
    order of these checks across torchrun's ranks is the point, and reads best in one place."""
    from aiayn.data.prepare import open_prepared
    from aiayn.training.distributed import Ranks
    from aiayn.training.run import Run
    from aiayn.training.train import train

    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return relaunch_under_torchrun(args)
    values = config_file(args.config) | parse_overrides((ModelConfig, TrainConfig), args.set)
    model_overrides, train_overrides = split_overrides(values, where=args.config or "--set")
    # An unknown preset, a bad override or an impossible model fails now, not after preparing the data
    # (the vocabulary is at most --vocab-size). Without --preset the corpus decides it, once prepared.
    provisional = choose(args.preset or "small", vocab_size=args.vocab_size)  # the corpus may pick another
    cfg = train_config(args, provisional.preset, train_overrides)
    size = provisional.vocab_size
    preset_for_vocabulary(provisional.preset, size, size, True, **model_overrides)
    tokenizer_options(args)  # the tokenizer flags, refused now if they cannot work
    resolve_dtype(cfg.dtype, resolve_device(args.device))  # an unknown device, CUDA where there is none,
    # or fp16 on the CPU fails now
    ranks = Ranks.start(cfg.dist_backend, args.device, cfg.dist_timeout_minutes)
    try:
        device = ranks.device(args.device)
        mode = "force" if args.force else "resume" if args.resume else "new"
        run = Run.open(args.out, mode, not args.quiet, args.tensorboard, main=ranks.main, world=ranks.world)
        ranks.barrier()  # every rank has looked at OUT before rank 0 changes it
        with run.checking():
            data = training_data(args, run, cfg) if ranks.main else None
            if not ranks.main:  # rank 0 prepared it: open its copy before it moves into place
                data = open_prepared(ranks.share(None))
            else:
                ranks.share(str(data.directory))
            ranks.barrier()
            tokenizer = data.tokenizer
            name = choose(args.preset, len(data.src)).preset
            if args.preset is None and ranks.main:
                say(
                    f"aiayn: no --preset: {len(data.src):,} training pairs, so --preset {name} (README, Presets)"
                )
            cfg = train_config(args, name, train_overrides)
            sizes = (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint)
            model_config = preset_for_vocabulary(name, *sizes, **model_overrides)
        vocab = choose(name, vocab_size=args.vocab_size).vocab_size  # what prepare was asked for
        settings = {} if args.data else {"tokenizer": f"{args.tokenizer}, vocab_size {vocab}, " + (
            "separate" if args.separate_vocab else "joint")}  # fmt: skip
        result = train(run, model_config, cfg, data, device, settings, ranks)
    finally:
        ranks.close()
    if not ranks.main:
        return 0 if result.stop.signal is None else 128 + signal.Signals[result.stop.signal].value
    print(json.dumps(result.record()))
    bleu = f"validation BLEU {result.best_bleu:.2f}" if result.best_bleu >= 0 else "no validation data"
    held = f"the model of update {result.model_step} ({bleu if result.model_validated else 'not validated'})"
    final = result.final
    if final is not None:  # with the real search; the average of the last checkpoints when it won
        beam = f"validation BLEU {final.bleu:.2f} with {final.search.describe()}"
        held = (f"the average of the checkpoints of updates {list(final.average_steps)} ({beam})"
                if final.kept == "average" else f"{held[:-1]}; {beam})")  # fmt: skip
    if result.stop.signal is None:
        say(f"aiayn: {args.out} holds {held}")
        return 0
    # Ctrl-C (SIGINT) or SIGTERM: train() finished the update in progress and saved a checkpoint. The
    # exit status is the shell's 128 + signal number, so a script sees that the run did not finish.
    say(
        f"aiayn: stopped by {result.stop.signal} after update {result.step}; saved {result.checkpoint}; "
        f"{args.out} holds {held}. Continue with the same command plus --resume"
    )
    return 128 + signal.Signals[result.stop.signal].value


def train_config(args: argparse.Namespace, preset_name: str, overrides: dict[str, Any]) -> TrainConfig:
    """The preset's training settings, then the flags, then --set and --config: the user's win."""
    limits = {"max_minutes": args.max_minutes, "max_epochs": args.max_epochs, "max_updates": args.max_updates}
    flags = {k: v for k, v in {**limits, "max_tokens": args.max_tokens}.items() if v is not None}
    return from_dict(TrainConfig, dict(recipe(preset_name).train) | flags | overrides)


def training_data(args: argparse.Namespace, run, cfg: TrainConfig):
    """The prepared corpus to train on: --data as it is; else --train prepared into OUT/data (staged,
    moved into place when the run begins) or, on a resume, OUT/data once it is shown to be that data."""
    from aiayn.data.prepare import check_same_input, open_prepared

    if args.data is not None:
        if args.train is not None:
            raise ValueError("give --train (files to prepare) or --data (a prepared corpus), not both")
        data = open_prepared(args.data)
        for flag, asked, held in (
            ("--src-lang", args.src_lang, data.src_lang),
            ("--tgt-lang", args.tgt_lang, data.tgt_lang),
        ):
            if asked is not None and asked != held:
                raise ValueError(f"{flag} {asked}, but {args.data} was prepared for {held}")
        return data
    if args.train is None:
        raise ValueError("--train (files to prepare) or --data (a prepared corpus) is needed")
    if not args.src_lang or not args.tgt_lang:
        raise ValueError("--train needs --src-lang and --tgt-lang")
    where = dict(errors=args.encoding_errors, data_files=data_files(args.data_files))
    if run.resuming and (run.data_dir / "manifest.json").is_file():
        data = open_prepared(run.data_dir)
        check_same_input(
            data,
            args.train,
            (args.src_lang, args.tgt_lang),
            valid=args.valid,
            valid_fraction=args.valid_fraction,
            seed=cfg.seed,
            **where,
        )
        return data
    # A resume of a run from before OUT/data existed prepares with the run's own vocabulary.
    tokenizer = run.saved_tokenizer() if run.resuming else None
    return prepare_from(args, run.data_dir, cfg.seed, tokenizer, minutes=cfg.max_minutes)


def prepare_from(args: argparse.Namespace, dest: Path, seed: int, tokenizer=None, minutes: float = 0.0):
    """prepare_files of what --train, --valid, --valid-fraction and the tokenizer flags name, for a
    training run of this time budget (0: none, as `aiayn prepare` knows none)."""
    from aiayn.data.prepare import prepare_files

    return prepare_files(
        dest,
        args.train,
        args.src_lang,
        args.tgt_lang,
        valid=args.valid,
        valid_fraction=args.valid_fraction,
        seed=seed,
        errors=args.encoding_errors,
        data_files=data_files(args.data_files),
        tokenizer=tokenizer,
        options=tokenizer_options(args, minutes),
        say=say,
    )


def tokenizer_options(args: argparse.Namespace, minutes: float = 0.0):
    """--vocab-size, --tokenizer, --separate-vocab, --tokenizer-sample, --bpe-dropout for a training run
    of this time budget (the recipe's BPE-dropout depends on it); refused now if they cannot work."""
    from aiayn.data.prepare import TokenizerOptions
    from aiayn.tokenizer import Tokenizer

    preset_name = getattr(args, "preset", None)  # `aiayn prepare` has no --preset
    vocab_size, bpe_dropout = args.vocab_size, args.bpe_dropout
    if preset_name is not None:  # else prepare chooses, once it knows the corpus's size
        chosen = choose(preset_name, vocab_size=vocab_size, bpe_dropout=bpe_dropout, minutes=minutes)
        vocab_size, bpe_dropout = chosen.vocab_size, chosen.bpe_dropout
    Tokenizer.check_options(choose("small", vocab_size=vocab_size).vocab_size, args.tokenizer)
    if args.tokenizer_sample < 1:
        raise ValueError(f"--tokenizer-sample must be at least 1, got {args.tokenizer_sample}")
    if args.bpe_dropout is not None and not 0.0 <= args.bpe_dropout < 1.0:
        raise ValueError(f"--bpe-dropout must be in [0, 1), got {args.bpe_dropout}")
    if args.bpe_dropout and args.tokenizer != "bpe":
        raise ValueError(f"--bpe-dropout needs --tokenizer bpe, not {args.tokenizer}")
    if args.bpe_dropout_source_only and bpe_dropout == 0.0:  # (None: the recipe decides, in prepare)
        raise ValueError("--bpe-dropout-source-only needs BPE-dropout: give --bpe-dropout P")
    views = TokenizerOptions.views if args.bpe_dropout_views is None else args.bpe_dropout_views
    if views < 1:
        raise ValueError(f"--bpe-dropout-views must be at least 1, got {views}")
    # None: prepare sizes the vocabulary (and BPE-dropout) for the corpus (config.choose)
    return TokenizerOptions(
        vocab_size,
        args.tokenizer,
        not args.separate_vocab,
        args.tokenizer_sample,
        bpe_dropout if args.tokenizer == "bpe" else 0.0,
        views,
        bpe_dropout_target=not args.bpe_dropout_source_only,
        minutes=minutes,
    )


def relaunch_under_torchrun(args: argparse.Namespace) -> int:
    """`aiayn train --nproc N ...`: the same command under torchrun, N ranks on this machine. One OpenMP
    thread per rank on the CPU unless OMP_NUM_THREADS says otherwise (N ranks with a thread per core
    each would fight for the cores). Ctrl-C and SIGTERM go to torchrun, which passes them on."""
    argv = list(args.argv)
    at = next(i for i, a in enumerate(argv) if a == "--nproc" or a.startswith("--nproc="))
    del argv[at : at + (1 if "=" in argv[at] else 2)]
    env = dict(os.environ)
    if not args.device.startswith("cuda") and not (args.device == "auto" and torch_cuda_available()):
        env.setdefault("OMP_NUM_THREADS", "1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
    ]
    child = subprocess.Popen([*command, "-m", "aiayn", *argv], env=env)
    forward = {
        s: signal.signal(s, lambda signum, frame: child.send_signal(signum))
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        return child.wait()
    finally:
        for s, handler in forward.items():
            signal.signal(s, handler)


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_prepare(args: argparse.Namespace) -> None:
    out = check_writable_dir(args.out, "prepared corpus directory")
    check_replaceable(out, args.force)
    data = prepare_from(args, out, args.seed)
    data = data.commit(out, replace=args.force)
    manifest = data.manifest
    print(
        json.dumps(
            {"out": str(out), **{k: manifest[k] for k in ("pairs", "held_out", "src_tokens", "tgt_tokens")}}
        )
    )


def data_files(items: list[str]) -> dict[str, list[str]] | None:
    """--data-files SPLIT=PATH, repeated -> {split: [paths]} for Hugging Face's load_dataset."""
    if not items:
        return None
    files: dict[str, list[str]] = {}
    for item in items:
        split, sep, path = item.partition("=")
        if not sep or not split or not path:
            raise ValueError(f"--data-files {item!r}: expected SPLIT=PATH, e.g. train=pairs.jsonl")
        files.setdefault(split, []).append(str(input_path(path)))
    return files


# --- translate, evaluate --------------------------------------------------------------------------


def search_config_from(args: argparse.Namespace, n_best: int = 1) -> SearchConfig:
    """The model's own search (its search.json, else §6.1's), with the flags the user gave over it."""
    from aiayn.checkpoint import load_search

    base = asdict(load_search(args.model))
    fields = {"beam_size": args.beam_size, "alpha": args.alpha, "length_penalty": args.length_penalty}
    fields = {**base, **{k: v for k, v in fields.items() if v is not None}}
    return from_dict(SearchConfig, fields, where="search options").with_n_best(n_best)


def inference_options(args: argparse.Namespace) -> InferenceOptions:
    """The flags of how to run the model (translate, evaluate, plot, serve), once, checked now."""
    # translate, evaluate and plot have the flags of the model's own run; serve has its worker's too
    names = [f.name for f in fields(InferenceOptions) if f.name in vars(args)]
    options = InferenceOptions(**{name: getattr(args, name) for name in names})
    resolve_dtype(options.dtype, resolve_device(options.device))  # CUDA where there is none, fp16 on a CPU
    return options


def load_translator(args: argparse.Namespace, search_config: SearchConfig):
    from aiayn.inference.translate import Translator

    return Translator.load(args.model, search_config, inference_options(args))


def as_lines(texts: list[str]) -> str:
    """One line out per text: a translation holding a line break (byte-level BPE can emit one) must
    not shift the lines after it."""
    return "".join(t.replace("\r", " ").replace("\n", " ") + "\n" for t in texts)


def cmd_translate(args: argparse.Namespace) -> None:
    search_config = search_config_from(args, args.n_best)
    source = input_path(args.input or STDIN)
    if args.output is not None:
        check_writable_file(args.output)
    translator = load_translator(args, search_config)
    lines = read_lines(source, args.encoding_errors)
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
    say(f"translated {len(lines)} lines in {seconds:.1f} s ({len(lines) / max(seconds, 1e-9):.1f} lines/s)")


def cmd_evaluate(args: argparse.Namespace) -> None:
    from aiayn.inference.evaluate import evaluate

    search_config = search_config_from(args)
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
    translator = load_translator(args, search_config)
    result = evaluate(translator, sources, references, not args.quiet, args.lowercase, args.tokenize)
    hypotheses = result.pop("hypotheses")
    print_scores(result)
    if args.output is not None:
        write_output(args.output, as_lines(hypotheses))


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


# --- average, export, plot, demo ------------------------------------------------------------------


def cmd_average(args: argparse.Namespace) -> None:
    from aiayn.checkpoint import average

    check_writable_dir(args.out)
    dest = average(args.model, args.last, args.out, force=args.force)
    print(json.dumps({"averaged": args.last, "out": str(dest)}))


def cmd_shortlist(args: argparse.Namespace) -> None:
    from aiayn.data.prepare import open_prepared
    from aiayn.inference.shortlist import VMAP_FILE, Shortlist
    from aiayn.tokenizer import Tokenizer
    from aiayn.training.run import DATA

    data = open_prepared(args.data or Path(args.model) / DATA)
    tokenizer = Tokenizer.load(args.model)
    if (
        tokenizer.src_tokens() != data.tokenizer.src_tokens()
        or tokenizer.tgt_tokens() != data.tokenizer.tgt_tokens()
    ):
        raise ValueError(f"{data.directory} was prepared with another vocabulary than {args.model}'s")
    src, tgt = [data.src[i] for i in range(len(data.src))], [data.tgt[i] for i in range(len(data.tgt))]
    shortlist = Shortlist.learn(
        src, tgt, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, per_token=args.per_token,
        frequent=args.frequent,
    )  # fmt: skip
    out = Path(args.model) / VMAP_FILE
    shortlist.save(out, tokenizer)
    print(json.dumps({"out": str(out), "pairs": len(src), "always": len(shortlist.always)}))


def cmd_export(args: argparse.Namespace) -> None:
    extra = {"ctranslate2": "dev", "keras": "keras"}[args.format]
    try:  # each format needs an optional package
        if args.format == "keras":
            from aiayn.interop.keras_model import export_keras
        else:
            from aiayn.interop.ctranslate2 import export_ctranslate2
    except ModuleNotFoundError as e:
        raise ValueError(
            f"--format {args.format} needs the {e.name} package: pip install 'aiayn[{extra}]'"
        ) from None
    if args.format == "keras":
        if args.quantization is not None:
            raise ValueError("--quantization is CTranslate2's; the Keras export keeps the weights in float32")
        check_writable_file(args.out, "Keras model")
        dest = export_keras(args.model, args.out, force=args.force)
    else:
        check_writable_dir(args.out)
        dest = export_ctranslate2(args.model, args.out, quantization=args.quantization, force=args.force)
    print(json.dumps({"format": args.format, "out": str(dest)}))


def cmd_plot(args: argparse.Namespace) -> None:
    from aiayn.checkpoint import load_model_config
    from aiayn.inference.plots import plot_attention, plot_curves
    from aiayn.training.log import METRICS

    search_config = replace(search_config_from(args), beam_size=1)  # the maps are of the greedy output
    if args.sentence is not None and not args.sentence.strip():
        raise ValueError("--sentence is blank: give the source sentence whose attention to draw")
    metrics = Path(args.model) / METRICS
    if args.sentence is None and not metrics.is_file():
        raise ValueError(
            f"{args.model}: no {METRICS} to plot curves from; give --sentence for attention maps"
        )
    if args.sentence is not None:
        load_model_config(args.model)  # a model directory, or a clear error before any work
    out = check_writable_dir(args.out or args.model, "plot directory")
    paths = []
    if metrics.is_file():
        paths.append(plot_curves(metrics, out / "curves.png"))
    if args.sentence is not None:
        paths += plot_attention(load_translator(args, search_config), args.sentence, out)
    print(json.dumps({"plots": [str(p) for p in paths]}))


def cmd_serve(args: argparse.Namespace) -> None:
    from aiayn.checkpoint import load_model_config
    from aiayn.serving.server import serve

    load_model_config(args.model)  # a model directory, or a clear error before any work
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    limits = {f.name: getattr(args, f.name) for f in fields(ServeConfig) if getattr(args, f.name) is not None}
    config = from_dict(ServeConfig, limits, where="serve options")
    options = inference_options(args)
    serve(args.model, config, options, host=args.host, port=args.port, api_key=args.api_key,
          cors_origins=tuple(args.cors_origin))  # fmt: skip


def cmd_demo(args: argparse.Namespace) -> int:
    from aiayn.training.demo import run_demo

    out = check_writable_dir(args.out)
    result = run_demo(out, minutes=args.minutes)
    print(json.dumps(result))
    return 128 + signal.Signals[result["stopped"]].value if "stopped" in result else 0


# --- Flags ----------------------------------------------------------------------------------------


def scoring_flags(p: argparse.ArgumentParser) -> None:
    """sacreBLEU's own options, passed as they are (its signature records them)."""
    p.add_argument("--lowercase", action="store_true", help="case-insensitive BLEU and chrF (sacreBLEU -lc)")
    p.add_argument("--tokenize", choices=TOKENIZERS, default="13a", help="sacreBLEU's BLEU tokenizer (-tok)")


def config_flags(
    p: argparse.ArgumentParser, config: type, names: tuple[str, ...] | None = None, default: str | None = None
) -> None:
    """A flag for each field of a config dataclass (or those named), its type and help from the field
    (config.py says each once); unset flags stay None, so the config's own default applies, or the one
    `default` names (a preset's)."""
    hints = typing.get_type_hints(config)
    for f in fields(config):
        if names is not None and f.name not in names:
            continue
        shown = default or f"default {f.default}"
        p.add_argument(
            "--" + f.name.replace("_", "-"), type=hints[f.name], help=f"{f.metadata['help']} ({shown})"
        )


def dtype_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        choices=typing.get_args(Dtype),
        default=DEFAULT_DTYPE,
        help="auto (default): bf16 on CUDA or a CPU with AMX, else fp32; int8: CPU; fp16: CUDA",
    )


def encoding_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--encoding-errors",
        choices=["strict", "replace"],
        default="strict",
        help="bytes that are not UTF-8: strict = error naming file and line, replace = U+FFFD",
    )


def search_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model directory (what `aiayn train --out` wrote)")
    p.add_argument("--beam-size", type=int, help="1 = greedy (default: the model's search.json, else 4)")
    p.add_argument("--alpha", type=float, help="length penalty weight (default: the model's, else 0.6)")
    p.add_argument(
        "--length-penalty",
        choices=["gnmt", "average"],
        help="gnmt (paper) or average (fairseq/HF); default: the model's, else gnmt",
    )
    dtype_flag(p)
    compile_flag(p)
    device_flag(p)


def compile_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile",
        action="store_true",
        help="decode with a compiled step (torch.compile): faster, after compiling once per batch size; "
        "later runs load it from ~/.cache/aiayn/compiled ($AIAYN_COMPILE_STORE; README, Speed)",
    )
    p.add_argument(
        "--shortlist",
        action="store_true",
        help="compute the output layer only for each batch's candidate tokens (the model's vmap.txt, "
        "from `aiayn shortlist`)",
    )


def device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (CUDA when there is a GPU), cpu, cuda or cuda:N")


def corpus_flags(p: argparse.ArgumentParser, data_forms: str, required: bool = True) -> None:
    p.add_argument("--train", required=required, help=data_forms)
    p.add_argument("--valid", help="validation data, same forms as --train (hf: reads the validation split)")
    p.add_argument("--valid-fraction", type=float, help="hold out this fraction of --train instead")
    p.add_argument(
        "--data-files",
        action="append",
        default=[],
        metavar="SPLIT=PATH",
        help="local files of an hf: dataset, e.g. --train hf:json --data-files train=pairs.jsonl",
    )
    p.add_argument("--src-lang", required=required)
    p.add_argument("--tgt-lang", required=required)


def tokenizer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--vocab-size",
        type=int,
        help="default: the preset's (8,000; low-resource 6,000); without --preset, by corpus size",
    )
    p.add_argument("--tokenizer", choices=["bpe", "word"], default="bpe")
    p.add_argument("--separate-vocab", action="store_true", help="one vocabulary per language")
    p.add_argument(
        "--tokenizer-sample",
        type=int,
        default=1_000_000,
        help="training pairs the vocabulary is learned from, at most",
    )
    p.add_argument(
        "--bpe-dropout",
        type=float,
        metavar="P",
        help="train on segmentations that leave out each BPE merge with probability P (BPE-dropout; "
        "default: the preset's for the run's time budget: low-resource's 0.1 with --max-minutes 60 or more, "
        "else 0); validation and translation use plain BPE",
    )
    p.add_argument(
        "--bpe-dropout-views",
        type=int,
        metavar="K",
        help="segmentations drawn once when preparing, one per epoch in turn (default 16; each takes the "
        "disk of the ids)",
    )
    p.add_argument(
        "--bpe-dropout-source-only",
        action="store_true",
        help="BPE-dropout of the source sentences only: the target side keeps its one segmentation",
    )


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="aiayn", description=__doc__.split("\n")[0])
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = ap.add_subparsers(dest="command", required=True)
    for add in (
        add_prepare,
        add_train,
        add_translate,
        add_evaluate,
        add_score,
        add_average,
        add_shortlist,
        add_export,
        add_plot,
        add_serve,
        add_demo,
    ):
        add(sub)  # one function a command, in the order `aiayn --help` lists them
    return ap


DATA_FORMS = (
    "PREFIX (PREFIX.SRC and PREFIX.TGT, .gz ok), FILE.tsv, - (TSV on stdin) or hf:NAME[:CONFIG[:SPLIT]]"
)


def add_prepare(sub: Any) -> None:
    p = sub.add_parser("prepare", help="tokenize a corpus into memory-mapped files for `train --data`")
    corpus_flags(p, DATA_FORMS)
    p.add_argument("--out", required=True, help="directory to write (the prepared corpus)")
    p.add_argument("--seed", type=int, default=1, help="for --valid-fraction and the tokenizer's sample")
    tokenizer_flags(p)
    encoding_flag(p)
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_prepare)


def add_train(sub: Any) -> None:
    p = sub.add_parser("train", help="train a model on parallel text")
    corpus_flags(p, DATA_FORMS, required=False)
    p.add_argument("--data", help="a corpus `aiayn prepare` wrote, instead of --train")
    p.add_argument("--out", required=True, help="run directory to write (a model directory plus checkpoints)")
    device_flag(p)
    p.add_argument(
        "--nproc", type=int, default=1, help="train with N processes on this machine (runs torchrun for you)"
    )
    p.add_argument(
        "--preset",
        help=f"{', '.join(PRESETS)}; default: low-resource up to {LOW_RESOURCE_PAIRS:,} training pairs, else small",
    )
    config_flags(
        p, TrainConfig, ("max_minutes", "max_epochs", "max_updates", "max_tokens"), "default: the preset's"
    )
    tokenizer_flags(p)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--config", help="YAML file of KEY: VALUE overrides")
    encoding_flag(p)
    p.add_argument(
        "--tensorboard", action="store_true", help="also write TensorBoard logs (aiayn[tensorboard])"
    )
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument(
        "--force",
        action="store_true",
        help="start over: replace the run in --out once the inputs are checked",
    )
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_train)


def add_translate(sub: Any) -> None:
    p = sub.add_parser("translate", help="translate lines (stdin to stdout by default)")
    search_flags(p)
    p.add_argument("--input", help="file or pipe to translate (default and -: stdin)")
    p.add_argument("--output", help="file to write (default stdout)")
    p.add_argument("--n-best", type=int, default=1, help="write N-best lists: index<TAB>score<TAB>text")
    encoding_flag(p)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_translate)


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


def add_score(sub: Any) -> None:
    p = sub.add_parser("score", help="sacreBLEU and chrF of a file of translations against references")
    p.add_argument("hypotheses", metavar="HYP", help="translations, a line each: a file, a pipe or -")
    p.add_argument("references", metavar="REF", help="references, as many lines")
    scoring_flags(p)
    encoding_flag(p)
    p.set_defaults(func=cmd_score)


def add_average(sub: Any) -> None:
    p = sub.add_parser("average", help="average the last N checkpoints of a run (§6.1)")
    p.add_argument("model", help="run directory (what `aiayn train --out` wrote)")
    p.add_argument("--last", type=int, required=True)
    p.add_argument("--out", required=True, help="a new model directory (not the run's own)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_average)


def add_shortlist(sub: Any) -> None:
    p = sub.add_parser("shortlist", help="learn the output-layer shortlist (vmap.txt) of a model")
    p.add_argument("model", help="model directory (what `aiayn train --out` wrote)")
    p.add_argument("--data", help="a prepared corpus (default: the model directory's data/)")
    p.add_argument("--per-token", type=int, default=20, help="target candidates per source token (20)")
    p.add_argument("--frequent", type=int, default=100, help="most frequent target tokens, always in (100)")
    p.set_defaults(func=cmd_shortlist)


def add_export(sub: Any) -> None:
    p = sub.add_parser("export", help="write a model directory for another inference engine")
    p.add_argument("model", help="model directory (what `aiayn train --out` wrote)")
    p.add_argument(
        "--format",
        choices=["ctranslate2", "keras"],
        default="ctranslate2",
        help="ctranslate2: a CTranslate2 model directory; keras: a Keras 3 .keras file (README, Keras)",
    )
    p.add_argument("--out", required=True, help="directory to write (ctranslate2) or FILE.keras (keras)")
    p.add_argument("--quantization", help="CTranslate2 weight type, e.g. int8 or float16 (default float32)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_export)


def add_plot(sub: Any) -> None:
    p = sub.add_parser("plot", help="loss/BLEU curves and attention heatmaps as PNG")
    search_flags(p)
    p.add_argument("--sentence", help="source sentence whose attention to draw")
    p.add_argument("--out", help="directory for the PNG files (default: the model directory)")
    p.set_defaults(func=cmd_plot)


def add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="a REST API and a page around a model (FastAPI, uvicorn)")
    p.add_argument("model", help="model directory (what `aiayn train --out` wrote)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    device_flag(p)
    dtype_flag(p)
    p.add_argument("--threads", type=int, help="PyTorch (or CTranslate2) threads of the model worker")
    compile_flag(p)
    p.add_argument(
        "--engine",
        choices=["torch", "ctranslate2"],
        default="torch",
        help="who translates: aiayn's search, or the model exported to CTranslate2 (attention: torch)",
    )
    p.add_argument("--api-key", help="require Authorization: Bearer KEY on the API")
    p.add_argument(
        "--cors-origin", action="append", default=[], help="allow this origin (CORS); none by default"
    )
    config_flags(p, ServeConfig)
    p.set_defaults(func=cmd_serve)


def add_demo(sub: Any) -> None:
    p = sub.add_parser("demo", help="train and show a model on the built-in synthetic task")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--minutes", type=float, default=2.5, help="training time budget")
    p.set_defaults(func=cmd_demo)


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
