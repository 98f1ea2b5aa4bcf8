"""What a number format changes on a trained model, against fp32 (the default on every CPU): sacreBLEU on a
validation set, how many translations differ from fp32's, whether a sentence translated alone gets the
translation it gets inside its batch, and the seconds of decoding (eager, in one process, formats in turn
and then in the reverse order).

    python benchmarks/bench_formats.py [MODEL_DIR] [--src FILE --ref FILE] [--dtypes fp32,bf16,int8]

By default the model the README's en -> de command trained (../shared/models/m30k-en-de-low-resource)
on Multi30k's 1,014 validation sentences (../shared/data/multi30k/val.en.gz, val.de.gz); it exits with a
message where they are absent. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shlex
import sys
import time
from pathlib import Path

import sacrebleu
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, save_results, set_threads  # noqa: E402

from aiayn.inference.translate import Translator  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"
MODEL = SHARED / "models" / "m30k-en-de-low-resource"
SRC, REF = (SHARED / "data" / "multi30k" / f"val.{lang}.gz" for lang in ("en", "de"))


def lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=str(MODEL))
    p.add_argument("--src", default=str(SRC))
    p.add_argument("--ref", default=str(REF))
    p.add_argument("--dtypes", default="fp32,bf16,int8", help="fp32 first: the others are compared with it")
    p.add_argument("--alone", type=int, default=200, help="sentences also translated one at a time")
    p.add_argument("--results", help="also write the summary to this JSON file")
    args = p.parse_args()
    missing = [path for path in (args.model, args.src, args.ref) if not Path(path).exists()]
    if missing:
        sys.exit(f"bench_formats: {', '.join(map(str, missing))} not found (the shared model and data)")
    dtypes = args.dtypes.split(",")
    if dtypes[0] != "fp32":
        sys.exit("bench_formats: --dtypes starts with fp32, which the others are compared with")
    set_threads()
    src, ref = lines(Path(args.src)), lines(Path(args.ref))
    translators = {d: Translator.load(args.model, dtype=d, device="cpu", compile=False) for d in dtypes}
    print(f"machine: {machine()}")
    outputs, seconds = {}, {d: [] for d in dtypes}
    for order in (dtypes, dtypes[::-1]):
        for dtype in order:
            start = time.perf_counter()
            outputs[dtype] = translators[dtype].translate(src)
            seconds[dtype].append(time.perf_counter() - start)
    results = []
    for dtype in dtypes:
        batch = outputs[dtype]
        alone = [translators[dtype].translate([line])[0] for line in src[: args.alone]]
        row = {
            "dtype": dtype,
            "bleu": sacrebleu.corpus_bleu(batch, [ref]).score,
            "differ_from_fp32": sum(a != b for a, b in zip(batch, outputs["fp32"])),
            "alone_differs_from_batch": sum(a != b for a, b in zip(alone, batch)),
            "decoding_s": min(seconds[dtype]),
        }
        results.append(row)
        print(
            f"{dtype:5} BLEU {row['bleu']:.2f}  differ from fp32 {row['differ_from_fp32']:4} of {len(src)}  "
            f"alone != in its batch {row['alone_differs_from_batch']} of {len(alone)}  "
            f"decoding {row['decoding_s']:.1f} s"
        )
    report = {
        "benchmark": "formats",
        "machine": machine(),
        "command": shlex.join(["python", *sys.argv]),
        "model": Path(args.model).name,
        "search": translators["fp32"].search_config.describe(),
        "sentences": len(src),
        "alone": min(args.alone, len(src)),
        "torch": torch.__version__,
        "results": results,
    }
    print(json.dumps(report))
    save_results(args.results, report)


if __name__ == "__main__":
    main()
