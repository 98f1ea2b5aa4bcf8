"""Memory of corpora larger than memory: peak RSS of `aiayn prepare` and of training from `--data`,
on synthetic corpora of 100k, 1M and 4.5M pairs (WMT14 EN-DE has 4.5M), against the in-memory path
aiayn had before (texts and ids as Python lists, batches as lists) at 100k and 1M, projected to 4.5M.

    python benchmarks/bench_prepare.py [--sizes 100000,1000000,4500000] [--updates 20] [--work DIR]

Each measurement is its own process (its peak RSS is VmHWM); training is the `small` preset for a few
updates of 1,024 tokens, the same in both paths (what a model needs for itself, about 580 MB here,
is the same at every size: what grows is the data's share). Corpora are written once under --work and reused. The
last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, peak_rss_mb  # noqa: E402

MAX_TOKENS = 1024  # tokens per batch: the model's own memory stays small beside the data's


def write_corpus(work: Path, n: int) -> Path:
    prefix = work / f"corpus-{n}"
    if not Path(f"{prefix}.xx").is_file():
        from aiayn.data.synthetic import generate

        src, tgt = [], []
        for start in range(0, n, 500_000):  # in blocks: the generator holds what it returns
            s, t = generate(min(500_000, n - start), seed=start + 1)
            src.append("\n".join(s) + "\n"), tgt.append("\n".join(t) + "\n")
        Path(f"{prefix}.en").write_text("".join(src))
        Path(f"{prefix}.xx").write_text("".join(tgt))
    return prefix


def child(kind: str, prefix: str, out: str, updates: int) -> dict:
    """One measurement, in this (fresh) process."""
    start = time.perf_counter()
    if kind == "prepare":
        from aiayn.cli.main import main

        argv = ["prepare", "--train", prefix, "--src-lang", "en", "--tgt-lang", "xx", "--out", out, "--force"]
        assert main([*argv, "--vocab-size", "8000"]) == 0
    elif kind == "train-data":
        from aiayn.cli.main import main

        argv = [
            "train",
            "--data",
            out,
            "--out",
            f"{out}-run",
            "--preset",
            "small",
            "--max-tokens",
            str(MAX_TOKENS),
        ]
        argv += ["--max-updates", str(updates), "--set", "dtype=fp32", "--quiet", "--force"]
        assert main(argv) == 0
    else:  # the in-memory path of before: lists of text, lists of ids, a list per batch
        import torch

        from aiayn.config import TrainConfig, preset
        from aiayn.data.corpus import make_batches, read_parallel
        from aiayn.data.prepare import open_prepared
        from aiayn.model import Transformer
        from aiayn.training.train import make_optimizer, train_step

        src, tgt = read_parallel(prefix, "en", "xx")
        tokenizer = open_prepared(out).tokenizer  # the same vocabulary, not learned again
        src_ids, tgt_ids = tokenizer.encode_src(src), tokenizer.encode_tgt(tgt)
        batches = make_batches(
            [len(x) for x in src_ids], [len(x) for x in tgt_ids], MAX_TOKENS, seed=1, epoch=0
        )
        torch.manual_seed(1)
        model = Transformer(preset("small", vocab_size=tokenizer.src_vocab_size)).train()
        optimizer, cfg = make_optimizer(model, TrainConfig(dtype="fp32")), TrainConfig(dtype="fp32")
        from aiayn.data.corpus import collate

        for batch in batches[:updates]:
            train_step(model, optimizer, [list(collate(src_ids, tgt_ids, batch))], 1e-4, cfg)
    return {"peak_rss_mb": peak_rss_mb(), "seconds": time.perf_counter() - start}


def measure(kind: str, prefix: Path, out: Path, updates: int) -> dict:
    command = [sys.executable, __file__, "--child", kind, str(prefix), str(out), str(updates)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="100000,1000000,4500000")
    ap.add_argument("--in-memory-sizes", default="100000,1000000")
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("--work", default="/tmp/aiayn-bench-prepare")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, prefix, out, updates = args.child
        print(json.dumps(child(kind, prefix, out, int(updates))))
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in map(int, args.sizes.split(",")):
        prefix, data = write_corpus(work, n), work / f"data-{n}"
        row = {"pairs": n, "prepare": measure("prepare", prefix, data, args.updates)}
        row["train_data"] = measure("train-data", prefix, data, args.updates)
        if str(n) in args.in_memory_sizes.split(","):
            row["in_memory"] = measure("in-memory", prefix, data, args.updates)
        rows.append(row)
        print(
            f"{n:>9,} pairs  prepare {row['prepare']['peak_rss_mb']:7.0f} MB ({row['prepare']['seconds']:5.0f} s)  "
            f"train --data {row['train_data']['peak_rss_mb']:7.0f} MB  "
            + (f"in-memory path {row['in_memory']['peak_rss_mb']:7.0f} MB" if "in_memory" in row else ""),
            flush=True,
        )
    memory = [(r["pairs"], r["in_memory"]["peak_rss_mb"]) for r in rows if "in_memory" in r]
    projection = None
    if len(memory) >= 2:  # linear in the pairs: texts, ids and batches are a cost per pair
        (n0, m0), (n1, m1) = memory[0], memory[-1]
        projection = m1 + (m1 - m0) / (n1 - n0) * (4_500_000 - n1)
        print(f"in-memory path projected to 4,500,000 pairs: {projection:,.0f} MB")
    flat = {
        k: max(r[k]["peak_rss_mb"] for r in rows) / min(r[k]["peak_rss_mb"] for r in rows)
        for k in ("prepare", "train_data")
    }
    print(
        f"largest / smallest peak RSS: prepare {flat['prepare']:.2f}x, train --data {flat['train_data']:.2f}x"
    )
    print(
        json.dumps(
            {
                "benchmark": "prepare",
                "machine": machine(),
                "rows": rows,
                "in_memory_4500000_mb": projection,
                "flatness": flat,
            }
        )
    )


if __name__ == "__main__":
    main()
