"""BLEU bought by a CPU time budget on Multi30k: the recipe at 15, 30 and 60 minutes and the ablation.

Every run is `aiayn train` on the full Multi30k training set (29,000 pairs), validated on its
validation split (1,014 pairs); nothing here looks at a test set. Runs go one at a time (they time
themselves: anything else on the machine costs them updates) and are kept in runs/bench_budget/NAME, so
the benchmark resumes where it stopped and a finished run is never trained again.

Configurations (both directions):

- before: what the README used before the budget work (preset small, 6,000-token BPE, 2,048-token
  batches, warmup 400, lr_scale 0.5) with the paper's schedule. It also keeps the checkpoints of its last
  20% (averaging needs only the budget's end), which gives three cells: none (its best model, greedy),
  averaging alone (the average of its last 5 checkpoints, greedy) and decoding alone (its best model with
  the recipe's search: beam 4, the average length penalty).
- budget: the same with the budget schedule, no averaging: budget schedule alone (greedy).
- recipe: the low-resource recipe (no --preset: the corpus size picks it) with the paper's schedule,
  no averaging: recipe alone (greedy).
- all: the README's command as it is (no --preset): the run's own final validation (beam 4, the better
  of the best single model and the average). At 15, 30 and 60 minutes; two seeds at 30.

    python benchmarks/bench_budget.py [--only all-30,before-30,...] [--directions de-en,en-de] [--plot FILE]

Prints a line per run as it ends, then the tables (markdown) and writes the BLEU-against-minutes plot.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
RUNS = ROOT / "runs" / "bench_budget"
AIAYN = [sys.executable, "-m", "aiayn"]

BEFORE = ["--preset", "small", "--vocab-size", "6000", "--max-tokens", "2048",
          "--set", "warmup_steps=400", "--set", "lr_scale=0.5"]  # fmt: skip
RECIPE: list[
    str
] = []  # no --preset: 29,000 pairs make `aiayn train` pick low-resource, as the README runs it
CONFIGS = {  # name: (flags, minutes, seeds)
    "before-30": (BEFORE + ["--set", "schedule=paper"], 30, (1,)),
    "budget-30": (BEFORE + ["--set", "average_last=0"], 30, (1,)),
    "recipe-30": (RECIPE + ["--set", "schedule=paper", "--set", "average_last=0"], 30, (1,)),
    "all-15": (RECIPE, 15, (1,)),
    "all-30": (RECIPE, 30, (1, 2)),
    "all-60": (RECIPE, 60, (1,)),
}


def run_name(direction: str, config: str, seed: int) -> str:
    return f"{direction}-{config}-s{seed}"


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def finished(out: Path) -> bool:
    return (out / "metrics.jsonl").is_file() and any(r.get("event") == "final" for r in read_metrics(out))


def valid_files(direction: str, work: Path) -> tuple[Path, Path]:
    """The validation split gunzipped (aiayn evaluate reads plain files or pipes)."""
    import gzip

    src, tgt = direction.split("-")
    paths = []
    for lang in (src, tgt):
        path = work / f"val.{lang}"
        if not path.is_file():
            path.write_text(
                gzip.open(MULTI30K / f"val.{lang}.gz", "rt", encoding="utf-8").read(), encoding="utf-8"
            )
        paths.append(path)
    return paths[0], paths[1]


def train(direction: str, config: str, seed: int) -> Path:
    flags, minutes, _ = CONFIGS[config]
    src, tgt = direction.split("-")
    out = RUNS / run_name(direction, config, seed)
    if finished(out):
        return out
    command = AIAYN + ["train", "--train", str(MULTI30K / "train"), "--valid", str(MULTI30K / "val"),
                       "--src-lang", src, "--tgt-lang", tgt, "--out", str(out), "--force", "--quiet",
                       "--max-minutes", str(minutes), *flags, "--set", f"seed={seed}"]  # fmt: skip
    print("$ " + " ".join(command[2:]), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, cwd=ROOT)
    return out


def evaluate(model: Path, direction: str, search: list[str]) -> float:
    src, ref = valid_files(direction, RUNS)
    command = AIAYN + ["evaluate", str(model), "--src", str(src), "--ref", str(ref), "--quiet", *search]
    out = subprocess.run(command, check=True, cwd=ROOT, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["bleu"]


def summary(out: Path) -> dict:
    records = read_metrics(out)
    (final,) = [r for r in records if r.get("event") == "final"]
    stop = [r for r in records if r.get("event") == "stop"][-1]
    steps = [r for r in records if "loss" in r]
    return {
        "updates": stop["step"],
        "epochs": steps[-1]["epoch"] if steps else 0,
        "best_greedy": stop["best_bleu"],
        "final": final,
        "final_bleu": final["average"]["bleu"] if final["kept"] == "average" else final["single_bleu"],
        "curve": [(r["minutes"], r["valid_bleu"]) for r in records if "valid_bleu" in r],
    }


def cells(direction: str, seeds_all: tuple[int, ...], search: list[str]) -> dict:
    """The ablation's cells for one direction (runs that are missing are skipped)."""
    row: dict = {}
    before = RUNS / run_name(direction, "before-30", 1)
    if finished(before):
        row["none"] = summary(before)["best_greedy"]
        row["decoding"] = evaluate(before, direction, search)
        averaged = RUNS / f"{before.name}-average"
        if not (averaged / "model.safetensors").is_file():
            subprocess.run(AIAYN + ["average", str(before), "--last", "5", "--out", str(averaged), "--force"],
                           check=True, cwd=ROOT, capture_output=True)  # fmt: skip
        row["averaging"] = evaluate(averaged, direction, ["--beam-size", "1"])
    for config, cell in (("budget-30", "budget"), ("recipe-30", "recipe")):
        out = RUNS / run_name(direction, config, 1)
        if finished(out):
            row[cell] = summary(out)["best_greedy"]
    row["all"] = [summary(RUNS / run_name(direction, "all-30", s))["final_bleu"] for s in seeds_all
                  if finished(RUNS / run_name(direction, "all-30", s))]  # fmt: skip
    return row


def recipe_search() -> list[str]:
    """The recipe's search (its beam size and length penalty), which the decoding cell gives the model
    of before."""
    from aiayn.config import RECIPES, SearchConfig

    search = {**vars(SearchConfig()), **RECIPES["low-resource"].train}
    return ["--beam-size", str(search["beam_size"]), "--alpha", str(search["alpha"]),
            "--length-penalty", search["length_penalty"]]  # fmt: skip


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (direction, by_minutes) in enumerate(results.items()):
        xs = sorted(by_minutes)
        ax.plot(xs, [max(by_minutes[x]) for x in xs], "o-", color=f"C{i}", label=f"{direction} (final, beam)")
        for x in xs:
            ax.plot([x] * len(by_minutes[x]), by_minutes[x], "o", color=f"C{i}", alpha=0.5)
    ax.set(xlabel="minutes of training (2-core CPU)", ylabel="validation sacreBLEU", xticks=[15, 30, 60],
           title="Multi30k, --preset low-resource")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="comma-separated configurations (default: all of them)")
    p.add_argument("--directions", default="de-en,en-de")
    p.add_argument("--seeds", help="comma-separated seeds to train (default: each configuration's)")
    p.add_argument("--plot", default=str(ROOT / "docs" / "m30k_budget.png"))
    args = p.parse_args()
    if not (MULTI30K / "train.de.gz").is_file():
        sys.exit(f"no Multi30k in {MULTI30K}")
    RUNS.mkdir(parents=True, exist_ok=True)
    directions = args.directions.split(",")
    wanted = args.only.split(",") if args.only else list(CONFIGS)
    print(machine(), file=sys.stderr)
    for config in wanted:
        for direction in directions:
            for seed in CONFIGS[config][2]:
                if args.seeds and str(seed) not in args.seeds.split(","):
                    continue
                out = train(direction, config, seed)
                s = summary(out)
                print(
                    json.dumps({"run": out.name, **{k: v for k, v in s.items() if k != "curve"}}), flush=True
                )
    search = recipe_search()
    print("\n| direction | " + " | ".join(f"{m} min" for m in (15, 30, 60)) + " |")
    print("|---|---:|---:|---:|")
    by_direction = {}
    for direction in directions:
        by_minutes = {}
        for minutes in (15, 30, 60):
            config = f"all-{minutes}"
            scores = [summary(RUNS / run_name(direction, config, s))["final_bleu"] for s in CONFIGS[config][2]
                      if finished(RUNS / run_name(direction, config, s))]  # fmt: skip
            if scores:
                by_minutes[minutes] = scores
        by_direction[direction] = by_minutes
        row = [" / ".join(f"{x:.2f}" for x in by_minutes.get(m, [])) or "-" for m in (15, 30, 60)]
        print(f"| {direction} | " + " | ".join(row) + " |")
    if any(by_direction.values()):
        plot(by_direction, Path(args.plot))
    print("\n| 30 minutes | none | budget schedule | averaging | recipe | decoding | all (seeds) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    table = {}
    for direction in directions:
        row = cells(direction, CONFIGS["all-30"][2], search)
        table[direction] = row
        get = [
            f"{row[k]:.2f}" if k in row else "-"
            for k in ("none", "budget", "averaging", "recipe", "decoding")
        ]
        print(
            f"| {direction} | " + " | ".join(get) + " | " + " / ".join(f"{x:.2f}" for x in row["all"]) + " |"
        )
    print(json.dumps({"machine": machine(), "minutes": by_direction, "ablation": table}))


if __name__ == "__main__":
    main()
