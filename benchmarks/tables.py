"""The tables of the README and docs/performance.md that hold measured figures, rendered from the results
files the benchmarks write, so that a figure there is always one a benchmark measured:

    docs/m30k_budget.json        python benchmarks/bench_budget.py      (quality: Multi30k under a CPU budget)
    docs/bench_train_cpu.json    python benchmarks/bench_train.py ... --results docs/bench_train_cpu.json
    docs/bench_translate_cpu.json  python benchmarks/bench_translate.py ... --results docs/bench_translate_cpu.json
    docs/bench_translate_cpu_bf16.json  python benchmarks/bench_translate.py --dtypes fp32,bf16 ... (on AMX)
    docs/bench_formats_cpu.json  python benchmarks/bench_formats.py --results docs/bench_formats_cpu.json
    docs/bench_cold_cpu.json, docs/bench_cold_cpu_avx2.json
                                 python benchmarks/bench_serve.py --cold-start [--isa avx2] --results ...
    docs/bench_opus_cpu.json     python benchmarks/bench_opus.py --results docs/bench_opus_cpu.json
    docs/bench_real_cpu.json     python benchmarks/bench_real.py --results docs/bench_real_cpu.json

`python benchmarks/tables.py` rewrites the tables between their markers; `--check` only says whether they
agree (tests/test_docs.py does the same).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

from aiayn.precision import translation_dtype

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_budget import (  # noqa: E402  (the README commands, whose runs make the table; a run's minutes)
    COMMAND,
    minutes_of,
)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
QUALITY = ROOT / "docs" / "m30k_budget.json"
TRAIN = ROOT / "docs" / "bench_train_cpu.json"
TRANSLATE = ROOT / "docs" / "bench_translate_cpu.json"
BF16 = ROOT / "docs" / "bench_translate_cpu_bf16.json"
FORMATS = ROOT / "docs" / "bench_formats_cpu.json"
PERFORMANCE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "docs" / "results.md"
COLD = ROOT / "docs" / "bench_cold_cpu.json"
COLD_AVX2 = ROOT / "docs" / "bench_cold_cpu_avx2.json"
OPUS = ROOT / "docs" / "bench_opus_cpu.json"
REAL = ROOT / "docs" / "bench_real_cpu.json"
TEXT = ROOT / "docs" / "bench_text_cpu.json"
MANY = ROOT / "docs" / "bench_serve_many_cpu.json"
ARROW = {"de-en": "de → en", "en-de": "en → de"}


def read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def quality(record: dict) -> str:
    """Validation BLEU of each direction's command by the updates its runs made (about 6,000, 12,000 and
    24,000: where a run's updates came within a tenth of one), a figure a run, each with its CPU and the
    minutes the updates took there: a budget in minutes buys a different number of updates on every CPU,
    an update is the same training everywhere."""
    runs = []
    for r in record["runs"].values():
        command = COMMAND[r["direction"]]
        config = r["config"]
        timed = config.startswith(f"{command}-") and config[len(command) + 1 :].isdigit()
        # the command given a budget in updates: updates-N for the recipe alone, COMMAND-updates-N otherwise
        given = config.startswith("updates-" if command == "all" else f"{command}-updates-")
        budget = budget_of(r)
        if (timed or given) and budget is not None and "not comparable" not in r.get("note", ""):
            minutes = minutes_of(config) if timed else r["minutes"]
            runs.append((r["direction"], budget, cpu_name(r["machine"], line=False), minutes, r))
    lines = ["| direction | " + " | ".join(f"~{n:,} updates" for n in UPDATES) + " |", "|---|---:|---:|---:|"]
    for direction in COMMAND:
        cells = []
        for budget in UPDATES:
            groups: dict[tuple[str, float], list[dict]] = {}
            for d, b, cpu, minutes, r in runs:
                if (d, b) == (direction, budget):
                    groups.setdefault((cpu, round(minutes, 1)), []).append(r)
            cells.append(
                "; ".join(
                    ", ".join(f"{r['final_bleu']:.2f}" for r in sorted(group, key=lambda r: r["seed"]))
                    + f" ({cpu}, {minutes:g} min)"
                    for (cpu, minutes), group in sorted(groups.items(), key=lambda g: (g[0][1], g[0][0]))
                )
                or "-"
            )
        lines.append(f"| {ARROW[direction]} | " + " | ".join(cells) + " |")
    dates = sorted(r["date"] for *_, r in runs)
    machines = sorted({f"{cpu} = {r['machine'].split(', ', 1)[1].rstrip(',')}" for *_, cpu, _, r in runs})
    lines += [
        "",
        f"sacreBLEU on the 1,014-pair validation split (`{record['signature']}`), one figure per run (seed), "
        f"with the CPU it was trained on and the minutes its updates took there; trained "
        f"{dates[0] if dates[0] == dates[-1] else f'{dates[0]} to {dates[-1]}'} on 2 cores: "
        f"{'; '.join(machines)}. {record['anchor']}",
    ]
    return "\n".join(lines)


# The recipe's runs by the updates they made: the budgets bench_budget.py gives in updates, and a run given
# minutes counted at the budget its updates came within a tenth of
UPDATES = (6000, 12000, 24000)
# the CPU families and models runs were recorded on: (vendor's line, core generation)
CPUS = {
    "family 25 model 17": ("AMD EPYC", "Zen 4"),
    "family 26 model 2": ("AMD EPYC", "Zen 5"),
    "family 6 model 85": ("Intel Xeon", "Cascade Lake"),
    "family 6 model 106": ("Intel Xeon", "Ice Lake"),
    "family 6 model 143": ("Intel Xeon", "Sapphire Rapids"),
}


def budget_of(run: dict) -> int | None:
    """The budget in UPDATES a run's updates came within a tenth of, or None."""
    return next((n for n in UPDATES if abs(run.get("updates", 0) - n) <= n / 10), None)


def cpu_name(machine: str, line: bool = True) -> str:
    """A run's CPU, short: its core generation where known (after the vendor's line, unless not line),
    else the machine as recorded."""
    known = next((CPUS[key] for key in CPUS if f"({key}," in machine), None)
    if known is None:
        return machine
    return " ".join(known) if line else known[1]


def by_updates(record: dict) -> str:
    """Validation BLEU of the recipe as `aiayn train` runs it with no --preset (configurations all-M and
    updates-N, the BPE-dropout the recipe takes for the run's updates), a row a run, by the updates it
    made: a budget in updates buys the same training on every CPU, and the minutes it took are its CPU's."""
    rows = []
    for r in record["runs"].values():
        config = r["config"]
        if not (config.startswith("updates-") or config.startswith("all-")) or "not comparable" in r.get(
            "note", ""
        ):
            continue
        budget = budget_of(r)
        if budget is None:
            continue
        minutes = r.get("minutes", minutes_of(config) if config.startswith("all-") else None)
        rows.append(
            (r["direction"], budget, r["updates"], r["final_bleu"], minutes, cpu_name(r["machine"]), r)
        )
    lines = [
        "| direction | budget | updates | validation BLEU | minutes | CPU | given |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for direction, budget, updates, bleu, minutes, cpu, r in sorted(rows, key=lambda row: row[:3]):
        given = (
            f"--max-updates {budget}" if r["config"].startswith("updates-") else f"--max-minutes {minutes:g}"
        )
        lines.append(
            f"| {ARROW[direction]} | {budget:,} | {updates:,} | {bleu:.2f} | {minutes:.1f} | {cpu} | `{given}` |"
        )
    return "\n".join(lines)


CONFIG_ORDER = ["low-resource", "small", "base"]
# what `aiayn translate` takes with no --dtype: fp32 on every CPU class (precision.translation_dtype)
TRANSLATION_DEFAULT = translation_dtype("auto", torch.device("cpu"))


def marked(dtype: str, default: str | None) -> str:
    """A number format, with "(default)" where it is the one aiayn takes on the run's CPU."""
    return f"{dtype} (default)" if dtype == default else dtype


def training_rows(train: dict) -> list[tuple[str, str, dict[str, float]]]:
    """(config, dtype, {system: target tokens/s}) of each cell of a training run, in the tables' order."""
    cells = sorted(
        {(r["config"], r["dtype"]) for r in train["results"]},
        key=lambda c: (CONFIG_ORDER.index(c[0]), c[1] != "fp32"),
    )
    return [
        (config, dtype, {r["system"]: r["tokens_per_s"] for r in train["results"] if (r["config"], r["dtype"]) == (config, dtype)})
        for config, dtype in cells
    ]  # fmt: skip


def speed(train: dict, translate: dict) -> str:
    """aiayn against the peers on the same workload, in one run of each benchmark: training against the
    best peer, in the format the CPU takes by default; translation in the default format against
    CTranslate2 (the faster of its thread counts), ONNX Runtime and transformers' generate, where the
    run measured them (int8's and bf16's cells: docs/performance.md)."""
    lines = [
        "| training | aiayn | best peer | aiayn / peer |",
        "|---|---:|---|---:|",
    ]
    for config, dtype, rows in training_rows(train):
        if dtype != train["defaults"][config]:  # (the other format: docs/performance.md)
            continue
        peer = max((s for s in rows if not s.startswith("aiayn")), key=rows.get)
        lines.append(
            f"| `{config}` {marked(dtype, train['defaults'][config])}, target tokens/s | {rows['aiayn']:,.0f} | "
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
    default = TRANSLATION_DEFAULT
    for (config, dtype, search, batch), rows in translation_cells(translate, (default,)):
        ct2 = max((s for s in rows if s.startswith("ctranslate2")), key=rows.get)
        peers = [s for s in rows if not s.startswith("aiayn")]
        best_peer = max(rows[s] for s in peers)
        compiled = rows.get("aiayn compiled (store)")
        best = max(rows["aiayn"], compiled or 0)
        lines.append(
            f"| `{config}` {marked(dtype, default)}, {described(search, batch)} | {rows['aiayn']:.1f} | "
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


def translation_cells(translate: dict, dtypes: tuple[str, ...]) -> list[tuple[tuple, dict[str, float]]]:
    """((config, dtype, search, batch), {system: sentences/s}) of a translation run's cells in these
    formats, in the tables' order."""
    cells = sorted(
        {
            (r["config"], r["dtype"], r["search"], r["batch"])
            for r in translate["results"]
            if r["dtype"] in dtypes
        },
        key=lambda c: (CONFIG_ORDER.index(c[0]), dtypes.index(c[1]), c[2] != "greedy", -c[3]),
    )
    return [
        (cell, {r["system"]: r["sentences_per_s"] for r in translate["results"] if (r["config"], r["dtype"], r["search"], r["batch"]) == cell})
        for cell in cells
    ]  # fmt: skip


def described(search: str, batch: int) -> str:
    sentences = "1 sentence" if batch == 1 else f"{batch} sentences a batch"
    return f"{search.replace('beam', 'beam ')}, {sentences}"


# bench_real.py's models, as a reader knows them
REAL_MODELS = {
    "shared": "the README's en → de model",
    "small": "`small`, 400 updates",
    "base": "`base`, 200 updates",
}


def real(record: dict, full: bool) -> str:
    """`aiayn translate` of Multi30k's validation file as whole processes (bench_real.py) against CTranslate2
    on the same model: decoding and whole-process seconds and the speed ratio against the faster of its
    thread counts, BLEU of both. The README: the default format; full: every format and aiayn's other
    paths (eager, exact stopping) too."""
    whole_file = max(r["sentences"] for r in record["results"])
    few = [r for r in record["results"] if r["sentences"] < whole_file]
    results = [r for r in record["results"] if r["sentences"] == whole_file]
    cells = sorted(
        {(r["model"], r["search"], r["dtype"]) for r in results if full or r["dtype"] == "default"},
        key=lambda c: (list(REAL_MODELS).index(c[0]), c[1] != "greedy", c[2] != "default"),
    )
    others = [s for s in ("aiayn eager", "aiayn exact") if full and any(r["system"] == s for r in results)]
    lines = [
        "| model, search, format | aiayn decoding | CTranslate2 | speed vs CT2 | aiayn whole process | "
        "CTranslate2 | speed vs CT2 | BLEU aiayn / CT2 | " + "".join(f"{s} decoding | " for s in others),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(others),
    ]
    for model, search, dtype in cells:
        rows = {
            r["system"]: r for r in results if (r["model"], r["search"], r["dtype"]) == (model, search, dtype)
        }
        ct2 = min((s for s in rows if s.startswith("ctranslate2")), key=lambda s: rows[s]["decoding_s"])
        ours, peer = rows["aiayn"], rows[ct2]
        fmt = f"{rows['aiayn']['format']} (default)" if dtype == "default" else dtype
        lines.append(
            f"| {REAL_MODELS[model]}, {search.replace('beam', 'beam ')}, {fmt} | {ours['decoding_s']:.2f} s | "
            f"{peer['decoding_s']:.2f} s ({ct2.split()[-1]}) | {peer['decoding_s'] / ours['decoding_s']:.2f}x | "
            f"{ours['whole_s']:.2f} s | {peer['whole_s']:.2f} s | {peer['whole_s'] / ours['whole_s']:.2f}x | "
            f"{ours['bleu']:.1f} / {peer['bleu']:.1f} | "
            + "".join(f"{rows[s]['decoding_s']:.2f} s | " if s in rows else "- | " for s in others)
        )
    if full and few:
        lines += [
            "",
            "| model, search, format | sentences | aiayn: decoding | whole process | aiayn eager: decoding | "
            "whole process | aiayn --compile: decoding | whole process |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for model, search, dtype, n in sorted(
            {(r["model"], r["search"], r["dtype"], r["sentences"]) for r in few},
            key=lambda c: (list(REAL_MODELS).index(c[0]), c[1] != "greedy", c[2] != "default", c[3]),
        ):
            rows = {r["system"]: r for r in few if (r["model"], r["search"], r["dtype"], r["sentences"]) == (model, search, dtype, n)}  # fmt: skip
            ours = rows["aiayn"]
            lines.append(
                f"| {REAL_MODELS[model]}, {search.replace('beam', 'beam ')}, "
                f"{ours['format'] + ' (default)' if dtype == 'default' else dtype} | {n} | "
                + "".join(
                    f"{rows[s]['decoding_s']:.2f} s | {rows[s]['whole_s']:.2f} s | "
                    if s in rows
                    else "- | - | "
                    for s in ("aiayn", "aiayn eager", "aiayn --compile")
                )
            )
    lines += [
        "",
        f"{record['machine']}, {record['date']} (`{record['command']}`): {whole_file:,} "
        f"sentences, each system a process of its own; CTranslate2 {record['ctranslate2']} on `aiayn export "
        "--format ctranslate2`'s "
        "directory with the faster of 1 and 2 threads (t), batches of 64.",
    ]
    return "\n".join(line.rstrip() for line in lines)


def cpu_training(train: dict) -> str:
    """Training on the CPU in every format measured, each system's speed and peak memory."""
    lines = [
        "| config | dtype | aiayn | torch.nn.Transformer | HF Marian | aiayn / best peer | peak RSS MB aiayn / torch.nn / Marian | aiayn with its bucketing |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    memory = {(r["config"], r["dtype"], r["system"]): r.get("peak_rss_mb") for r in train["results"]}
    for config, dtype, rows in training_rows(train):
        peer = max(rows.get("torch.nn", 0), rows.get("marian", 0))
        rss = " / ".join(
            f"{memory.get((config, dtype, s)) or 0:,.0f}" for s in ("aiayn", "torch.nn", "marian")
        )
        lines.append(
            f"| {config} | {marked(dtype, train['defaults'][config])} | {rows['aiayn']:,.0f} | "
            f"{rows.get('torch.nn', 0):,.0f} | {rows.get('marian', 0):,.0f} | {rows['aiayn'] / peer:.2f}x | {rss} | "
            f"{rows['aiayn (bucketing)']:,.0f} |"
        )
    peaks = ", ".join(f"{d} {v:,.0f}" for d, v in train["gemm_peak_gflops"].items())
    lines += [
        "",
        f"{train['machine']}, {train['date']} (`{train['command']}`); measured GEMM peak (GFLOP/s): {peaks}.",
    ]
    return "\n".join(lines)


def cpu_bf16(translate: dict) -> str:
    """What bf16 buys for translation on the run's CPU against its default format (fp32)."""
    default = TRANSLATION_DEFAULT
    cells = dict(translation_cells(translate, (default, "bf16")))
    lines = [
        f"| config | search | batch | {default} (default): aiayn | compiled | bf16: aiayn | compiled | "
        f"aiayn's best, bf16 / {default} |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]

    def best(rows: dict[str, float]) -> float:
        return max(rows["aiayn"], rows.get("aiayn compiled (store)", 0))

    for (config, dtype, search, batch), bf16 in cells.items():
        if dtype != "bf16":
            continue
        base = cells[(config, default, search, batch)]
        figures = [
            base["aiayn"],
            base.get("aiayn compiled (store)"),
            bf16["aiayn"],
            bf16.get("aiayn compiled (store)"),
        ]
        lines.append(
            f"| {config} | {search.replace('beam', 'beam ')} | {batch} | "
            + "".join(f"{v:.1f} | " if v else "- | " for v in figures)
            + f"{best(bf16) / best(base):.2f}x |"
        )
    lines += ["", f"{translate['machine']}, {translate['date']} (`{translate['command']}`)."]
    return "\n".join(lines)


def formats(record: dict) -> str:
    """What each number format changes on a trained model against fp32."""
    n, alone = record["sentences"], record["alone"]
    lines = [
        f"| dtype | BLEU | translations unlike fp32's (of {n:,}) | alone unlike in its batch (of {alone}) | decoding s |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in record["results"]:
        lines.append(
            f"| {marked(r['dtype'], TRANSLATION_DEFAULT)} | {r['bleu']:.2f} | {r['differ_from_fp32']} | "
            f"{r['alone_differs_from_batch']} | {r['decoding_s']:.1f} |"
        )
    lines += [
        "",
        f"`{record['model']}`, {record['search']}, eager; {record['machine']}, {record['date']} (`{record['command']}`).",
    ]
    return "\n".join(lines)


def cold_start(runs: list[dict], full: bool) -> str:
    """What a user waits for at the start (bench_serve.py --cold-start): `aiayn serve`'s first translation
    and full speed, from an empty store and from the one that start filled, and `translate --compile` of
    one sentence. full: every figure of every run (performance.md); else fp32 of the first (the README)."""
    lines = [
        "| CPU | model | serve, empty store: first translation | full speed | graphs (compile s) | "
        "filled store: first translation | full speed | translate --compile, 1 sentence: empty | filled |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs if full else runs[:1]:
        where = "capped at AVX2" if run["isa"] == "avx2" else "native"
        for r in run["results"]:
            if not full and r["dtype"] != "fp32":
                continue
            e, w = r["serve_empty"], r["serve_warm"]
            lines.append(
                f"| {where} | `{r['config']}` {r['dtype']} | {e['first_s']:.1f} s | {e['full_s']:.0f} s | "
                f"{len(e['graphs'])} ({e['compile_s']:.0f} s) | {w['first_s']:.1f} s | {w['full_s']:.0f} s | "
                f"{r['translate_empty_s']:.0f} s | {r['translate_warm_s']:.1f} s |"
            )
    lines += [""] + [
        f"{run['machine']}, {run['date']} (`{run['command']}`)." for run in (runs if full else runs[:1])
    ]
    return "\n".join(lines)


def opus(record: dict) -> str:
    """An OPUS-MT-shaped model (bench_opus.py): aiayn after import against CTranslate2 after
    ct2-transformers-converter and transformers' generate, sentences/s."""
    results = record["results"]
    lines = [
        "| OPUS-MT shape, sentences/s | aiayn | aiayn compiled | CTranslate2 | transformers generate | "
        "aiayn's best / CTranslate2 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    cells = sorted({(r["dtype"], r["search"], r["batch"]) for r in results},
                   key=lambda c: (c[0] != "fp32", c[1] != "greedy", c[2]))  # fmt: skip
    for cell in cells:
        rows = {
            r["system"]: r["sentences_per_s"]
            for r in results
            if (r["dtype"], r["search"], r["batch"]) == cell
        }
        ct2 = max((s for s in rows if s.startswith("ctranslate2")), key=rows.get)
        compiled = rows.get("aiayn compiled")
        generate = rows.get("transformers generate")
        dtype, search, batch = cell
        sentences = "1 sentence" if batch == 1 else f"{batch} sentences a batch"
        lines.append(
            f"| {dtype}, {search.replace('beam', 'beam ')}, {sentences} | {rows['aiayn']:.1f} | "
            f"{f'{compiled:.1f}' if compiled else '-'} | {rows[ct2]:.1f} ({ct2.split()[-1]}) | "
            f"{f'{generate:.1f}' if generate else '-'} | {max(rows['aiayn'], compiled or 0) / rows[ct2]:.2f}x |"
        )
    lines += ["", f"{record['machine']}, {record['date']} (`{record['command']}`)."]
    return "\n".join(lines)


PEERS = {
    "torch.nn": "torch.nn.Transformer",
    "marian": "HF Marian",
    "ctranslate2 1t": "CTranslate2, 1 thread",
    "ctranslate2 2t": "CTranslate2, 2 threads",
    "onnxruntime": "ONNX Runtime",
    "marian generate": "transformers generate",
}


def text_choice(record: dict) -> str:
    """The sentence splitters and language detectors bench_text.py measured, and which it chose."""
    lines = [
        "| sentence splitter | paragraphs split exactly: Multi30k / hard | boundary F1 | sentences/s | "
        "raised or changed text (fuzz lines) |",
        "|---|---:|---:|---:|---:|",
    ]
    chosen = record["splitters"]["chosen"]
    for name, r in record["splitters"]["summary"].items():
        robust = r["robustness"]
        lines.append(
            f"| {'**' + name + '** (chosen)' if name == chosen else name} | {r['exact_pct_multi30k']:.1f}% / "
            f"{r['exact_pct_hard']:.1f}% | {r['f1']:.3f} | {r['sentences_per_s']:,.0f} | "
            f"{robust['raised'] + robust['changed']} of {robust['lines']:,} |"
        )
    lines += ["", "| language detector | right: whole sentences / first 3 words | ms a call | loading: s, MB |",
              "|---|---:|---:|---:|"]  # fmt: skip
    chosen = record["detectors"]["chosen"]
    for name, r in record["detectors"]["rows"].items():
        lines.append(
            f"| {'**' + name + '** (chosen)' if name == chosen else name} | {r['accuracy_full_pct']:.1f}% / "
            f"{r['accuracy_short_pct']:.1f}% | {r['ms_per_call_full']:.2f} | {r['build_s']:.2f}, {r['rss_mb']:.0f} |"
        )
    lines += [
        "",
        f"English, German and French; {record['machine']}, {record['date']} (`{record['command']}`).",
    ]
    return "\n".join(lines)


def many_models(record: dict) -> str:
    """LibreTranslate's requests to one model alone, to a mix over three in one server, and to the three
    under a cap that holds two (bench_serve.py --many-models)."""
    lines = ["| setup | clients | sentences/s | p50 / p99 ms | against one model | mean batch | errors |",
             "|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    alone = {c["clients"]: c for c in record["cells"] if c["setup"] == "one model"}
    for c in record["cells"]:
        ratio = c["sentences_per_s"] / alone[c["clients"]]["sentences_per_s"]
        errors = ", ".join(f"{k}: {v}" for k, v in c["errors"].items()) or "none"
        lines.append(f"| {c['setup']} | {c['clients']} | {c['sentences_per_s']:.1f} | {c['p50_ms']:.0f} / "
                     f"{c['p99_ms']:.0f} | {ratio:.2f}x | {c['mean_batch']:.1f} | {errors} |")  # fmt: skip
    lines += ["", f"`{record['model']}` ({record['model_mb']} MiB of weights) under three names; {record['machine']}, "
              f"{record['date']} (`{record['command']}`)."]  # fmt: skip
    return "\n".join(lines)


def tables(page: Path = README) -> dict[str, str]:
    """The tables of one page (README.md or docs/performance.md), by name."""
    cold = [read(COLD), read(COLD_AVX2)]
    if page == PERFORMANCE:
        return {
            "cpu training": cpu_training(read(TRAIN)),
            "cpu bf16": cpu_bf16(read(BF16)),
            "formats": formats(read(FORMATS)),
            "cold start": cold_start(cold, full=True),
            "opus-mt": opus(read(OPUS)),
            "real work": real(read(REAL), full=True),
            "many models": many_models(read(MANY)),
            "text": text_choice(read(TEXT)),
        }
    if page == RESULTS:
        return {"updates": by_updates(read(QUALITY))}
    return {
        "real work": real(read(REAL), full=False),
        "quality": quality(read(QUALITY)),
        "speed": speed(read(TRAIN), read(TRANSLATE)),
        "cold start": cold_start(cold, full=False),
    }


def block(name: str) -> re.Pattern:
    """A table's place in a page: between <!-- NAME table --> and <!-- end NAME table -->."""
    return re.compile(rf"(<!-- {name} table[^>]*-->\n)(.*?)(<!-- end {name} table -->)", re.S)


def rendered(text: str, page: Path = README) -> str:
    """text (of page) with every table block replaced by its rendering."""
    for name, table in tables(page).items():
        pattern = block(name)
        if not pattern.search(text):
            raise SystemExit(f"{page.name} has no <!-- {name} table --> block")
        text = pattern.sub(lambda m, table=table: m.group(1) + table + "\n" + m.group(3), text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only say whether the tables are current")
    args = p.parse_args()
    stale = []
    for page in (README, PERFORMANCE, RESULTS):
        text = page.read_text(encoding="utf-8")
        new = rendered(text, page)
        if new != text:
            stale.append(page.name)
            if not args.check:
                page.write_text(new, encoding="utf-8")
    if args.check and stale:
        sys.exit(f"{', '.join(stale)}: the tables differ from the results files: run benchmarks/tables.py")


if __name__ == "__main__":
    main()
