"""Translation speed, side by side in one run: aiayn vs torch.nn.Transformer vs HF Marian vs CTranslate2.

The benchmarks' standard workload: `base` and `small` shapes with random weights, source
sentences with seed 4321 and lengths uniform{8..24}; exactly 24 new tokens each (EOS suppressed so
random weights cannot stop early); greedy and beam 4; batch 32 (throughput) and batch 1 (latency);
fp32, bf16 and int8 where a system has them (fp32 is the format `aiayn translate` takes by default on
every CPU class). Reports sentences per second, median of alternating rounds. CTranslate2 runs the aiayn model's own weights through `aiayn export` (same shape, same
numbers); Hugging Face Marian is built from an equivalent MarianConfig.

    python benchmarks/bench_translate.py [--configs small,base] [--sentences 256] [--reps 3]

On a GPU (`--device cuda`): the same workload at 1, 64 and 256 sentences a batch, `base` in bf16
(autocast, aiayn's default there) and fp32, for aiayn eager, aiayn compiled (bf16 and batches of up
to 32 sentences only: each of its graphs takes seconds to compile), Hugging Face Marian and
CTranslate2 (in its own process, as on the CPU), all on the GPU. Sized for about two minutes,
compiling included; cells not started within --time-limit (150 s) are named in the notes. fp32 means
TF32 matrix products for aiayn and Marian, as aiayn's translation sets them on CUDA
(precision.configure); CTranslate2 4.8.5 has no such switch. A system that cannot run there
(CTranslate2's wheel is built for CUDA 12) is left out with its error in the notes. Also reported:
the GPU memory each system allocates on top of what the process held before it started (PyTorch's
allocator, so not CTranslate2's), and each system's first batch of a cell, which includes compiling.

    python benchmarks/bench_translate.py --device cuda [--batches 1:4,64:128,256:512] [--time-limit 150]
The last line printed is JSON with every figure and ratio.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import multiprocessing
import shlex
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import aiayn_model  # noqa: E402
from common import (  # noqa: E402
    CONFIGS,
    ISA_CAPS,
    PAD,
    NoEos,
    TorchTransformer,
    alternate,
    cap_isa,
    have,
    machine,
    marian_model,
    median,
    native_bf16,
    pad,
    random_sentences,
    save_results,
    set_threads,
    steal_ticks,
)

from aiayn.config import SearchConfig  # noqa: E402
from aiayn.inference.compiled import CompiledDecoder  # noqa: E402
from aiayn.inference.search import search  # noqa: E402
from aiayn.precision import autocast, configure, for_inference, resolve_device, translation_dtype  # noqa: E402

NEW_TOKENS = 24

# What each device measures unless told otherwise. On a GPU the throughput batch is larger (64 and 256
# sentences: a batch of 32 leaves most of it idle), each cell translates about as many batches as
# take a second or less, and the run must fit in a few minutes: `base` only, compiled graphs for the
# default precision only, and no cell started after 150 s.
DEFAULTS = {
    "cpu": dict(configs="small,base", dtypes="fp32,bf16,int8", batches=None, time_limit=None),
    "cuda": dict(configs="base", dtypes="bf16,fp32", batches="1:4,64:128,256:512", time_limit=150.0),
}
DTYPES = {"cpu": ("fp32", "bf16", "int8"), "cuda": ("fp32", "bf16", "fp16")}
COMPILED_DTYPES = {"cpu": None, "cuda": "bf16"}  # None: every dtype measured
COMPILED_MAX_SENTENCES = inspect.signature(CompiledDecoder).parameters["max_sentences"].default

# The errors that leave a system out of a cell instead of ending the run, for the systems that may
# fail where the others run (`may_fail`): aiayn compiled (torch.compile for a device it was not
# measured on) and CTranslate2 (its PyPI wheel loads CUDA 12's cuBLAS, libcublas.so.12, which a
# CUDA 13 machine may not have). torch.compile's and CTranslate2's errors are RuntimeErrors,
# CTranslate2 refuses a compute type with a ValueError, a library that does not load is an ImportError.
FAILURES = (RuntimeError, ValueError, ImportError)


def may_fail(name: str) -> bool:
    return name.startswith(("aiayn compiled", "ctranslate2", "onnxruntime"))


def aiayn_translator(
    shape: dict,
    dtype: str,
    device: torch.device,
    compile: bool = False,
    store: Path | None = None,
    max_sentences: int = COMPILED_MAX_SENTENCES,
):
    model = for_inference(aiayn_model(shape).to(device), dtype)  # as Translator.load prepares it
    if compile:
        model = CompiledDecoder(model, max_sentences=max_sentences, store=store)
    model = NoEos(model)

    def run(batch: list[list[int]], beam: int) -> None:
        config = SearchConfig(beam_size=beam)
        with torch.inference_mode(), autocast(device, dtype):
            search(model, pad(batch).to(device), config, max_len=NEW_TOKENS)

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


def marian_translator(shape: dict, dtype: str, device: torch.device):
    model = marian_model(shape, dropout=0.0).eval().to(device)
    if dtype in ("bf16", "fp16"):  # the whole model in that type, as transformers loads one with dtype=
        model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float16)
    if dtype == "int8":
        model = for_inference(model, "int8")  # the same int8 layers as aiayn's (precision.Int8Linear)

    def run(batch: list[list[int]], beam: int) -> None:
        src = pad(batch).to(device)
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


def ctranslate2_translator(shape: dict, dtype: str, workdir: Path, threads: int, device: str = "cpu"):
    """The same random aiayn weights, exported through CTranslate2's own Transformer spec.

    Measured both with 1 and with 2 intra-op threads on the CPU: on this 2-core VM CTranslate2 ran
    about 6x faster at batch 1 and 2x at batch 32 with one thread than with two, so each is its own
    row and the ratios take whichever was faster. On a GPU, one thread (it only feeds the GPU).
    """
    import ctranslate2

    from aiayn.interop.ctranslate2 import SpecConverter, ctranslate2_spec

    if device == "cuda" and ctranslate2.get_cuda_device_count() == 0:
        raise RuntimeError(
            f"ctranslate2 {ctranslate2.__version__}: get_cuda_device_count() is 0 (no GPU it can use)"
        )
    out = workdir / f"ct2-{shape['d_model']}"
    vocabulary = NumberedVocabulary(shape["vocab"])
    if not out.exists():
        torch.manual_seed(0)
        SpecConverter(ctranslate2_spec(aiayn_model(shape).eval(), vocabulary)).convert(str(out))
    compute = {"fp32": "float32", "int8": "int8", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    translator = ctranslate2.Translator(
        str(out), device=device, compute_type=compute, intra_threads=threads, inter_threads=1
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


def onnxruntime_translator(shape: dict, dtype: str, workdir: Path):
    """The same random aiayn weights through `aiayn export --format onnx`'s route (the transformers
    export, then Optimum's ONNX exporter), run by ONNX Runtime with Optimum's generate; fp32 only (ONNX
    Runtime's int8 is a separate quantisation step that aiayn does not export). In a child process:
    ONNX Runtime's thread pool beside PyTorch's OpenMP would share the 2 cores as CTranslate2's did."""
    if dtype != "fp32":
        raise ValueError(f"onnxruntime: the export is fp32, not {dtype}")
    from optimum.exporters.onnx import main_export
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    from aiayn.interop.huggingface import to_transformers

    out = workdir / f"onnx-{shape['d_model']}"
    if not out.exists():
        torch.manual_seed(0)
        hf_dir = workdir / f"hf-{shape['d_model']}"
        to_transformers(aiayn_model(shape).eval()).save_pretrained(hf_dir)
        main_export(model_name_or_path=str(hf_dir), output=str(out), task="text2text-generation-with-past",
                    do_validation=False, library_name="transformers")  # fmt: skip
    model = ORTModelForSeq2SeqLM.from_pretrained(out)

    def run(batch: list[list[int]], beam: int) -> None:
        src = pad(batch)
        with torch.inference_mode():
            model.generate(input_ids=src, attention_mask=src != PAD, num_beams=beam, do_sample=False,
                           min_new_tokens=NEW_TOKENS, max_new_tokens=NEW_TOKENS, early_stopping=False)  # fmt: skip

    return run


class InChildProcess:
    """A translator `run(batch, beam)` living in a child process of its own, called over a pipe.

    CTranslate2 bundles its own OpenMP runtime. Two OpenMP runtimes in one process, each with a
    thread per core, fight over the cores: measured here, batch-1 translation of aiayn and of
    CTranslate2 both ran about 3.5x slower than either alone. Alternating rounds stay as they were.
    On a GPU it also keeps a CTranslate2 that aborts while loading its CUDA libraries from ending
    the whole run: the child's death is an error here (RuntimeError), which the run records.
    """

    def __init__(self, make, *args):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=serve, args=(child, make, args), daemon=True)
        self.process.start()
        child.close()  # the child holds its end: when the child dies, recv() here ends (EOFError)
        self.call(None)  # wait until the translator is built

    def call(self, request):
        try:
            self.conn.send(request)
            reply = self.conn.recv()
        except (EOFError, BrokenPipeError):
            self.process.join()
            raise RuntimeError(
                f"the child process ended with exit code {self.process.exitcode} (its output is above)"
            ) from None
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def __call__(self, batch: list[list[int]], beam: int) -> None:
        self.call((batch, beam))


def serve(conn, make, args) -> None:
    """The child's loop: build the translator, then run each (batch, beam) request."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop (it outlives an interrupt)
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


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work: a clock read before it would time the launches only."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate(
    run,
    sentences: list[list[int]],
    batch_size: int,
    beam: int,
    device: torch.device,
    memory: list[float] | None = None,
):
    """A measurement of sentences/s; with `memory` (a list, on a GPU), each call appends the MB that
    PyTorch allocated on top of what it held when the call started (caches, activations)."""

    def measure() -> float:
        synchronize(device)
        if memory is not None:
            held = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for i in range(0, len(sentences), batch_size):
            run(sentences[i : i + batch_size], beam)
        synchronize(device)
        seconds = time.perf_counter() - start
        if memory is not None:
            memory.append((torch.cuda.max_memory_allocated(device) - held) / 2**20)
        return len(sentences) / seconds

    return measure


def skipped(notes: list[str], name: str, where: str, error: Exception) -> None:
    """Record why a system that may fail (FAILURES) is left out; the traceback goes to stderr."""
    traceback.print_exc()
    message = f"{name} left out of {where}: {type(error).__name__}: {error}"
    notes.append(message if len(message) <= 2000 else message[:2000] + " ...")
    print(notes[-1].splitlines()[0])


def gpu(device: torch.device) -> str | None:
    """The GPU as a figure must name it, with the PyTorch and CUDA it ran on."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return (
        f"{torch.cuda.get_device_name(device)} (compute capability {props.major}.{props.minor}, "
        f"{props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, CUDA {torch.version.cuda}"
    )


def versions() -> dict[str, str | None]:
    return {
        name: importlib.metadata.version(name) if have(name) else None
        for name in ("torch", "transformers", "ctranslate2")
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=sorted(DEFAULTS), default="cpu")
    ap.add_argument("--configs", help="default: small,base on the CPU, base on CUDA")
    ap.add_argument("--dtypes", help="default: fp32,bf16,int8 on the CPU, bf16,fp32 on CUDA (fp16 there too)")
    ap.add_argument("--sentences", type=int, default=256, help="sentences for batch 32 (CPU)")
    ap.add_argument("--latency-sentences", type=int, default=32, help="sentences for batch 1 (CPU)")
    ap.add_argument(
        "--batches",
        help="BATCH:SENTENCES,...: each batch size and how many sentences a measurement translates "
        "(default: 32:SENTENCES,1:LATENCY_SENTENCES on the CPU, 1:4,64:128,256:512 on CUDA)",
    )
    ap.add_argument(
        "--isa",
        choices=sorted(ISA_CAPS),
        default="native",
        help="cap every system at this instruction set (avx2: what an AVX2 laptop runs; common.ISA_CAPS)",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--results",
        help="also write the summary to this JSON file (docs/bench_*_cpu.json: the README's speed table)",
    )
    ap.add_argument("--systems", help="comma-separated names to run (default: all there are)")
    ap.add_argument(
        "--compiled-dtypes",
        help="the dtypes aiayn compiled is measured in (default: all on the CPU, bf16 on CUDA)",
    )
    ap.add_argument(
        "--compiled-max-sentences",
        type=int,
        default=COMPILED_MAX_SENTENCES,
        help="CompiledDecoder's max_sentences: it decodes larger batches eagerly, so is not measured "
        "at them (default: %(default)s, its own)",
    )
    ap.add_argument(
        "--time-limit",
        type=float,
        help="start no cell after this many seconds; those left are named in the notes "
        "(default: none on the CPU, 150 on CUDA)",
    )
    return ap


def options(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The options, with the device's defaults filled in, checked."""
    args = ap.parse_args()
    cap_isa(args.isa)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.batches = [
        tuple(int(n) for n in pair.split(":"))
        for pair in (args.batches or f"32:{args.sentences},1:{args.latency_sentences}").split(",")
    ]
    args.dtypes = args.dtypes.split(",")
    unknown = sorted(set(args.dtypes) - set(DTYPES[args.device]))
    if unknown:
        ap.error(
            f"dtypes {unknown} are not for --device {args.device}; there are {list(DTYPES[args.device])}"
        )
    args.compiled_dtypes = (
        args.compiled_dtypes or COMPILED_DTYPES[args.device] or ",".join(args.dtypes)
    ).split(",")
    try:
        args.device = resolve_device(args.device)
    except ValueError as error:
        ap.error(str(error))
    return args


def translators(args: argparse.Namespace, workdir: Path, notes: list[str]) -> dict:
    """name -> make(shape, dtype) -> run(batch, beam): the systems there are on this device."""
    device = args.device
    makers = {
        "aiayn": lambda shape, dtype: aiayn_translator(shape, dtype, device),
        "aiayn compiled": lambda shape, dtype: aiayn_translator(
            shape, dtype, device, compile=True, max_sentences=args.compiled_max_sentences
        ),
    }
    if device.type == "cpu":
        makers["torch.nn (recompute)"] = torch_translator
    else:
        notes.append(
            "torch.nn (recompute) and aiayn compiled (store) are measured on the CPU only, to keep the GPU "
            "run within a few minutes (the tutorials' decoding; AOTInductor packages compile a C++ wrapper "
            "per graph on top of the kernels)"
        )
        notes.append(
            "aiayn compiled on CUDA: graphs compiled in memory, without max_autotune (CompiledDecoder asks "
            "for it on the CPU only) and without CUDA graphs (compiled.py does not ask for them)"
        )
        notes.append("fp32 on CUDA: TF32 matmuls for aiayn and Marian; CTranslate2's float32 is full fp32")
    if have("transformers"):
        makers["marian generate"] = lambda shape, dtype: marian_translator(shape, dtype, device)
    else:
        notes.append("transformers not installed: Hugging Face Marian skipped")
    if device.type == "cpu":
        # AOTInductor packages, as `--compile` keeps them (graph_store.default_store); here a fresh store
        makers["aiayn compiled (store)"] = lambda shape, dtype: aiayn_translator(
            shape,
            dtype,
            device,
            compile=True,
            store=workdir / "store",
            max_sentences=args.compiled_max_sentences,
        )
    if not have("optimum.onnxruntime"):
        notes.append("optimum-onnx not installed: ONNX Runtime skipped")
    elif device.type == "cpu":
        makers["onnxruntime"] = lambda shape, dtype: InChildProcess(
            onnxruntime_translator, shape, dtype, workdir
        )
    if not have("ctranslate2"):
        notes.append("ctranslate2 not installed: skipped")
    elif device.type == "cpu":
        for threads in (1, 2):
            makers[f"ctranslate2 {threads}t"] = lambda shape, dtype, threads=threads: InChildProcess(
                ctranslate2_translator, shape, dtype, workdir, threads
            )
    else:
        makers["ctranslate2"] = lambda shape, dtype: InChildProcess(
            ctranslate2_translator, shape, dtype, workdir, 1, device.type
        )
    return makers


def build(
    makers: dict, shape: dict, config: str, dtype: str, args: argparse.Namespace, notes: list[str]
) -> dict:
    """name -> run(batch, beam) of the systems that have this dtype here (and, for those that may fail, that
    could be built)."""
    systems = {}
    for name, make in makers.items():
        if name.startswith("ctranslate2") and dtype == "bf16" and args.device.type == "cpu":
            if not torch._C._cpu._init_amx():
                notes.append("ctranslate2 bf16 needs AMX on CPU: skipped")
                continue
        if name.startswith("aiayn compiled") and dtype not in args.compiled_dtypes:
            notes.append(
                f"aiayn compiled: measured in {','.join(args.compiled_dtypes)} only (--compiled-dtypes)"
            )
            continue
        torch.manual_seed(0)
        if not may_fail(name):
            systems[name] = make(shape, dtype)
            continue
        try:
            systems[name] = make(shape, dtype)
        except FAILURES as error:  # see FAILURES
            skipped(notes, name, f"{config} {dtype}", error)
    return systems


def cell_systems(
    systems: dict, beam: int, batch_size: int, args: argparse.Namespace, notes: list[str]
) -> dict:
    """The systems of a cell: those that have its search and decode its batch size their own way."""
    runs = {}
    for name, run in systems.items():
        if beam > 1 and name.startswith("torch.nn"):
            continue  # the tutorials have greedy decoding only
        if name.startswith("aiayn compiled") and batch_size > args.compiled_max_sentences:
            notes.append(
                f"aiayn compiled decodes batches of more than {args.compiled_max_sentences} sentences "
                "eagerly (CompiledDecoder.max_sentences): not measured at them"
            )
            continue
        runs[name] = run
    return runs


def main() -> None:
    ap = parser()
    args = options(ap)
    device = args.device
    configure(device)  # TF32 matmuls on CUDA, as aiayn's translation sets them (Translator.load)
    set_threads()
    started = time.perf_counter()
    print(f"machine: {machine()}")
    if device.type == "cuda":
        print(f"gpu: {gpu(device)}")
    notes = []
    workdir = Path(tempfile.mkdtemp(prefix="aiayn-bench-"))
    makers = translators(args, workdir, notes)
    if args.systems:
        wanted = args.systems.split(",")
        unknown = sorted(set(wanted) - set(makers))
        if unknown:
            ap.error(f"unknown systems {unknown}; there are {sorted(makers)}")
        makers = {name: make for name, make in makers.items() if name in wanted}
    dtypes = args.dtypes
    if "bf16" in dtypes and device.type == "cpu" and not native_bf16():
        dtypes.remove("bf16")
        notes.append("bf16 skipped: this CPU has neither AVX512-BF16 nor AMX (no native bf16)")
    results, steal0, left_out = [], steal_ticks(), []
    try:
        for config in args.configs.split(","):
            shape = CONFIGS[config]
            # as many as the largest measurement takes; the first 256 are the same whatever the number
            sentences = random_sentences(max(256, *(n for _, n in args.batches)), shape["vocab"], seed=4321)
            for dtype in dtypes:
                systems = build(makers, shape, config, dtype, args, notes)
                for beam in (1, 4):
                    search_name = "greedy" if beam == 1 else f"beam{beam}"
                    for batch_size, n in args.batches:
                        where = f"{config} {dtype} {search_name} bs{batch_size}"
                        elapsed = time.perf_counter() - started
                        if args.time_limit is not None and elapsed > args.time_limit:
                            left_out.append(where)
                            continue
                        print(f"[{elapsed:4.0f} s] {where}", flush=True)
                        runs = cell_systems(systems, beam, batch_size, args, notes)
                        rows = measure_cell(
                            runs, sentences[:n], batch_size, beam, device, args.reps, notes, where
                        )
                        cell = {"config": config, "dtype": dtype, "search": search_name}
                        results += [{**cell, **row} for row in rows]
                        print_rows(results[len(results) - len(rows) :])
    except KeyboardInterrupt:  # a run stopped by hand or by a time limit still reports what it measured
        notes.append(f"interrupted after {time.perf_counter() - started:.0f} s")
    if left_out:
        notes.append(f"--time-limit {args.time_limit:g} s reached: not measured: {'; '.join(left_out)}")
    summary = ratios(results)
    for line in summary["lines"]:
        print(line)
    report = {
        "benchmark": "translate",
        "device": device.type,
        "machine": machine(),
        "gpu": gpu(device),
        "command": shlex.join(["python", *sys.argv]),
        "versions": versions(),
        "default_dtype": translation_dtype("auto", device),  # what `aiayn translate` takes here
        "results": results,
        "ratios": summary["ratios"],
        "best_of_aiayn": summary["best"],
        "steal_s_total": (steal_ticks() - steal0) / 100,
        "wall_s": time.perf_counter() - started,
        "notes": sorted(set(notes)),
    }
    print(json.dumps(report))
    save_results(args.results, report)
    shutil.rmtree(workdir, ignore_errors=True)  # the exported models and compiled packages


def measure_cell(
    runs: dict,
    sentences: list[list[int]],
    batch_size: int,
    beam: int,
    device: torch.device,
    reps: int,
    notes: list[str],
    where: str,
) -> list[dict]:
    """One cell: each system's first batch, timed on its own (it includes compiling, for a system that
    compiles; a system that may fail and does is left out there), then alternating rounds."""
    first = {}
    for name, run in list(runs.items()):
        synchronize(device)
        start = time.perf_counter()
        if not may_fail(name):
            run(sentences[:batch_size], beam)
        else:
            try:
                run(sentences[:batch_size], beam)
            except FAILURES as error:  # see FAILURES
                skipped(notes, name, where, error)
                del runs[name]
                continue
        synchronize(device)
        first[name] = time.perf_counter() - start
    # GPU memory of the systems in this process (PyTorch's allocator does not see CTranslate2's child)
    memory = {
        name: [] if device.type == "cuda" and not isinstance(run, InChildProcess) else None
        for name, run in runs.items()
    }
    timed = {name: rate(run, sentences, batch_size, beam, device, memory[name]) for name, run in runs.items()}
    s0 = steal_ticks()
    rates = alternate(timed, reps)
    steal = (steal_ticks() - s0) / 100
    return [
        {
            "batch": batch_size,
            "system": name,
            "sentences_per_s": median(values),
            "steal_s": steal,
            "first_batch_s": first[name],
            "gpu_extra_mb": max(memory[name]) if memory[name] else None,
        }
        for name, values in rates.items()
    ]


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        memory = "" if r["gpu_extra_mb"] is None else f", {r['gpu_extra_mb']:.0f} MB on the GPU"
        print(
            f"{r['config']:6} {r['dtype']:5} {r['search']:6} bs{r['batch']:<3} {r['system']:22} "
            f"{r['sentences_per_s']:8.1f} sent/s  (first batch {r['first_batch_s']:.2f} s{memory})"
        )


def ratios(results: list[dict]) -> dict:
    """Each aiayn system / each peer at the same config, precision, search and batch size; and the
    fastest of aiayn's systems in each cell / each peer."""
    out, best, lines = {}, {}, []
    cells = sorted({(r["config"], r["dtype"], r["search"], r["batch"]) for r in results})
    for cell in cells:
        rows = {
            r["system"]: r["sentences_per_s"]
            for r in results
            if (r["config"], r["dtype"], r["search"], r["batch"]) == cell
        }
        name = "{}/{}/{}/bs{}".format(*cell)
        ct2 = [v for system, v in rows.items() if system.startswith("ctranslate2")]
        for ours in [system for system in rows if system.startswith("aiayn")]:
            key = name + ("" if ours == "aiayn" else f" ({ours})")
            out[key] = {f"vs {system}": rows[ours] / v for system, v in rows.items() if system != ours}
            if ct2:
                out[key]["vs ctranslate2 (faster setting)"] = rows[ours] / max(ct2)
            lines.append(key + ": " + ", ".join(f"{k} {v:.2f}x" for k, v in out[key].items()))
        ours = [system for system in rows if system.startswith("aiayn")]
        peers = {system: v for system, v in rows.items() if not system.startswith("aiayn")}
        if ours and peers:
            best[name] = max(ours, key=rows.get)
            key = name + " (best of aiayn)"
            out[key] = {f"vs {system}": rows[best[name]] / v for system, v in peers.items()}
            if ct2:
                out[key]["vs ctranslate2 (faster setting)"] = rows[best[name]] / max(ct2)
            lines.append(f"{key}, {best[name]}: " + ", ".join(f"{k} {v:.2f}x" for k, v in out[key].items()))
    return {"ratios": out, "best": best, "lines": lines}


if __name__ == "__main__":
    main()
