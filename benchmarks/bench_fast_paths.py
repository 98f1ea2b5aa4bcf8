"""Quality and speed of each fast decoding path on a trained model: validation sacreBLEU against fp32 eager.

For a model directory and a validation split: fp32 eager (the reference), compiled, shortlist, compiled
with shortlist, and int8, each with greedy search and with the model's own search (search.json);
sacreBLEU (cased, 13a) and sentences per second of the whole file (the compiled path's first batch of
each size compiles: `first pass` includes it, `warm` is a second pass). Greedy token ids of compiled fp32
are compared with eager's one by one. The shortlist is learned from the model's data/ if it has no
vmap.txt (`aiayn shortlist`).

    python benchmarks/bench_fast_paths.py MODEL --src val.de.gz --ref val.en.gz [--paths ...] [--isa avx2]
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import sacrebleu
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ISA_CAPS, cap_isa, machine, set_threads  # noqa: E402

from aiayn.inference.shortlist import VMAP_FILE  # noqa: E402
from aiayn.inference.translate import Translator  # noqa: E402

PATHS = {  # name: Translator.load options
    "eager fp32": dict(dtype="fp32"),
    "compiled fp32": dict(dtype="fp32", compile=True),
    "shortlist fp32": dict(dtype="fp32", shortlist=True),
    "compiled+shortlist fp32": dict(dtype="fp32", compile=True, shortlist=True),
    "eager int8": dict(dtype="int8"),
    "compiled int8": dict(dtype="int8", compile=True),
}


def read(path: str) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--src", required=True)
    ap.add_argument("--ref", required=True)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of: {', '.join(PATHS)}")
    ap.add_argument(
        "--batch-tokens",
        type=int,
        default=4096,
        help="source tokens x beam per batch (compiled: <= 32 sentences)",
    )
    ap.add_argument("--isa", choices=sorted(ISA_CAPS), default="native", help="cap at this instruction set")
    args = ap.parse_args()
    cap_isa(args.isa)
    set_threads()
    src, ref = read(args.src), read(args.ref)
    if not (Path(args.model) / VMAP_FILE).is_file() and "shortlist" in args.paths:
        subprocess.run([sys.executable, "-m", "aiayn", "shortlist", args.model], check=True)
    print(f"machine: {machine()}; {len(src)} sentences")
    rows, greedy_ids = [], {}
    for name in args.paths.split(","):
        translator = Translator.load(args.model, device="cpu", **PATHS[name])
        translator.batch_tokens = args.batch_tokens
        for search in ("greedy", "model"):
            config = (
                translator.search_config
                if search == "model"
                else replace(translator.search_config, beam_size=1)
            )
            times = []
            for _ in range(2):  # the first pass compiles what it needs
                start = time.perf_counter()
                hyps = translator.translate_ids(
                    translator.tokenizer.encode_src(src), replace(config, n_best=1)
                )
                times.append(time.perf_counter() - start)
            if search == "greedy":
                greedy_ids[name] = [h[0].tokens for h in hyps]
            out = translator.tokenizer.decode_tgt([h[0].tokens for h in hyps])
            bleu = sacrebleu.corpus_bleu(out, [ref])
            row = {
                "path": name, "search": config.describe(), "bleu": bleu.score,
                "first_pass_sent_per_s": len(src) / times[0], "warm_sent_per_s": len(src) / times[1],
            }  # fmt: skip
            rows.append(row)
            print(
                f"{name:24} {row['search']:32} BLEU {bleu.score:6.2f}  "
                f"{row['first_pass_sent_per_s']:7.1f} / {row['warm_sent_per_s']:7.1f} sent/s (first / warm)"
            )
        del translator
        torch._dynamo.reset()
    reference = greedy_ids.get("eager fp32")
    same = {
        name: sum(a == b for a, b in zip(ids, reference)) for name, ids in greedy_ids.items() if reference
    }
    for name, n in same.items():
        print(f"greedy token ids equal to eager fp32: {name}: {n} / {len(src)}")
    print(json.dumps({"benchmark": "fast_paths", "machine": machine(), "model": args.model, "rows": rows,
                      "greedy_ids_equal_to_eager": same, "sentences": len(src)}))  # fmt: skip


if __name__ == "__main__":
    main()
