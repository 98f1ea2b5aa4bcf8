"""How cost grows with sentence length: aiayn training tokens/s and peak RSS, and translation sentences/s.

Lengths 16, 64, 256 and 1,024 tokens (source and target alike), the `small` shape by default.
Training: batches of 4,096 tokens (4096 / L sentences), forward + backward + Adam, one child
process per length so peak RSS belongs to that length alone. Translation: the same number of
sentences, greedy, exactly L new tokens each. Writes a table, a plot (--plot PATH) and a last
line of JSON.

    python benchmarks/bench_scaling.py [--config small] [--lengths 16,64,256,1024] [--plot docs/scaling.png]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import aiayn_model  # noqa: E402
from common import CONFIGS, EOS, NoEos, machine, peak_rss_mb, set_threads  # noqa: E402

from aiayn.config import SearchConfig, TrainConfig  # noqa: E402
from aiayn.inference.search import search  # noqa: E402
from aiayn.training.train import make_optimizer, train_step  # noqa: E402

TOKENS = 4096


def batch(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(4, vocab, (n, length), generator=g)
    x[:, -1] = EOS
    return x


def child(config: str, length: int, dtype: str, reps: int) -> dict:
    set_threads()
    shape = CONFIGS[config]
    n = max(1, TOKENS // length)
    torch.manual_seed(0)
    model = aiayn_model(shape).train()
    cfg = TrainConfig(dtype=dtype)
    opt = make_optimizer(model, cfg)
    src, tgt = batch(n, length, shape["vocab"], 1), batch(n, length, shape["vocab"], 2)
    tgt_in = torch.cat([torch.ones(n, 1, dtype=torch.long), tgt[:, :-1]], dim=1)
    micro = [[src, tgt_in, tgt]]
    train_step(model, opt, micro, 1e-4, cfg)  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        train_step(model, opt, micro, 1e-4, cfg)
        times.append(time.perf_counter() - start)
    train_rate = n * length / sorted(times)[len(times) // 2]
    train_rss = peak_rss_mb()
    model.eval()
    start = time.perf_counter()
    with torch.inference_mode():
        search(NoEos(model, EOS), src, SearchConfig(beam_size=1), max_len=length)
    return {
        "length": length,
        "sentences": n,
        "train_tokens_per_s": train_rate,
        "train_peak_rss_mb": train_rss,
        "translate_sentences_per_s": n / (time.perf_counter() - start),
    }


def plot(rows: list[dict], path: Path, config: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r["length"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(
        axes,
        ["train_tokens_per_s", "train_peak_rss_mb", "translate_sentences_per_s"],
        ["training tokens/s", "training peak RSS (MB)", "translation sentences/s (greedy, L new tokens)"],
    ):
        ax.plot(lengths, [r[key] for r in rows], "o-")
        ax.set(xscale="log", xlabel="sentence length (tokens)", title=label)
        if key.startswith("train"):
            ax.set_ylim(bottom=0)  # from zero: small differences are noise, not a trend
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.grid(alpha=0.3)
    axes[2].set_yscale("log")
    fig.suptitle(f"aiayn `{config}`: cost against sentence length (4,096-token batches)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="small")
    ap.add_argument("--lengths", default="16,64,256,1024")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--plot", help="write the plot here (PNG)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.config, args.child, args.dtype, args.reps)))
        return
    rows = []
    print(f"machine: {machine()}")
    print(f"{'length':>6} {'sents':>5} {'train tok/s':>11} {'peak RSS MB':>11} {'translate sent/s':>16}")
    for length in [int(x) for x in args.lengths.split(",")]:
        cmd = [
            sys.executable,
            __file__,
            "--config",
            args.config,
            "--dtype",
            args.dtype,
            "--reps",
            str(args.reps),
        ]
        out = subprocess.run(cmd + ["--child", str(length)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(
            f"{r['length']:6} {r['sentences']:5} {r['train_tokens_per_s']:11.0f} {r['train_peak_rss_mb']:11.0f} "
            f"{r['translate_sentences_per_s']:16.2f}"
        )
    if args.plot:
        plot(rows, Path(args.plot), args.config)
    print(json.dumps({"benchmark": "scaling", "config": args.config, "machine": machine(), "results": rows}))


if __name__ == "__main__":
    main()
