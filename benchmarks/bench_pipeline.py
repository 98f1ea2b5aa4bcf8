"""Whether the data pipeline keeps a GPU fed: `base` training on a WMT-shaped corpus through `prepare`.

A synthetic corpus shaped like WMT14 EN-DE (lengths log-normal around 22 words with a long tail to 120,
Zipfian words from a lexicon of 60,000 per side, so a 37,000-token shared BPE vocabulary is learned as
for the real corpus) is written, prepared by `aiayn prepare --vocab-size 37000`, then trained on:

1. the same updates of `base` (bf16, --max-tokens a micro-batch) twice, alternating: with the loop's own
   data work (pairs gathered from the memory-mapped ids, collated, pinned and copied, as `aiayn train`
   does) and with every batch already on the GPU; the ratio of the two step times is the pipeline's cost;
2. `aiayn train --data ... --device cuda` as a user runs it, with the GPU's utilisation sampled from
   NVML every 50 ms while it trains, and the tokens/s it logs.

    python benchmarks/bench_pipeline.py [--pairs 300000] [--updates 40] [--max-tokens 25000] [--work DIR]

Needs CUDA. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

VOCAB_SIZE = 37000  # the paper's shared BPE vocabulary (§5.1)


def lexicon(rng: random.Random, n: int) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(2, 11))) for _ in range(n)]


def write_corpus(prefix: Path, pairs: int, seed: int) -> None:
    """PREFIX.en / PREFIX.de: `pairs` lines each, WMT-shaped lengths, Zipfian words (s = 1.1)."""
    rng = random.Random(seed)
    words = {side: lexicon(random.Random(side), 60000) for side in ("en", "de")}
    weights = [1 / (r + 1) ** 1.1 for r in range(60000)]
    cumulative = list(_accumulate(weights))
    out = {side: open(f"{prefix}.{side}", "w") for side in ("en", "de")}
    try:
        for _ in range(pairs):
            n = min(120, max(1, round(math.exp(rng.gauss(3.0, 0.6)))))  # median 20, mean about 24
            m = min(120, max(1, round(n * rng.gauss(1.05, 0.12))))  # German runs a little longer
            for side, length in (("en", n), ("de", m)):
                line = rng.choices(words[side], cum_weights=cumulative, k=length)
                out[side].write(" ".join(line) + " .\n")
    finally:
        for f in out.values():
            f.close()


def _accumulate(xs):
    total = 0.0
    for x in xs:
        total += x
        yield total


class Utilisation:
    """The GPU's utilisation (NVML, percent of the last sample period with a kernel running), sampled in a
    thread every `period` seconds."""

    def __init__(self, period: float = 0.05):
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        self.period, self.samples, self.stop = period, [], threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self) -> None:
        while not self.stop.wait(self.period):
            self.samples.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)

    def __enter__(self) -> Utilisation:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def step_times(data_dir: Path, max_tokens: int, updates: int, reps: int) -> dict:
    """Seconds per update of `base` on the prepared corpus: the loop's data work included, or not."""
    from aiayn.config import TrainConfig, preset
    from aiayn.data.prepare import open_prepared
    from aiayn.model import Transformer
    from aiayn.precision import configure
    from aiayn.training.train import TrainingPairs, make_optimizer, train_step

    device = torch.device("cuda")
    configure(device)
    data = open_prepared(data_dir)
    cfg = TrainConfig(max_tokens=max_tokens, dtype="bf16")
    pairs = TrainingPairs.of(data, cfg.max_len)
    from aiayn.data.corpus import batch_plan

    plan = batch_plan(*pairs.lengths(), max_tokens, seed=cfg.seed, epoch=0)
    batches = [plan[i] for i in range(min(updates, len(plan)))]
    torch.manual_seed(0)
    model = Transformer(preset("base", vocab_size=data.tokenizer.src_vocab_size)).to(device).train()
    optimizer = make_optimizer(model, cfg)
    staged = [pairs.tensors(b, device) for b in batches]

    def loading() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for b in batches:
            train_step(model, optimizer, [pairs.tensors(b, device)], 1e-4, cfg)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / len(batches)

    def preloaded() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for micro in staged:
            train_step(model, optimizer, [micro], 1e-4, cfg)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / len(staged)

    preloaded(), loading()  # warm-up: kernels chosen, the allocator's pool grown
    with_data, without = [], []
    for r in range(reps):  # both orders, against a position bias
        for fn, times in ((loading, with_data), (preloaded, without))[:: 1 if r % 2 == 0 else -1]:
            times.append(fn())
    tokens = sum(int((t[2] != 0).sum()) for t in staged) / len(staged)
    w, wo = statistics.median(with_data), statistics.median(without)
    return {
        "updates": len(batches),
        "target_tokens_per_update": tokens,
        "step_s_with_data": w,
        "step_s_preloaded": wo,
        "data_overhead": w / wo - 1,
        "tokens_per_s_with_data": tokens / w,
        "tokens_per_s_preloaded": tokens / wo,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=300000)
    ap.add_argument(
        "--updates",
        type=int,
        default=60,
        help="updates timed per round, and of the CLI run (a record every 10)",
    )
    ap.add_argument("--loop-updates", type=int, default=30, help="updates of each timed round of the loop")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=25000)
    ap.add_argument("--work", type=Path, help="where the corpus and run go (default: a temporary folder)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_pipeline.py measures a GPU's feeding: CUDA is not available here")
    work = args.work or Path(tempfile.mkdtemp(prefix="aiayn-pipeline-"))
    work.mkdir(parents=True, exist_ok=True)
    aiayn = [sys.executable, "-m", "aiayn"]
    gpu = torch.cuda.get_device_name(0)
    print(f"device: {gpu}, CUDA {torch.version.cuda}, torch {torch.__version__}", flush=True)

    t = time.perf_counter()
    write_corpus(work / "train", args.pairs, seed=1)
    write_corpus(work / "valid", 20, seed=2)  # the run ends validating: kept short
    corpus_s = time.perf_counter() - t
    t = time.perf_counter()
    prepare = ["prepare", "--train", work / "train", "--valid", work / "valid", "--src-lang", "en"]
    prepare += ["--tgt-lang", "de", "--out", work / "data", "--vocab-size", VOCAB_SIZE, "--force"]
    subprocess.run([*aiayn, *map(str, prepare)], check=True)
    prepare_s = time.perf_counter() - t
    print(f"corpus {corpus_s:.0f} s, prepare {prepare_s:.0f} s ({args.pairs} pairs)", flush=True)

    loop = step_times(work / "data", args.max_tokens, args.loop_updates, args.reps)
    print(
        f"base bf16, {loop['target_tokens_per_update']:.0f} target tokens an update: "
        f"{1e3 * loop['step_s_with_data']:.1f} ms with the data work, {1e3 * loop['step_s_preloaded']:.1f} ms "
        f"preloaded ({100 * loop['data_overhead']:+.1f}%)",
        flush=True,
    )
    torch.cuda.empty_cache()

    train = ["train", "--data", work / "data", "--out", work / "run", "--preset", "base", "--device", "cuda"]
    train += ["--max-tokens", args.max_tokens, "--max-updates", args.updates, "--force", "--quiet"]
    # A run with a budget averages checkpoints saved over its last fifth (§6.1), one an update or so in a
    # run this short: each is the weights and Adam's state (about 1 GB for base), which would be timed
    # as the data pipeline's. Averaging off, the run writes only at its end.
    train += ["--set", "average_last=0"]
    t = time.perf_counter()
    with Utilisation() as util:
        subprocess.run([*aiayn, *map(str, train)], check=True)
    train_s = time.perf_counter() - t
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][
        1:
    ]  # the first record (10 updates) holds the warm-up
    # the busy stretch: from the first sample at 50% or more to the last (start-up and final validation
    # are the process's, not the pipeline's)
    busy = [i for i, u in enumerate(util.samples) if u >= 50]
    during = util.samples[busy[0] : busy[-1] + 1] if busy else []
    cli = {
        "wall_s": train_s,
        "tokens_per_s_median": statistics.median(rates) if rates else None,
        "gpu_utilisation_mean_training": statistics.mean(during) if during else None,
        "gpu_utilisation_samples": len(util.samples),
    }
    print(
        f"aiayn train: {cli['tokens_per_s_median'] or 0:.0f} target tokens/s (median of its updates), GPU busy "
        f"{cli['gpu_utilisation_mean_training'] or 0:.0f}% while training (NVML), {train_s:.0f} s in all"
    )
    print(
        json.dumps(
            {
                "benchmark": "pipeline",
                "device": gpu,
                "pairs": args.pairs,
                "vocab_size": VOCAB_SIZE,
                "max_tokens": args.max_tokens,
                "corpus_s": corpus_s,
                "prepare_s": prepare_s,
                "loop": loop,
                "cli": cli,
            }
        )
    )


if __name__ == "__main__":
    main()
