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
  of the best single model and the average). At 15, 30 and 60 minutes; two seeds at 30. At 60 minutes
  the recipe trains with BPE-dropout 0.1 (config.Recipe.bpe_dropout_for).
- plain-60: the same at 60 minutes without BPE-dropout (`--bpe-dropout 0`): what an hour gave before.
- bpedrop-30, bpedrop-src-30: BPE-dropout 0.1 at 30 minutes, of both sides and of the source only.
  bpedrop-src at 15, 30 and 60 minutes is de->en's README command (COMMAND): the recipe with
  `--bpe-dropout 0.1 --bpe-dropout-source-only`; en->de's is all.

- updates-6000, updates-12000, updates-24000: the README's command (no --preset) given a number of
  updates (`--max-updates`) instead of minutes, two seeds: what the recipe buys with a given compute,
  whatever the CPU; each run's minutes are kept beside it.
- dropout2-updates-6000, -12000, -24000: the same with the model's dropout 0.2 instead of 0.1
  (`--set dropout=0.2`), one seed: a regulariser that costs nothing per update, for the short budgets.
- smoothing2-updates-6000, -12000, -24000: the same with label smoothing 0.2 instead of 0.1.
- bpedrop-src-updates-6000, -12000, -24000: de->en's README command (source-side BPE-dropout 0.1) given
  a number of updates, in both directions: whether the recipe should take it below 20,000 updates.
- warmup5-updates-6000, -12000, -24000: the same with the budget schedule warming up over 5% of the
  updates instead of 10% (`--set warmup_fraction=0.05`), one seed.
- lr07-updates-6000, -12000, -24000: the same with a peak learning rate 1.4 times the recipe's
  (`--set lr_scale=0.7` instead of 0.5), one seed.
- batch2048-updates-6000, -12000, -24000: the same with 2,048-token batches instead of the recipe's
  1,024 (`--max-tokens 2048`), one seed: twice the compute of an update, so its 6,000 updates cost what
  the recipe's 12,000 do: whether a budget buys more with fewer, larger updates.

    python benchmarks/bench_budget.py [--only all-30,before-30,...] [--directions de-en,en-de] [--plot FILE]

Prints a line per run as it ends, then the tables (markdown) and writes the BLEU-against-minutes plot.
runs/ is scratch, lost with the machine; what each run measured is also kept in docs/m30k_budget.json
(committed) with the machine and date it ran on, and the tables and plot are made from that record, so
figures of runs trained at other times, on other CPUs, stay in them, each with its machine.
The record also keeps the sacreBLEU signature of the final validations ("signature") and the published
figure the README's table is read against ("anchor"); benchmarks/tables.py renders that table from it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
RUNS = ROOT / "runs" / "bench_budget"
RECORD = ROOT / "docs" / "m30k_budget.json"
AIAYN = [sys.executable, "-m", "aiayn"]

BEFORE = ["--preset", "small", "--vocab-size", "6000", "--max-tokens", "2048",
          "--set", "warmup_steps=400", "--set", "lr_scale=0.5"]  # fmt: skip
RECIPE: list[
    str
] = []  # no --preset: 29,000 pairs make `aiayn train` pick low-resource, as the README runs it
UPDATES = (6000, 12000, 24000)  # the budgets in updates
CONFIGS = {  # name: (flags, minutes, or updates for updates-N, seeds)
    "before-30": (BEFORE + ["--set", "schedule=paper"], 30, (1,)),
    "budget-30": (BEFORE + ["--set", "average_last=0"], 30, (1,)),
    "recipe-30": (RECIPE + ["--set", "schedule=paper", "--set", "average_last=0"], 30, (1,)),
    "all-15": (RECIPE, 15, (1,)),
    "all-30": (RECIPE, 30, (1, 2)),
    "all-60": (RECIPE, 60, (1,)),  # the recipe takes BPE-dropout 0.1 for an hour
    "plain-60": (RECIPE + ["--bpe-dropout", "0"], 60, (1,)),  # ... and here does not
    "bpedrop-30": (RECIPE + ["--bpe-dropout", "0.1"], 30, (1,)),  # BPE-dropout (Provilkov et al., 2020)
    **{  # de->en's README command
        f"bpedrop-src-{minutes}": (
            RECIPE + ["--bpe-dropout", "0.1", "--bpe-dropout-source-only"],
            minutes,
            seeds,
        )
        for minutes, seeds in ((15, (1,)), (30, (1, 2)), (60, (1,)))
    },
    **{f"updates-{n}": (RECIPE, n, (1, 2)) for n in UPDATES},  # a budget in updates, not minutes
    # regularisers for a short budget, each the recipe plus one change, at the ends of the range
    **{f"dropout2-updates-{n}": (RECIPE + ["--set", "dropout=0.2"], n, (1,)) for n in UPDATES},
    **{f"smoothing2-updates-{n}": (RECIPE + ["--set", "label_smoothing=0.2"], n, (1,)) for n in UPDATES},
    # a smaller vocabulary: each subword's embedding sees more updates (Gowda and May, 2020)
    **{f"vocab4000-updates-{n}": (RECIPE + ["--vocab-size", "4000"], n, (1,)) for n in UPDATES},
    # half the budget schedule's warmup (5% of the updates instead of 10%): more of a short budget at a
    # high learning rate
    **{f"warmup5-updates-{n}": (RECIPE + ["--set", "warmup_fraction=0.05"], n, (1,)) for n in UPDATES},
    # a higher peak learning rate (lr_scale 0.7 instead of the recipe's 0.5): more learning per update
    **{f"lr07-updates-{n}": (RECIPE + ["--set", "lr_scale=0.7"], n, (1,)) for n in UPDATES},
    # twice the target tokens an update (twice its compute): fewer, larger updates for the same budget
    **{f"batch2048-updates-{n}": (RECIPE + ["--max-tokens", "2048"], n, (1,)) for n in UPDATES},
    # de->en's README command at a budget in updates, in both directions: the source side's BPE-dropout
    # below the recipe's threshold for both sides
    **{
        f"bpedrop-src-updates-{n}": (RECIPE + ["--bpe-dropout", "0.1", "--bpe-dropout-source-only"], n, (1,))
        for n in UPDATES
    },
}
# Each direction's README command: the configuration whose runs make the README's table and the plot.
COMMAND = {"de-en": "bpedrop-src", "en-de": "all"}
NAMES = {"bpedrop-src": "the recipe, source-side BPE-dropout", "all": "the recipe"}


def minutes_of(config: str) -> int:
    """The budget of a timed configuration: "bpedrop-src-30" -> 30."""
    return int(config.rsplit("-", 1)[1])


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


def train(direction: str, config: str, seed: int) -> tuple[Path, bool]:
    """The run's directory, and whether it was trained now (not found finished)."""
    flags, minutes, _ = CONFIGS[config]
    src, tgt = direction.split("-")
    out = RUNS / run_name(direction, config, seed)
    if finished(out):
        return out, False
    budget = ["--max-updates" if "updates-" in config else "--max-minutes", str(minutes)]
    command = AIAYN + ["train", "--train", str(MULTI30K / "train"), "--valid", str(MULTI30K / "val"),
                       "--src-lang", src, "--tgt-lang", tgt, "--out", str(out), "--force", "--quiet",
                       *budget, *flags, "--set", f"seed={seed}"]  # fmt: skip
    print("$ " + " ".join(command[2:]), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, cwd=ROOT)
    return out, True


def load_record() -> dict:
    """What runs measured, by run name, and the ablation's cells by direction (docs/m30k_budget.json)."""
    if RECORD.is_file():
        return json.loads(RECORD.read_text(encoding="utf-8"))
    return {"runs": {}, "ablation": {}}


def save_record(record: dict) -> None:
    """Atomically: a run's figures cost up to an hour of CPU."""
    tmp = RECORD.with_name(RECORD.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, RECORD)


def record_run(record: dict, out: Path, trained: bool, config: str, direction: str, seed: int) -> dict:
    """Add a finished run's figures to the record; one found finished on disk and already recorded keeps
    its entry (its machine is the one it was trained on, not this one)."""
    s = summary(out)
    entry = {k: v for k, v in s.items() if k != "final"} | {"kept": s["final"]["kept"]}
    if trained or out.name not in record["runs"]:
        stamp = datetime.datetime.fromtimestamp(
            (out / "metrics.jsonl").stat().st_mtime, datetime.timezone.utc
        )
        entry |= {"config": config, "direction": direction, "seed": seed, "machine": machine(),
                  "date": stamp.date().isoformat()}  # fmt: skip
        record["runs"][out.name] = entry
    return record["runs"][out.name]


def recorded(record: dict, direction: str, config: str) -> list[float]:
    """The final BLEU of every recorded run of config in direction, by seed."""
    runs = [r for r in record["runs"].values() if r["config"] == config and r["direction"] == direction]
    return [r["final_bleu"] for r in sorted(runs, key=lambda r: r["seed"])]


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
        "minutes": max((r["minutes"] for r in records if "minutes" in r), default=None),
    }


def cells(direction: str, search: list[str]) -> dict:
    """The ablation's cells for one direction from the runs on disk (those missing are skipped)."""
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
    return row


def recipe_search() -> list[str]:
    """The recipe's search (its beam size and length penalty), which the decoding cell gives the model
    of before."""
    from aiayn.config import RECIPES, SearchConfig

    search = {**vars(SearchConfig()), **RECIPES["low-resource"].train}
    return ["--beam-size", str(search["beam_size"]), "--alpha", str(search["alpha"]),
            "--length-penalty", search["length_penalty"]]  # fmt: skip


def plot(record: dict, directions: list[str], path: Path) -> None:
    """BLEU against minutes, a line per direction through the best run at each budget; each run's marker
    names the CPU it trained on (minutes buy more updates on a faster one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in record["runs"].values() if r["config"].startswith(COMMAND[r["direction"]] + "-")]
    machines = sorted({r["machine"] for r in runs})
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, direction in enumerate(directions):
        mine = [r for r in runs if r["direction"] == direction]
        by_minutes: dict[int, list[float]] = {}
        for r in mine:
            by_minutes.setdefault(minutes_of(r["config"]), []).append(r["final_bleu"])
        xs = sorted(by_minutes)
        ax.plot(
            xs,
            [max(by_minutes[x]) for x in xs],
            "-",
            color=f"C{i}",
            label=f"{direction}: {NAMES[COMMAND[direction]]}",
        )
        for r in mine:
            ax.plot(
                minutes_of(r["config"]),
                r["final_bleu"],
                "osD^v"[machines.index(r["machine"]) % 5],
                color=f"C{i}",
            )
    for j, m in enumerate(machines):  # "2 cores, AMD EPYC (family 26 ...), torch ..." -> the CPU alone
        ax.plot([], [], "osD^v"[j % 5], color="gray", label=m.split(", torch")[0].removeprefix("2 cores, "))
    ax.set(xlabel="minutes of training (2-core CPU)", ylabel="validation sacreBLEU", xticks=[15, 30, 60],
           title="Multi30k, --preset low-resource")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
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
    record = load_record()
    for config in wanted:
        for direction in directions:
            for seed in [int(s) for s in args.seeds.split(",")] if args.seeds else CONFIGS[config][2]:
                out, trained = train(direction, config, seed)
                entry = record_run(record, out, trained, config, direction, seed)
                save_record(record)
                print(
                    json.dumps({"run": out.name, **{k: v for k, v in entry.items() if k != "curve"}}),
                    flush=True,
                )
    search = recipe_search()
    print("\n| direction | " + " | ".join(f"{m} min" for m in (15, 30, 60)) + " |")
    print("|---|---:|---:|---:|")
    by_direction = {}
    for direction in directions:
        by_minutes = {m: recorded(record, direction, f"{COMMAND[direction]}-{m}") for m in (15, 30, 60)}
        by_direction[direction] = {m: scores for m, scores in by_minutes.items() if scores}
        row = [" / ".join(f"{x:.2f}" for x in by_minutes[m]) or "-" for m in (15, 30, 60)]
        print(f"| {direction} | " + " | ".join(row) + " |")
    if any(by_direction.values()):
        plot(record, directions, Path(args.plot))
    print("\n| 30 minutes | none | budget schedule | averaging | recipe | decoding | all (seeds) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for direction in directions:
        row = record["ablation"].setdefault(direction, {})
        row |= cells(direction, search)  # what the runs on disk give replaces what was recorded
        get = [
            f"{row[k]:.2f}" if k in row else "-"
            for k in ("none", "budget", "averaging", "recipe", "decoding")
        ]
        every = " / ".join(f"{x:.2f}" for x in recorded(record, direction, f"{COMMAND[direction]}-30"))
        print(f"| {direction} | " + " | ".join(get) + " | " + every + " |")
    print("\n| direction | " + " | ".join(f"{n:,} updates" for n in UPDATES) + " |")
    print("|---|---:|---:|---:|")
    by_updates = {}
    for direction in directions:
        runs = {n: [r for r in record["runs"].values() if (r["config"], r["direction"]) == (f"updates-{n}", direction)]
                for n in UPDATES}  # fmt: skip
        by_updates[direction] = {n: [r["final_bleu"] for r in rs] for n, rs in runs.items() if rs}
        row = [
            " / ".join(f"{r['final_bleu']:.2f} ({r['minutes']:.0f} min)" for r in rs) or "-"
            for rs in runs.values()
        ]
        print(f"| {direction} | " + " | ".join(row) + " |")
    save_record(record)
    print(json.dumps({"machine": machine(), "minutes": by_direction, "updates": by_updates,
                      "ablation": record["ablation"]}))  # fmt: skip


if __name__ == "__main__":
    main()
