"""`aiayn average`, `shortlist` and `export`: new files from a model directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from aiayn.extras import need
from aiayn.files import check_writable_dir, check_writable_file


def add_average(sub: Any) -> None:
    p = sub.add_parser("average", help="average the last N checkpoints of a run (§6.1)")
    p.add_argument("model", help="run directory (what `aiayn train --out` wrote)")
    p.add_argument("--last", type=int, required=True)
    p.add_argument("--out", required=True, help="a new model directory (not the run's own)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_average)


def cmd_average(args: argparse.Namespace) -> None:
    from aiayn.checkpoint import average

    check_writable_dir(args.out)
    dest = average(args.model, args.last, args.out, force=args.force)
    print(json.dumps({"averaged": args.last, "out": str(dest)}))


def add_shortlist(sub: Any) -> None:
    p = sub.add_parser("shortlist", help="learn the output-layer shortlist (vmap.txt) of a model")
    p.add_argument("model", help="model directory (what `aiayn train --out` wrote)")
    p.add_argument("--data", help="a prepared corpus (default: the model directory's data/)")
    p.add_argument("--per-token", type=int, default=20, help="target candidates per source token (20)")
    p.add_argument("--frequent", type=int, default=100, help="most frequent target tokens, always in (100)")
    p.set_defaults(func=cmd_shortlist)


def cmd_shortlist(args: argparse.Namespace) -> None:
    from aiayn.checkpoint import ModelDir
    from aiayn.data.prepare import open_prepared
    from aiayn.inference.shortlist import VMAP_FILE, Shortlist
    from aiayn.training.run import DATA

    data = open_prepared(args.data or Path(args.model) / DATA)
    tokenizer = ModelDir.read(args.model).tokenizer
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


def add_export(sub: Any) -> None:
    p = sub.add_parser("export", help="write a model directory for another inference engine")
    p.add_argument("model", help="model directory (what `aiayn train --out` wrote)")
    p.add_argument(
        "--format",
        choices=["ctranslate2", "keras", "transformers", "onnx"],
        default="ctranslate2",
        help="ctranslate2: a CTranslate2 model directory; keras: a Keras 3 .keras file; transformers: a "
        "Hugging Face model directory (Marian, Pegasus or Blenderbot); onnx: that model in ONNX, for ONNX "
        "Runtime (docs/export.md)",
    )
    p.add_argument("--out", required=True, help="directory to write, or FILE.keras (keras)")
    p.add_argument("--quantization", help="CTranslate2 weight type, e.g. int8 or float16 (default float32)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=cmd_export)


def add_import(sub: Any) -> None:
    p = sub.add_parser(
        "import", help="make a model directory of a transformers Marian model (OPUS-MT's, or an aiayn export)"
    )
    p.add_argument(
        "source",
        help="a local transformers directory holding a Marian model: OPUS-MT's (source.spm, target.spm, "
        "vocab.json; the sentencepiece extra) or what `aiayn export --format transformers` writes "
        "(tokenizer.json); or a Hub name such as Helsinki-NLP/opus-mt-de-en, fetched where the network allows",
    )
    p.add_argument("--out", required=True, help="model directory to write")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument(
        "--src-lang",
        metavar="CODES",
        help="the languages the model reads, comma-separated (default: from an OPUS-MT name, opus-mt-SRC-TGT)",
    )
    p.add_argument(
        "--tgt-lang",
        metavar="CODES",
        help="the languages it writes, comma-separated (default: those of its >>xx<< tags, else from its name)",
    )
    p.set_defaults(func=cmd_import)


def cmd_import(args: argparse.Namespace) -> None:
    need("aiayn import", "transformers", "transformers")
    from aiayn.interop.huggingface import import_transformers

    check_writable_dir(args.out)
    src, tgt = language_codes("--src-lang", args.src_lang), language_codes("--tgt-lang", args.tgt_lang)
    out = import_transformers(args.source, args.out, args.force, src, tgt)
    print(json.dumps({"source": args.source, "out": str(out)}))


def language_codes(flag: str, value: str | None) -> tuple[str, ...]:
    """--src-lang de,fr -> ("de", "fr"); () when the flag is not given."""
    from aiayn.checkpoint import CODE_FORM, is_language_code

    if value is None:
        return ()
    codes = tuple(code.strip() for code in value.split(","))
    if bad := [code for code in codes if not is_language_code(code)]:
        raise ValueError(f"{flag} {value}: {bad[0]!r} is not a language code ({CODE_FORM})")
    return codes


def cmd_export(args: argparse.Namespace) -> None:
    if args.format == "keras":
        need("--format keras", "keras", "keras")
        from aiayn.interop.keras_model import export_keras

        if args.quantization is not None:
            raise ValueError("--quantization is CTranslate2's; the Keras export keeps the weights in float32")
        check_writable_file(args.out, "Keras model")
        dest = export_keras(args.model, args.out, force=args.force)
    elif args.format in ("transformers", "onnx"):
        if args.format == "onnx":
            need("--format onnx", "onnx", "transformers", "optimum.exporters.onnx", "onnxruntime")
        need("--format transformers", "transformers", "transformers")
        from aiayn.interop import huggingface

        if args.quantization is not None:
            raise ValueError(
                f"--quantization is CTranslate2's; the {args.format} export keeps the weights in float32"
            )
        check_writable_dir(args.out)
        export = huggingface.export_onnx if args.format == "onnx" else huggingface.export_transformers
        dest = export(args.model, args.out, force=args.force)
    else:
        need("--format ctranslate2", "ctranslate2", "ctranslate2")
        from aiayn.interop.ctranslate2 import export_ctranslate2

        check_writable_dir(args.out)
        dest = export_ctranslate2(args.model, args.out, quantization=args.quantization, force=args.force)
    print(json.dumps({"format": args.format, "out": str(dest)}))
