"""What several commands share: the flags of a model, its search, device and number format, and the
options and translator built from them once."""

from __future__ import annotations

import argparse
import sys
import typing
from dataclasses import asdict, fields

from aiayn.config import InferenceOptions, SearchConfig, from_dict
from aiayn.inference.evaluate import TOKENIZERS
from aiayn.precision import DEFAULT_DTYPE, Dtype, resolve_device, translation_dtype

if typing.TYPE_CHECKING:
    from aiayn.checkpoint import ModelDir


def say(text: str) -> None:
    print(text, file=sys.stderr)


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
        kind = (
            {"action": argparse.BooleanOptionalAction} if hints[f.name] is bool else {"type": hints[f.name]}
        )
        p.add_argument("--" + f.name.replace("_", "-"), **kind, help=f"{f.metadata['help']} ({shown})")


def dtype_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        choices=typing.get_args(Dtype),
        default=DEFAULT_DTYPE,
        help="auto (default): fp32 on a CPU (exact: a sentence's translation does not depend on what shares "
        "its batch), bf16 on CUDA; bf16: faster with --compile on a CPU with AMX, and changes some "
        "translations (docs/translation.md); int8: CPU; fp16: CUDA",
    )


def encoding_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--encoding-errors",
        choices=["strict", "replace"],
        default="strict",
        help="bytes that are not UTF-8: strict = error naming file and line, replace = U+FFFD",
    )


def device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (CUDA when there is a GPU), cpu, cuda or cuda:N")


def compile_flag(p: argparse.ArgumentParser, default: str | None, unset: str) -> None:
    """--compile / --no-compile; neither: `default` (what `unset` says)."""
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=default,
        help="--compile: decode with a compiled step (torch.compile), compiling the graphs the input's "
        "batches need first, on every core, into ~/.cache/aiayn/compiled ($AIAYN_COMPILE_STORE), where later "
        f"runs load them in a fraction of a second; --no-compile: decode eagerly; neither: {unset} (docs/translation.md)",
    )
    p.add_argument(
        "--shortlist",
        action="store_true",
        help="compute the output layer only for each batch's candidate tokens (the model's vmap.txt, "
        "from `aiayn shortlist`)",
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
    p.add_argument(
        "--stopping",
        choices=["beam", "exact"],
        help="a beam search sentence is done once beam-size hypotheses finished (beam: fairseq, CTranslate2) "
        "or once none live can win (exact: the paper's code, more steps); default: the model's, else beam",
    )
    dtype_flag(p)
    # the graphs an earlier --compile left in the store by default, loaded in a fraction of a second and
    # faster than eager decoding on a file's batches (benchmarks/bench_real.py); eager where there are none,
    # as compiling costs minutes; a server, which compiles for many requests, compiles by default
    compile_flag(
        p, "stored", "the compiled graphs an earlier --compile stored, where there are any, else eager"
    )
    device_flag(p)


def scoring_flags(p: argparse.ArgumentParser) -> None:
    """sacreBLEU's own options, passed as they are (its signature records them)."""
    p.add_argument("--lowercase", action="store_true", help="case-insensitive BLEU and chrF (sacreBLEU -lc)")
    p.add_argument("--tokenize", choices=TOKENIZERS, default="13a", help="sacreBLEU's BLEU tokenizer (-tok)")


def read_model(args: argparse.Namespace) -> ModelDir:
    """The model directory the command was given, read once: a clear error before any work."""
    from aiayn.checkpoint import ModelDir

    return ModelDir.read(args.model)


def search_config_from(args: argparse.Namespace, model: ModelDir, n_best: int = 1) -> SearchConfig:
    """The model's own search (its search.json, else §6.1's), with the flags the user gave over it."""
    base = asdict(model.search)
    fields = {
        "beam_size": args.beam_size,
        "alpha": args.alpha,
        "length_penalty": args.length_penalty,
        "stopping": args.stopping,
    }
    fields = {**base, **{k: v for k, v in fields.items() if v is not None}}
    return from_dict(SearchConfig, fields, where="search options").with_n_best(n_best)


def inference_options(args: argparse.Namespace) -> InferenceOptions:
    """The flags of how to run the model (translate, evaluate, plot, serve), once, checked now."""
    # translate, evaluate and plot have the flags of the model's own run; serve has its worker's too
    names = [f.name for f in fields(InferenceOptions) if f.name in vars(args)]
    options = InferenceOptions(**{name: getattr(args, name) for name in names})
    translation_dtype(
        options.dtype, resolve_device(options.device)
    )  # CUDA where there is none, fp16 on a CPU
    return options


def load_translator(args: argparse.Namespace, model: ModelDir, search_config: SearchConfig):
    from aiayn.inference.translate import Translator

    return Translator.load(model, search_config, inference_options(args))


def as_lines(texts: list[str]) -> str:
    """One line out per text: a translation holding a line break (byte-level BPE can emit one) must
    not shift the lines after it."""
    return "".join(t.replace("\r", " ").replace("\n", " ") + "\n" for t in texts)
