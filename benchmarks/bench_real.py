"""Translation of real text with trained models, as a user runs it: `aiayn translate` of a file, a whole
process a run, against CTranslate2 on the same model.

Models: the one the README's en -> de command trained (../shared/models/m30k-en-de-low-resource), and
`small` and `base` trained briefly by this benchmark on the same Multi30k with the CLI (kept in
--workdir): real output lengths, hypotheses that end at different steps. Input: Multi30k's 1,014
validation English sentences. For each model, search (greedy; beam 4 with the average length penalty
and the model's alpha) and number format (fp32, int8):

- `aiayn`: `aiayn translate MODEL --input F --output O` with no other flags for the model's own search
  in the default number format; `--dtype int8` and `--beam-size 1` where asked. For the
  --compiled-models (all by default), an earlier `--compile` of the same file filled the store (not
  timed), so this decodes with the stored graphs, as a user's runs do after one `--compile`; for the
  others with none (eager decoding);
- `aiayn eager`: the same with `--no-compile`;
- `aiayn exact` (not run unless named): the same as `aiayn` with `--stopping exact`;
- for the compiled models, `aiayn`, `aiayn eager` and `aiayn --compile` also translate the first --few
  lines (1 and 8): what loading the stored graphs costs a process that translates little;
- `ctranslate2 1t`, `2t`: `aiayn export --format ctranslate2`'s directory in a process of its own that
  reads the file, tokenizes it with the model's tokenizer.json, calls `translate_batch` (the same beam
  and length penalty, max_batch_size 64) and writes the detokenized lines, with 1 or 2 threads.

Each cell reports the decoding seconds (the CLI's own "translated N lines in S s"; CTranslate2: its
translate_batch call) and the whole process's, the best of --reps runs (the systems alternating), and
sacreBLEU of the output against the German references; the store of
compiled graphs is the benchmark's own (AIAYN_COMPILE_STORE under --workdir). --profile adds where an
eager run's time goes: the process's phases (import, load, tokenization and batching, decoding,
detokenization) and torch.profiler's operators of the decoding.

    python benchmarks/bench_real.py [--models shared,small,base] [--searches greedy,beam4]
                                    [--dtypes default,int8] [--compiled-models shared] [--reps 2]
                                    [--profile] [--results FILE]
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
MULTI30K = SHARED / "data" / "multi30k"
SHARED_MODEL = SHARED / "models" / "m30k-en-de-low-resource"
AIAYN = [sys.executable, "-m", "aiayn"]
# the updates `small` and `base` train for (a few minutes each on 2 cores): enough to end their outputs
UPDATES = {"small": 400, "base": 200}
SEARCHES = {"greedy": 1, "beam4": 4}
CT2_COMPUTE = {"fp32": "float32", "int8": "int8"}
FORMAT = {"default": "fp32", "int8": "int8"}
SYSTEMS = (
    "aiayn",
    "aiayn eager",
    "aiayn exact",
    "ctranslate2 1t",
    "ctranslate2 2t",
)  # the number format of each: a CPU's default is fp32
# the profile's operators by what they do in a decoding step
OPERATOR_GROUPS = {
    "matrix products": {"aten::addmm", "aten::mm", "aten::bmm", "aten::matmul"},
    "attention": {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_softmax"},
    "cache reorders and finished sentences": {"aten::index_select", "aten::index", "aten::gather"},
    "copies": {"aten::copy_", "aten::cat", "aten::fill_"},
    "the search's softmax and top-k": {"aten::_log_softmax", "aten::topk", "aten::amax", "aten::max",
                                       "aten::logsumexp", "aten::exp", "aten::sub"},
    "norms, residuals, activations": {"aten::native_layer_norm", "aten::add", "aten::clamp_min", "aten::relu"},
}  # fmt: skip
TRANSLATED = re.compile(r"translated (\d+) lines in ([\d.]+) s")


def trained(name: str, workdir: Path) -> Path:
    """The model `name`: the shared one, or `small`/`base` trained once into workdir with the CLI (the
    average length penalty, which CTranslate2's beam search has, with alpha 1.0 as the shared model's)."""
    if name == "shared":
        return SHARED_MODEL
    out = workdir / name
    if not (out / "config.json").is_file():
        command = [*AIAYN, "train", "--train", MULTI30K / "train", "--valid", MULTI30K / "val",
                   "--src-lang", "en", "--tgt-lang", "de", "--preset", name, "--max-updates", UPDATES[name],
                   "--set", "length_penalty=average", "--set", "alpha=1.0", "--out", out, "--force", "--quiet"]  # fmt: skip
        print(f"training {name}: {shlex.join(map(str, command))}", flush=True)
        subprocess.run([str(c) for c in command], check=True, stdout=subprocess.DEVNULL)
    return out


def exported(model: Path, workdir: Path, name: str) -> Path:
    out = workdir / f"{name}-ct2"
    if not (out / "model.bin").is_file():
        command = [*AIAYN, "export", str(model), "--format", "ctranslate2", "--out", str(out), "--force"]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return out


def timed(command: list[str], env: dict) -> tuple[float, float, str]:
    """(whole-process seconds, decoding seconds, stderr) of a command that prints "translated N lines in S s"."""
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    whole = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{done.stderr[-3000:]}")
    found = TRANSLATED.findall(done.stderr)
    if not found:
        raise RuntimeError(f"{shlex.join(command)} printed no decoding time:\n{done.stderr[-2000:]}")
    return whole, float(found[-1][1]), done.stderr


def aiayn_command(model: Path, src: Path, out: Path, dtype: str, beam: int, *flags: str) -> list[str]:
    """`aiayn translate` of src with the flags a user would give: none for the model's own search in the
    default number format."""
    command = [*AIAYN, "translate", str(model), "--input", str(src), "--output", str(out), "--quiet", *flags]
    if dtype != "default":
        command += ["--dtype", dtype]
    if beam != json.loads((model / "search.json").read_text())["beam_size"]:
        command += ["--beam-size", str(beam)]
    return command


def ct2_command(
    directory: Path, src: Path, out: Path, dtype: str, beam: int, alpha: float, threads: int
) -> list[str]:
    return [sys.executable, __file__, "--ct2-child", str(directory), str(src), str(out), CT2_COMPUTE[dtype],
            str(beam), str(alpha), str(threads)]  # fmt: skip


def ct2_child(directory: str, src: str, out: str, compute: str, beam: str, alpha: str, threads: str) -> None:
    """A CTranslate2 user's whole process: read, tokenize with the model's tokenizer.json (EOS appended, as
    aiayn's ids carry it), translate_batch, detokenize, write; only ctranslate2 and tokenizers imported."""
    import ctranslate2
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    translator = ctranslate2.Translator(directory, device="cpu", compute_type=compute, intra_threads=int(threads),
                                        inter_threads=1)  # fmt: skip
    lines = Path(src).read_text(encoding="utf-8").splitlines()
    batch = [tokenizer.encode(line, add_special_tokens=False).tokens + ["</s>"] for line in lines]
    start = time.perf_counter()
    results = translator.translate_batch(batch, beam_size=int(beam), length_penalty=float(alpha) if int(beam) > 1 else 0.0,
                                         max_batch_size=64, max_input_length=0)  # fmt: skip
    seconds = time.perf_counter() - start
    vocab = tokenizer.get_vocab()
    texts = [tokenizer.decode([vocab[t] for t in r.hypotheses[0] if t != "</s>"]) for r in results]
    Path(out).write_text("".join(t.replace("\n", " ") + "\n" for t in texts), encoding="utf-8")
    print(f"translated {len(lines)} lines in {seconds:.3f} s", file=sys.stderr)


def profile(model: Path, src: list[str], beam: int) -> dict:
    """Where an eager fp32 run's time goes: the phases of a process (import in a fresh interpreter) and the
    operators of the decoding."""
    command = [sys.executable, "-c", "import time; t = time.perf_counter(); import aiayn.cli.main, "
               "aiayn.inference.translate; print(time.perf_counter() - t)"]  # fmt: skip
    phases = {"import": float(subprocess.run(command, capture_output=True, text=True, check=True).stdout)}
    import torch
    from torch.profiler import ProfilerActivity, profile

    from aiayn.inference.translate import Translator

    start = time.perf_counter()
    translator = Translator.load(model, dtype="fp32", device="cpu", compile=False)
    phases["load"] = time.perf_counter() - start
    search = dataclasses.replace(translator.search_config, beam_size=beam)
    start = time.perf_counter()
    ids = translator.tokenizer.encode_src(src)
    batches = list(translator.batches([len(x) for x in ids], beam))
    phases["tokenize and batch"] = time.perf_counter() - start
    start = time.perf_counter()
    with torch.inference_mode():
        hyps = translator.translate_ids(ids, search)
    phases["decode"] = time.perf_counter() - start
    start = time.perf_counter()
    translator.tokenizer.decode_tgt([h[0].tokens for h in hyps])
    phases["detokenize"] = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        translator.translate_ids(ids, search)
        wall = time.perf_counter() - start
    events = prof.key_averages()
    operators = sum(e.self_cpu_time_total for e in events) / 1e6
    print(
        f"\nphases of an eager fp32 run, beam {beam} (s): "
        + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
    )
    print(f"{len(batches)} batches of {min(map(len, batches))}-{max(map(len, batches))} sentences; under the "
          f"profiler {wall:.2f} s, of which operators {operators:.2f} s ({100 * operators / wall:.0f}%)")  # fmt: skip
    print(events.table(sort_by="self_cpu_time_total", row_limit=20))
    groups: dict[str, float] = dict.fromkeys([*OPERATOR_GROUPS, "other operators"], 0.0)
    for e in events:
        group = next((g for g, names in OPERATOR_GROUPS.items() if e.key in names), "other operators")
        groups[group] += e.self_cpu_time_total / 1e6
    groups["Python and dispatch (outside operators)"] = wall - operators
    print("where the decoding's time goes (s): " + ", ".join(f"{g} {t:.2f}" for g, t in groups.items()))
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]
    return {
        "phases_s": phases,
        "batches": [len(b) for b in batches],
        "profiled_wall_s": wall,
        "operators_s": operators,
        "groups_s": groups,
        "top_operators": [
            {"name": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in top
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="shared,small,base")
    ap.add_argument("--searches", default="greedy,beam4")
    ap.add_argument("--dtypes", default="default,int8")
    ap.add_argument("--systems", default="aiayn,aiayn eager,ctranslate2 1t,ctranslate2 2t")
    ap.add_argument(
        "--compiled-models", default="shared,small,base", help="the models whose graphs are stored first"
    )
    ap.add_argument("--few", default="1,8", help="also time the first N lines, eager and compiled (stored)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench_real"))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--results", help="also write the summary to this JSON file")
    ap.add_argument("--ct2-child", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ct2_child:  # (before importing what the benchmark uses: torch, aiayn)
        return ct2_child(*args.ct2_child)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sacrebleu
    from common import machine, save_results

    if not (MULTI30K / "val.en.gz").is_file() or not SHARED_MODEL.is_dir():
        print(f"bench_real: skipped, it needs {MULTI30K} and {SHARED_MODEL} (the shared data and model)")
        return
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / "val.en"
    with gzip.open(MULTI30K / "val.en.gz", "rt", encoding="utf-8") as f:
        lines = f.read().splitlines()
    src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    with gzip.open(MULTI30K / "val.de.gz", "rt", encoding="utf-8") as f:
        references = f.read().splitlines()
    env = {**os.environ, "AIAYN_COMPILE_STORE": str(workdir / "store")}
    # a user's Python writes the bytecode of what it imports once; where this machine's environment says
    # not to, every process would compile every module it imports again (seconds of torch's import)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    systems = args.systems.split(",")
    print(f"machine: {machine()}", flush=True)
    results, profiles = [], {}
    for name in args.models.split(","):
        model = trained(name, workdir)
        alpha = json.loads((model / "search.json").read_text())["alpha"]
        ct2 = exported(model, workdir, name) if any(s.startswith("ctranslate2") for s in systems) else None
        if args.profile:
            profiles[name] = profile(model, lines, 4)
        for search in args.searches.split(","):
            beam = SEARCHES[search]
            for dtype in args.dtypes.split(","):
                out = {system: workdir / f"out-{system.replace(' ', '-')}.txt" for system in SYSTEMS}
                compiled = name in args.compiled_models.split(",")
                if compiled:  # the store filled as a user's first --compile fills it
                    subprocess.run(aiayn_command(model, src, out["aiayn"], dtype, beam, "--compile"), env=env,
                                   check=True, capture_output=True)  # fmt: skip
                commands = {
                    "aiayn": aiayn_command(model, src, out["aiayn"], dtype, beam),
                    "aiayn eager": aiayn_command(model, src, out["aiayn eager"], dtype, beam, "--no-compile"),
                    "aiayn exact": aiayn_command(
                        model, src, out["aiayn exact"], dtype, beam, "--stopping", "exact"
                    ),
                    "ctranslate2 1t": ct2_command(
                        ct2, src, out["ctranslate2 1t"], FORMAT[dtype], beam, alpha, 1
                    ),
                    "ctranslate2 2t": ct2_command(
                        ct2, src, out["ctranslate2 2t"], FORMAT[dtype], beam, alpha, 2
                    ),
                }
                here = list(systems)
                runs: dict[str, list[tuple[float, float]]] = {s: [] for s in here}
                for _ in range(args.reps):  # alternating: each system once a round
                    for system in here:
                        whole, decoding, _ = timed(commands[system], env)
                        runs[system].append((whole, decoding))
                for system in here:
                    whole, decoding = min(w for w, _ in runs[system]), min(d for _, d in runs[system])
                    hypotheses = out[system].read_text(encoding="utf-8").splitlines()
                    bleu = sacrebleu.corpus_bleu(hypotheses, [references]).score
                    row = {"model": name, "search": search, "dtype": dtype, "format": FORMAT[dtype], "system": system,
                           "sentences": len(lines), "decoding_s": decoding, "whole_s": whole, "bleu": bleu}  # fmt: skip
                    results.append(row)
                    print(f"{name:7} {search:6} {dtype:7} {system:15} decoding {decoding:6.2f} s "
                          f"({len(lines) / decoding:7.1f} sent/s)  whole {whole:6.2f} s  BLEU {bleu:5.2f}", flush=True)  # fmt: skip
                if compiled:  # a few sentences: what loading the graphs costs a process
                    few_systems = {
                        "aiayn": (),
                        "aiayn eager": ("--no-compile",),
                        "aiayn --compile": ("--compile",),
                    }
                    for n in [int(n) for n in args.few.split(",") if n]:
                        few = workdir / f"val-{n}.en"
                        few.write_text("".join(line + "\n" for line in lines[:n]), encoding="utf-8")
                        few_runs: dict[str, list[tuple[float, float]]] = {
                            system: [] for system in few_systems
                        }
                        for _ in range(args.reps):
                            for system, flags in few_systems.items():
                                command = aiayn_command(model, few, out["aiayn"], dtype, beam, *flags)
                                few_runs[system].append(timed(command, env)[:2])
                        for system, times in few_runs.items():
                            whole, decoding = min(w for w, _ in times), min(d for _, d in times)
                            results.append({"model": name, "search": search, "dtype": dtype, "format": FORMAT[dtype],
                                            "system": system, "sentences": n, "decoding_s": decoding,
                                            "whole_s": whole, "bleu": None})  # fmt: skip
                            print(f"{name:7} {search:6} {dtype:7} {system:15} {n} sentences: decoding "
                                  f"{decoding:6.2f} s  whole {whole:6.2f} s", flush=True)  # fmt: skip
    ratios = {}
    for row in results:
        if row["system"].startswith("aiayn") and row["sentences"] == len(lines):
            peers = [r for r in results if (r["model"], r["search"], r["dtype"]) == (row["model"], row["search"], row["dtype"])
                     and r["system"].startswith("ctranslate2")]  # fmt: skip
            if peers:
                best = min(peers, key=lambda r: r["decoding_s"])
                key = f"{row['model']}/{row['search']}/{row['dtype']}/{row['system']}"
                ratios[key] = {"decoding_vs_faster_ctranslate2": best["decoding_s"] / row["decoding_s"],
                               "whole_vs_faster_ctranslate2": best["whole_s"] / row["whole_s"]}  # fmt: skip
    for key, ratio in ratios.items():
        print(f"{key}: {ratio['decoding_vs_faster_ctranslate2']:.2f}x CTranslate2's decoding speed, "
              f"{ratio['whole_vs_faster_ctranslate2']:.2f}x its whole-process speed")  # fmt: skip
    report = {
        "benchmark": "real",
        "machine": machine(),
        "command": shlex.join(["python", *sys.argv]),
        "updates": UPDATES,
        "ctranslate2": importlib.metadata.version("ctranslate2"),
        "results": results,
        "ratios": ratios,
        **({"profiles": profiles} if profiles else {}),
    }
    print(json.dumps(report))
    save_results(args.results, report)


if __name__ == "__main__":
    main()
