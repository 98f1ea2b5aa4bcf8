"""`aiayn prepare`, `aiayn train` (alone or under torchrun) and `aiayn demo`: a corpus to a model directory."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from aiayn.cli.common import config_flags, device_flag, encoding_flag, say
from aiayn.config import (
    LOW_RESOURCE_PAIRS,
    PRESETS,
    SEARCH_KEYS,
    ModelConfig,
    SearchConfig,
    TrainConfig,
    choose,
    from_dict,
    parse_overrides,
    preset_for_vocabulary,
    recipe,
    split_overrides,
)
from aiayn.data.corpus import check_sources, input_path
from aiayn.extras import need
from aiayn.files import check_replaceable, check_writable_dir
from aiayn.precision import check_dtype, resolve_device, training_dtype

if TYPE_CHECKING:
    from aiayn.checkpoint import ModelDir

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


def cmd_prepare(args: argparse.Namespace) -> None:
    check_sources(args.train, args.valid)
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


def add_train(sub: Any) -> None:
    p = sub.add_parser("train", help="train a model on parallel text")
    corpus_flags(p, DATA_FORMS, required=False)
    p.add_argument("--data", help="a corpus `aiayn prepare` wrote, instead of --train")
    p.add_argument("--out", required=True, help="run directory to write (a model directory plus checkpoints)")
    p.add_argument(
        "--init",
        metavar="MODEL_DIR",
        help="fine-tune: start from this model directory's weights, architecture and tokenizer (a model aiayn "
        "trained or imported); the corpus is encoded with its vocabulary, and the run keeps its own schedule, "
        "budget and checkpoints",
    )
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
        help="start over: replace the run in --out (kept aside until the new run has a model, put back if it fails first)",
    )
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    """`aiayn train`: every input checked before OUT changes, the data prepared (rank 0), the preset that
    the corpus picks, then the training loop; the exit status says how it stopped. Long for a reason: the
    order of these checks across torchrun's ranks is the point, and reads best in one place."""
    from aiayn.data.prepare import open_prepared
    from aiayn.training.distributed import Ranks
    from aiayn.training.run import Run, run_languages
    from aiayn.training.train import train

    check_sources(args.train, args.valid)
    if args.tensorboard:
        need("--tensorboard", "tensorboard", "tensorboard")
    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}")
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return relaunch_under_torchrun(args)
    values = config_file(args.config) | parse_overrides((ModelConfig, TrainConfig), args.set)
    model_overrides, train_overrides = split_overrides(values, where=args.config or "--set")
    start = fine_tuning_start(args, model_overrides)  # --init's configuration, tokenizer, search: checked now
    # An unknown preset, a bad override or an impossible model fails now, not after preparing the data
    # (the vocabulary is at most --vocab-size). Without --preset the corpus decides it, once prepared.
    provisional = choose(args.preset or "small", vocab_size=args.vocab_size)  # the corpus may pick another
    cfg = train_config(args, provisional.preset, train_overrides, start and start.search)
    size = provisional.vocab_size
    preset_for_vocabulary(provisional.preset, size, size, True, **model_overrides)
    tokenizer_options(args)  # the tokenizer flags, refused now if they cannot work
    check_dtype(cfg.dtype, resolve_device(args.device))  # an unknown device, CUDA where there is none,
    # or fp16 on the CPU fails now
    ranks = Ranks.start(cfg.dist_backend, args.device, cfg.dist_timeout_minutes)
    ended = False  # whether this rank got through without an error
    try:
        device = ranks.device(args.device)
        mode = "force" if args.force else "resume" if args.resume else "new"

        def open_run() -> Run:
            return Run.open(
                args.out, mode, not args.quiet, args.tensorboard, main=ranks.main, world=ranks.world
            )

        # Rank 0 opens first: it puts back a run that a killed --force left aside, which the others
        # must not see half moved; then every rank has looked at OUT before rank 0 changes it.
        run = open_run() if ranks.main else None
        ranks.barrier()
        run = run or open_run()
        ranks.barrier()
        with run.checking():
            bought: dict[str, Any] = {}  # what the budget buys here, once measured
            budget = budget_updates(args, lambda name: train_config(args, name, train_overrides, start and start.search),
                                    model_overrides, device, bought)  # fmt: skip
            data = training_data(args, run, cfg, start and start.tokenizer, budget) if ranks.main else None
            if not ranks.main:  # rank 0 prepared it: open its copy before it moves into place
                data = open_prepared(ranks.share(None))
            else:
                ranks.share(str(data.directory))
            ranks.barrier()
            tokenizer = data.tokenizer
            name = choose(args.preset, len(data.src)).preset
            if args.preset is None and ranks.main:
                say(
                    f"aiayn: no --preset: {len(data.src):,} training pairs, so --preset {name} (docs/training.md)"
                )
            cfg = train_config(args, name, train_overrides, start and start.search)
            init = None
            if start is None:
                sizes = (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size, tokenizer.joint)
                model_config = preset_for_vocabulary(name, *sizes, **model_overrides)
            else:  # the model's own architecture, its dropout as --set gives it
                model_config = dataclasses.replace(start.config, **model_overrides)
                if not run.resuming:  # (a resume takes its checkpoint's weights; start is --init here)
                    init = start.model().state_dict()
        vocab = choose(name, vocab_size=args.vocab_size).vocab_size  # what prepare was asked for
        settings = {} if args.data else {"tokenizer": f"{args.tokenizer}, vocab_size {vocab}, " + (
            "separate" if args.separate_vocab else "joint")}  # fmt: skip
        if start is not None:
            settings = {"init": str(Path(args.init).resolve())}  # its vocabulary, not the tokenizer flags
        if bought:  # what the recipe decided its BPE-dropout by
            settings["budget"] = bought
        languages = run_languages(data, start and start.languages, say if ranks.main else lambda line: None)
        result = train(run, model_config, cfg, data, device, settings, ranks, init, languages)
        ended = True
    finally:
        ranks.close(together=ended)
    if not ranks.main:
        return 0 if result.stop.signal is None else 128 + signal.Signals[result.stop.signal].value
    if result.restored:  # (Run said so on stderr)
        say(
            f"aiayn: stopped by {result.stop.signal} after update {result.step}, before the new run had a model"
        )
        return 128 + signal.Signals[result.stop.signal].value
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


def train_config(
    args: argparse.Namespace, preset_name: str, overrides: dict[str, Any], search: SearchConfig | None = None
) -> TrainConfig:
    """The preset's training settings, then the search of the model a fine-tuning run starts from (its
    search.json, instead of the recipe's), then the flags, then --set and --config: the user's win."""
    limits = {"max_minutes": args.max_minutes, "max_epochs": args.max_epochs, "max_updates": args.max_updates}
    flags = {k: v for k, v in {**limits, "max_tokens": args.max_tokens}.items() if v is not None}
    preset = dict(recipe(preset_name).train)
    if search is not None:
        preset = {k: v for k, v in preset.items() if k not in SEARCH_KEYS} | {
            k: getattr(search, k) for k in SEARCH_KEYS
        }
    return from_dict(TrainConfig, preset | flags | overrides)


def fine_tuning_start(args: argparse.Namespace, model_overrides: dict[str, Any]) -> ModelDir | None:
    """The model directory a fine-tuning run (--init) starts from (its configuration, tokenizer, search
    and weights), or None without --init; a ValueError for a directory that holds no model, or flags that
    would change its architecture or vocabulary."""
    from aiayn.checkpoint import ModelDir, list_checkpoints

    if args.init is None:
        return None
    # a resume reads them from its own last checkpoint: the same, and the model directory may have moved
    saved = list_checkpoints(args.out) if args.resume else []
    start = ModelDir.read(saved[-1] if saved else args.init)
    fixed = sorted(set(model_overrides) - FINE_TUNABLE)
    if fixed:
        raise ValueError(
            f"--init {args.init} keeps its model's architecture: {', '.join(fixed)} cannot be set "
            f"(only {' and '.join(sorted(FINE_TUNABLE))} can)"
        )
    if args.preset is not None:  # the preset's recipe applies; its model must be the one --init holds
        recipe(args.preset)  # (an unknown name is refused)
        shape = {k: v for k, v in PRESETS[args.preset].items() if k not in FINE_TUNABLE}
        differ = [
            f"{k} {getattr(start.config, k)}, not {v}"
            for k, v in shape.items()
            if getattr(start.config, k) != v
        ]
        if differ:
            raise ValueError(
                f"--init {args.init} keeps its model's architecture ({'; '.join(differ)}): --preset "
                f"{args.preset} would change it; leave --preset out"
            )
    for flag, given in (
        ("--vocab-size", args.vocab_size is not None),
        ("--separate-vocab", args.separate_vocab),
    ):
        if given:
            raise ValueError(f"--init {args.init} brings its own vocabulary: {flag} does not apply")
    return start


# What a fine-tuning run may change of the model it starts from: its regularisation, not its shape
FINE_TUNABLE = frozenset({"dropout", "attention_dropout"})


def training_data(args: argparse.Namespace, run, cfg: TrainConfig, vocabulary=None, budget=0):
    """The prepared corpus to train on: --data as it is; else --train prepared into OUT/data (staged,
    moved into place when the run begins) or, on a resume, OUT/data once it is shown to be that data.
    vocabulary: --init's tokenizer, which a new run encodes with; budget: the updates the run's budget
    buys, or a function of the preset that measures them (budget_updates)."""
    from aiayn.data.prepare import check_same_input, open_prepared

    if args.data is not None:
        if args.train is not None:
            raise ValueError("give --train (files to prepare) or --data (a prepared corpus), not both")
        data = open_prepared(args.data)
        if vocabulary is not None and data.tokenizer.files() != vocabulary.files():
            raise ValueError(f"{args.data} was prepared with another vocabulary than --init {args.init}'s")
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
    tokenizer = run.saved_tokenizer() if run.resuming else vocabulary
    return prepare_from(args, run.data_dir, cfg.seed, tokenizer, updates=budget)


def budget_updates(
    args: argparse.Namespace,
    config_for: Callable[[str], TrainConfig],
    model_overrides: dict[str, Any],
    device,
    record: dict[str, Any],
) -> Callable[[str], int]:
    """The updates the run's budget buys with a preset's recipe: --max-updates, or --max-minutes times the
    updates a minute measured here (training/calibrate.py), whichever is fewer. Measured only when a
    recipe's choice depends on it; said on the console and kept in `record` (run.json's settings)."""

    def updates(preset_name: str) -> int:
        cfg = config_for(preset_name)
        if not cfg.max_minutes:
            return cfg.max_updates
        from aiayn.training.calibrate import updates_per_minute

        vocab = choose(preset_name, vocab_size=args.vocab_size).vocab_size
        model = preset_for_vocabulary(preset_name, vocab, vocab, not args.separate_vocab, **model_overrides)
        rate = updates_per_minute(model, cfg, device)
        bought = int(rate * cfg.max_minutes)
        if cfg.max_updates:
            bought = min(bought, cfg.max_updates)
        dtype = training_dtype(cfg.dtype, device, model.d_model)
        record.update(minutes=cfg.max_minutes, updates_per_minute=round(rate, 1), updates=bought, dtype=dtype)
        say(
            f"aiayn: --max-minutes {cfg.max_minutes:g} buys about {bought:,} updates of --preset {preset_name} "
            f"here ({rate:,.0f} a minute in {dtype}, measured)"
        )
        return bought

    return updates


def prepare_from(args: argparse.Namespace, dest: Path, seed: int, tokenizer=None, updates=0):
    """prepare_files of what --train, --valid, --valid-fraction and the tokenizer flags name, for a
    training run whose budget buys `updates` updates (0: none, as `aiayn prepare` knows none), or a
    function of the preset that measures them."""
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
        options=tokenizer_options(args, updates),
        say=say,
    )


def tokenizer_options(args: argparse.Namespace, updates=0):
    """--vocab-size, --tokenizer, --separate-vocab, --tokenizer-sample, --bpe-dropout for a training run
    whose budget buys `updates` updates, or a function of the preset that measures them (the recipe's
    BPE-dropout depends on it); refused now if they cannot work."""
    from aiayn.data.prepare import TokenizerOptions
    from aiayn.tokenizer import Tokenizer

    preset_name = getattr(args, "preset", None)  # `aiayn prepare` has no --preset
    vocab_size, bpe_dropout = args.vocab_size, args.bpe_dropout
    if preset_name is not None:  # else prepare chooses, once it knows the corpus's size
        asked = bpe_dropout if args.tokenizer == "bpe" else 0.0
        chosen = choose(preset_name, vocab_size=vocab_size, bpe_dropout=asked, updates=updates)
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
        updates=updates,
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
        "default: the preset's for the updates the run's budget buys, measured here for --max-minutes: "
        "low-resource's 0.1 from 20,000 updates, else 0); validation and translation use plain BPE",
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


def relaunch_under_torchrun(args: argparse.Namespace) -> int:
    """`aiayn train --nproc N ...`: the same command under torchrun, N ranks on this machine. One OpenMP
    thread per rank on the CPU unless OMP_NUM_THREADS says otherwise (N ranks with a thread per core
    each would fight for the cores). Ctrl-C and SIGTERM go to torchrun, which passes them on. torchrun's
    own files (each rank's error file) go to a directory removed once it ends: left to itself, torchrun
    makes one in the temporary directory at every launch and never removes it."""
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
    with tempfile.TemporaryDirectory(prefix="aiayn-torchrun-") as logs:
        child = subprocess.Popen([*command, f"--log-dir={logs}", "-m", "aiayn", *argv], env=env)
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


def add_demo(sub: Any) -> None:
    p = sub.add_parser("demo", help="train and show a model on the built-in synthetic task")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--minutes", type=float, default=2.5, help="training time budget")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    need("aiayn demo", "plots", "matplotlib")  # it ends by drawing its curves and attention maps
    from aiayn.training.demo import run_demo

    out = check_writable_dir(args.out)
    result = run_demo(out, minutes=args.minutes)
    print(json.dumps(result))
    return 128 + signal.Signals[result["stopped"]].value if "stopped" in result else 0
