"""Translation speed, side by side in one run: aiayn vs torch.nn.Transformer vs HF Marian vs CTranslate2.

The standard workload of the speed issue: `base` and `small` shapes with random weights, source
sentences with seed 4321 and lengths uniform{8..24}; exactly 24 new tokens each (EOS suppressed so
random weights cannot stop early); greedy and beam 4; batch 32 (throughput) and batch 1 (latency);
fp32, bf16 and int8 where a system has them. Reports sentences per second, median of alternating
rounds. CTranslate2 runs the aiayn model's own weights through `aiayn export` (same shape, same
numbers); Hugging Face Marian is built from an equivalent MarianConfig.

    python benchmarks/bench_translate.py [--configs small,base] [--sentences 256] [--reps 3]
The last line printed is JSON with every figure and ratio.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import aiayn_model  # noqa: E402
from common import (  # noqa: E402
    CONFIGS,
    PAD,
    NoEos,
    TorchTransformer,
    alternate,
    have,
    machine,
    marian_model,
    median,
    native_bf16,
    pad,
    random_sentences,
    set_threads,
    steal_ticks,
)

from aiayn.compiled import CompiledDecoder  # noqa: E402
from aiayn.config import SearchConfig  # noqa: E402
from aiayn.precision import autocast, for_inference  # noqa: E402
from aiayn.search import search  # noqa: E402

NEW_TOKENS = 24


def aiayn_translator(shape: dict, dtype: str, compile: bool = False, store: Path | None = None):
    model = for_inference(aiayn_model(shape), dtype)  # as Translator.load prepares it
    model = NoEos(CompiledDecoder(model, store=store) if compile else model)

    def run(batch: list[list[int]], beam: int) -> None:
        config = SearchConfig(beam_size=beam)
        with torch.inference_mode(), autocast(torch.device("cpu"), dtype):
            search(model, pad(batch), config, max_len=NEW_TOKENS)

    return run


def torch_translator(shape: dict, dtype: str):
    # nn.Transformer's inference fast path fails under CPU autocast and with dynamically quantised
    # layers; it is off for those cells (as in the peer figures of ../shared/benchmarks).
    torch.backends.mha.set_fastpath_enabled(dtype == "fp32")
    model = TorchTransformer(**shape).eval()
    if dtype == "int8":
        model = for_inference(model, "int8")  # the same int8 layers as aiayn's (precision.Int8Linear)
    enabled = dtype == "bf16"

    def run(batch: list[list[int]], beam: int) -> None:
        if beam != 1:
            raise NotImplementedError  # the tutorials have greedy decoding only
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            model.greedy_recompute(pad(batch), NEW_TOKENS)

    return run


def marian_translator(shape: dict, dtype: str):
    model = marian_model(shape, dropout=0.0).eval()
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    if dtype == "int8":
        model = for_inference(model, "int8")  # the same int8 layers as aiayn's (precision.Int8Linear)

    def run(batch: list[list[int]], beam: int) -> None:
        src = pad(batch)
        with torch.inference_mode():
            model.generate(
                input_ids=src,
                attention_mask=src != PAD,
                num_beams=beam,
                do_sample=False,
                min_new_tokens=NEW_TOKENS,
                max_new_tokens=NEW_TOKENS,
                early_stopping=False,
            )

    return run


class NumberedVocabulary:
    """Token strings for random-weight models: the specials, then "4", "5", ... (ids as text)."""

    def __init__(self, size: int):
        self.tokens = ["<pad>", "<s>", "</s>", "<unk>"] + [str(i) for i in range(4, size)]

    def src_tokens(self) -> list[str]:
        return self.tokens

    def tgt_tokens(self) -> list[str]:
        return self.tokens


def ctranslate2_translator(shape: dict, dtype: str, workdir: Path, threads: int):
    """The same random aiayn weights, exported through CTranslate2's own Transformer spec.

    Measured both with 1 and with 2 intra-op threads: on this 2-core VM CTranslate2 ran about 6x
    faster at batch 1 and 2x at batch 32 with one thread than with two, so each is its own row and
    the ratios take whichever was faster.
    """
    import ctranslate2

    from aiayn.export import SpecConverter, ctranslate2_spec

    out = workdir / f"ct2-{shape['d_model']}"
    vocabulary = NumberedVocabulary(shape["vocab"])
    if not out.exists():
        torch.manual_seed(0)
        SpecConverter(ctranslate2_spec(aiayn_model(shape).eval(), vocabulary)).convert(str(out))
    compute = {"fp32": "float32", "int8": "int8", "bf16": "bfloat16"}[dtype]
    translator = ctranslate2.Translator(
        str(out), device="cpu", compute_type=compute, intra_threads=threads, inter_threads=1
    )

    def run(batch: list[list[int]], beam: int) -> None:
        tokens = [[vocabulary.tokens[i] for i in sentence] for sentence in batch]  # EOS included, as aiayn's
        translator.translate_batch(
            tokens,
            beam_size=beam,
            max_batch_size=len(batch),
            min_decoding_length=NEW_TOKENS,
            max_decoding_length=NEW_TOKENS,
            return_scores=False,
        )

    return run


class InChildProcess:
    """A translator `run(batch, beam)` living in a child process of its own, called over a pipe.

    CTranslate2 bundles its own OpenMP runtime. Two OpenMP runtimes in one process, each with a
    thread per core, fight over the cores: measured here, batch-1 translation of aiayn and of
    CTranslate2 both ran about 3.5x slower than either alone. Alternating rounds stay as they were.
    """

    def __init__(self, make, *args):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, make, args), daemon=True)
        self.process.start()
        self.call(None)  # wait until the translator is built

    def call(self, request):
        self.conn.send(request)
        reply = self.conn.recv()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def __call__(self, batch: list[list[int]], beam: int) -> None:
        self.call((batch, beam))


def serve(conn, make, args) -> None:
    """The child's loop: build the translator, then run each (batch, beam) request."""
    set_threads()
    try:
        run = make(*args)
    except Exception as error:  # reported by the parent, which re-raises it
        conn.send(error)
        return
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the parent is done
            return
        try:
            conn.send(None if request is None else run(*request))
        except Exception as error:
            conn.send(error)


def rate(run, sentences: list[list[int]], batch_size: int, beam: int):
    def measure() -> float:
        start = time.perf_counter()
        for i in range(0, len(sentences), batch_size):
            run(sentences[i : i + batch_size], beam)
        return len(sentences) / (time.perf_counter() - start)

    return measure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="small,base")
    ap.add_argument("--dtypes", default="fp32,bf16,int8")
    ap.add_argument("--sentences", type=int, default=256, help="sentences for batch 32")
    ap.add_argument("--latency-sentences", type=int, default=32, help="sentences for batch 1")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--systems", help="comma-separated names to run (default: all there are)")
    args = ap.parse_args()
    set_threads()
    print(f"machine: {machine()}")
    notes = []
    makers = {
        "aiayn": aiayn_translator,
        "aiayn compiled": lambda shape, dtype: aiayn_translator(shape, dtype, compile=True),
        "torch.nn (recompute)": torch_translator,
    }
    if have("transformers"):
        makers["marian generate"] = marian_translator
    else:
        notes.append("transformers not installed: Hugging Face Marian skipped")
    workdir = Path(tempfile.mkdtemp(prefix="aiayn-bench-"))
    # AOTInductor packages, as `--compile` keeps them (compiled.default_store); here a fresh store
    makers["aiayn compiled (store)"] = lambda shape, dtype: aiayn_translator(
        shape, dtype, compile=True, store=workdir / "store"
    )
    if have("ctranslate2"):
        for threads in (1, 2):
            makers[f"ctranslate2 {threads}t"] = lambda shape, dtype, threads=threads: InChildProcess(
                ctranslate2_translator, shape, dtype, workdir, threads
            )
    else:
        notes.append("ctranslate2 not installed: skipped")
    if args.systems:
        wanted = args.systems.split(",")
        unknown = sorted(set(wanted) - set(makers))
        if unknown:
            ap.error(f"unknown systems {unknown}; there are {sorted(makers)}")
        makers = {name: make for name, make in makers.items() if name in wanted}
    dtypes = args.dtypes.split(",")
    if "bf16" in dtypes and not native_bf16():
        dtypes.remove("bf16")
        notes.append("bf16 skipped: this CPU has neither AVX512-BF16 nor AMX (no native bf16)")
    results, steal0 = [], steal_ticks()
    for config in args.configs.split(","):
        shape = CONFIGS[config]
        sentences = random_sentences(256, shape["vocab"], seed=4321)
        for dtype in dtypes:
            systems = {}
            for name, make in makers.items():
                if name.startswith("ctranslate2") and dtype == "bf16" and not torch._C._cpu._init_amx():
                    notes.append("ctranslate2 bf16 needs AMX on CPU: skipped")
                    continue
                torch.manual_seed(0)
                systems[name] = make(shape, dtype)
            for beam in (1, 4):
                for batch_size, n in ((32, args.sentences), (1, args.latency_sentences)):
                    timed = {
                        name: rate(run, sentences[:n], batch_size, beam)
                        for name, run in systems.items()
                        if not (beam > 1 and name.startswith("torch.nn"))
                    }
                    s0 = steal_ticks()
                    rates = alternate(timed, args.reps)
                    steal = (steal_ticks() - s0) / 100
                    for name, values in rates.items():
                        results.append(
                            {
                                "config": config,
                                "dtype": dtype,
                                "search": "greedy" if beam == 1 else f"beam{beam}",
                                "batch": batch_size,
                                "system": name,
                                "sentences_per_s": median(values),
                                "steal_s": steal,
                            }
                        )
                    print_rows(results[-len(rates) :])
    summary = ratios(results)
    for line in summary["lines"]:
        print(line)
    print(
        json.dumps(
            {
                "benchmark": "translate",
                "machine": machine(),
                "results": results,
                "ratios": summary["ratios"],
                "steal_s_total": (steal_ticks() - steal0) / 100,
                "notes": sorted(set(notes)),
            }
        )
    )
    shutil.rmtree(workdir, ignore_errors=True)  # the exported models and compiled packages


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        print(
            f"{r['config']:6} {r['dtype']:5} {r['search']:6} bs{r['batch']:<3} {r['system']:22} "
            f"{r['sentences_per_s']:8.1f} sent/s"
        )


def ratios(results: list[dict]) -> dict:
    """Each aiayn system / each peer at the same config, precision, search and batch size."""
    out, lines = {}, []
    cells = sorted({(r["config"], r["dtype"], r["search"], r["batch"]) for r in results})
    for cell in cells:
        rows = {
            r["system"]: r["sentences_per_s"]
            for r in results
            if (r["config"], r["dtype"], r["search"], r["batch"]) == cell
        }
        for ours in [name for name in rows if name.startswith("aiayn")]:
            key = "{}/{}/{}/bs{}".format(*cell) + ("" if ours == "aiayn" else f" ({ours})")
            out[key] = {f"vs {name}": rows[ours] / v for name, v in rows.items() if name != ours}
            ct2 = [v for name, v in rows.items() if name.startswith("ctranslate2")]
            if ct2:
                out[key]["vs ctranslate2 (faster setting)"] = rows[ours] / max(ct2)
            lines.append(key + ": " + ", ".join(f"{k} {v:.2f}x" for k, v in out[key].items()))
    return {"ratios": out, "lines": lines}


if __name__ == "__main__":
    main()
