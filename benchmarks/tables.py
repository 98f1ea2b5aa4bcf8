"""The README's quality and speed tables, rendered from the results files the benchmarks write, so that
a figure in the README is always one a benchmark measured:

    docs/m30k_budget.json        python benchmarks/bench_budget.py      (quality: Multi30k under a CPU budget)
    docs/bench_train_cpu.json    python benchmarks/bench_train.py ... --results docs/bench_train_cpu.json
    docs/bench_translate_cpu.json  python benchmarks/bench_translate.py ... --results docs/bench_translate_cpu.json

`python benchmarks/tables.py` rewrites the tables in README.md between their markers; `--check` only says
whether they agree (tests/test_docs.py does the same).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_budget import COMMAND  # noqa: E402  (each direction's README command: its runs make the table)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
QUALITY = ROOT / "docs" / "m30k_budget.json"
TRAIN = ROOT / "docs" / "bench_train_cpu.json"
TRANSLATE = ROOT / "docs" / "bench_translate_cpu.json"
ARROW = {"de-en": "de → en", "en-de": "en → de"}
MINUTES = (15, 30, 60)


def read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def quality(record: dict) -> str:
    """Validation BLEU of each direction's command at 15, 30 and 60 CPU minutes, a figure a run, of the
    runs on the CPU kind most of them were trained on (a budget in minutes buys more updates on a faster
    CPU, so figures of other kinds would not compare)."""
    runs = [r for r in record["runs"].values() if r["config"].startswith(tuple(COMMAND.values()))]
    machines = [r["machine"] for r in runs]
    machine = max(set(machines), key=machines.count)
    lines = ["| direction | " + " | ".join(f"{m} minutes" for m in MINUTES) + " |", "|---|---:|---:|---:|"]
    for direction, config in COMMAND.items():
        cells = []
        for minutes in MINUTES:
            chosen = sorted(
                (
                    r
                    for r in runs
                    if (r["config"], r["direction"], r["machine"])
                    == (f"{config}-{minutes}", direction, machine)
                ),
                key=lambda r: r["seed"],
            )
            cells.append(", ".join(f"{r['final_bleu']:.2f}" for r in chosen) or "-")
        lines.append(f"| {ARROW[direction]} | " + " | ".join(cells) + " |")
    dates = sorted(r["date"] for r in runs if r["machine"] == machine)
    lines += [
        "",
        f"sacreBLEU on the 1,014-pair validation split (`{record['signature']}`), one figure per run (seed); "
        f"trained {dates[0] if dates[0] == dates[-1] else f'{dates[0]} to {dates[-1]}'} on {machine}. "
        f"{record['anchor']}",
    ]
    return "\n".join(lines)


def speed(train: dict, translate: dict) -> str:
    """aiayn against the peers on the same workload, in one run of each benchmark: training against the
    best peer; translation against CTranslate2 (the faster of its thread counts), ONNX Runtime and
    transformers' generate, where the run measured them."""
    lines = [
        "| training | aiayn | best peer | aiayn / peer |",
        "|---|---:|---|---:|",
    ]
    for config in sorted({r["config"] for r in train["results"]}, key=["small", "base"].index):
        for dtype in sorted({r["dtype"] for r in train["results"]}):
            rows = {r["system"]: r["tokens_per_s"] for r in train["results"]
                    if (r["config"], r["dtype"]) == (config, dtype)}  # fmt: skip
            peer = max((s for s in rows if not s.startswith("aiayn")), key=rows.get)
            lines.append(
                f"| `{config}` {dtype}, target tokens/s | {rows['aiayn']:,.0f} | "
                f"{rows[peer]:,.0f} ({PEERS.get(peer, peer)}) | {rows['aiayn'] / rows[peer]:.2f}x |"
            )
    systems = {r["system"] for r in translate["results"]}
    others = [s for s in ("onnxruntime", "marian generate") if s in systems]
    lines += [
        "",
        "| translation, sentences/s | aiayn | aiayn compiled | CTranslate2 | "
        + "".join(f"{PEERS[s]} | " for s in others)
        + "aiayn's best / best peer |",
        "|---|---:|---:|---:|" + "---:|" * len(others) + "---:|",
    ]
    cells = sorted(
        {(r["config"], r["dtype"], r["search"], r["batch"]) for r in translate["results"]},
        key=lambda c: (["small", "base"].index(c[0]), c[1] != "fp32", c[2] != "greedy", -c[3]),
    )
    for cell in cells:
        rows = {r["system"]: r["sentences_per_s"] for r in translate["results"]
                if (r["config"], r["dtype"], r["search"], r["batch"]) == cell}  # fmt: skip
        ct2 = max((s for s in rows if s.startswith("ctranslate2")), key=rows.get)
        peers = [s for s in rows if not s.startswith("aiayn")]
        best_peer = max(rows[s] for s in peers)
        compiled = rows.get("aiayn compiled (store)")
        best = max(rows["aiayn"], compiled or 0)
        config, dtype, search, batch = cell
        sentences = "1 sentence" if batch == 1 else f"{batch} sentences a batch"
        lines.append(
            f"| `{config}` {dtype}, {search.replace('beam', 'beam ')}, {sentences} | {rows['aiayn']:.1f} | "
            f"{f'{compiled:.1f}' if compiled else '-'} | {rows[ct2]:.1f} ({ct2.split()[-1]}) | "
            + "".join(f"{rows[s]:.1f} | " if s in rows else "- | " for s in others)
            + f"{best / best_peer:.2f}x |"
        )
    lines += [
        "",
        f"Training: {train['machine']}, {train['date']} (`{train['command']}`). Translation: "
        f"{translate['machine']}, {translate['date']} (`{translate['command']}`); CTranslate2 with the "
        "faster of 1 and 2 threads (t), ONNX Runtime fp32 only.",
    ]
    return "\n".join(lines)


PEERS = {
    "torch.nn": "torch.nn.Transformer",
    "marian": "HF Marian",
    "ctranslate2 1t": "CTranslate2, 1 thread",
    "ctranslate2 2t": "CTranslate2, 2 threads",
    "onnxruntime": "ONNX Runtime",
    "marian generate": "transformers generate",
}


def tables() -> dict[str, str]:
    return {"quality": quality(read(QUALITY)), "speed": speed(read(TRAIN), read(TRANSLATE))}


def block(name: str) -> re.Pattern:
    """A table's place in the README: between <!-- NAME table --> and <!-- end NAME table -->."""
    return re.compile(rf"(<!-- {name} table[^>]*-->\n)(.*?)(<!-- end {name} table -->)", re.S)


def rendered(text: str) -> str:
    """text with every table block replaced by its rendering."""
    for name, table in tables().items():
        pattern = block(name)
        if not pattern.search(text):
            raise SystemExit(f"README.md has no <!-- {name} table --> block")
        text = pattern.sub(lambda m, table=table: m.group(1) + table + "\n" + m.group(3), text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only say whether README.md's tables are current")
    args = p.parse_args()
    text = README.read_text(encoding="utf-8")
    new = rendered(text)
    if args.check:
        sys.exit(
            0 if new == text else "README.md's tables differ from the results files: run benchmarks/tables.py"
        )
    README.write_text(new, encoding="utf-8")


if __name__ == "__main__":
    main()
