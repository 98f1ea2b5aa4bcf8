"""Training speed, side by side in one run: aiayn vs torch.nn.Transformer vs Hugging Face Marian.

The benchmarks' standard workload: `base` and `small` shapes, synthetic pairs (seed 1234,
source and target lengths uniform{8..24} with EOS), batches of at most 4,096 padded target tokens
filled in order (identical for every system), label smoothing 0.1, Adam. Reports non-padding
target tokens per second for forward + backward + optimizer step (median of alternating rounds),
peak RSS (one child process per cell), and model FLOPs utilisation against the measured GEMM peak.
aiayn with its own length bucketing is reported on its own line, labelled as such.

Each config in fp32 and in bf16 autocast where the CPU multiplies bf16 natively, the format that dtype
auto takes on this CPU's class marked as its default (precision.training_dtype; tests/test_cpu_classes.py
holds the AMX class's choice to these figures). `low-resource` is the recipe's shape for small corpora
(d_model 128, 4 layers a side, a 6,000-token vocabulary), on the same batches; `--profile` adds what aiayn's update is made of (the
output layer's, the dropout masks' and Adam's shares of its operators' time, and the top operators).

    python benchmarks/bench_train.py [--configs low-resource,small,base] [--dtypes fp32,bf16] [--reps 5] [--profile]
The last line printed is JSON with every figure and ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    CONFIGS,
    ISA_CAPS,
    PAD,
    TorchTransformer,
    alternate,
    cap_isa,
    gemm_peak,
    have,
    machine,
    marian_model,
    median,
    native_bf16,
    peak_rss_mb,
    random_sentences,
    save_results,
    set_threads,
    steal_ticks,
)

from aiayn.config import ModelConfig, TrainConfig  # noqa: E402
from aiayn.data.corpus import collate, make_batches  # noqa: E402
from aiayn.model import Transformer  # noqa: E402
from aiayn.precision import training_dtype  # noqa: E402
from aiayn.training.train import make_optimizer, train_step  # noqa: E402

MAX_TOKENS = 4096
CPU = torch.device("cpu")


def workload(vocab: int, n_pairs: int) -> tuple[list[list[int]], list[list[int]]]:
    src = random_sentences(n_pairs, vocab, seed=1234)
    tgt = random_sentences(n_pairs, vocab, seed=1235)
    return src, tgt


def fixed_batches(
    src: list[list[int]], tgt: list[list[int]], max_tokens: int = MAX_TOKENS
) -> list[list[int]]:
    """Pairs in order, each batch as full as `max_tokens` padded target tokens allow (no bucketing)."""
    batches, batch, width = [], [], 0
    for i in range(len(src)):
        w = max(width, len(tgt[i]))
        if batch and (len(batch) + 1) * w > max_tokens:
            batches.append(batch)
            batch, w = [], len(tgt[i])
        batch.append(i)
        width = w
    return batches + [batch] if batch else batches


def tensors(src, tgt, batches, device: torch.device = CPU):
    return [tuple(t.to(device) for t in collate(src, tgt, b)) for b in batches]


def aiayn_model(shape: dict) -> Transformer:
    return Transformer(
        ModelConfig(
            src_vocab_size=shape["vocab"],
            tgt_vocab_size=shape["vocab"],
            d_model=shape["d_model"],
            d_ff=shape["d_ff"],
            n_heads=shape["n_heads"],
            n_encoder_layers=shape["n_layers"],
            n_decoder_layers=shape["n_layers"],
            dropout=0.1,
        )
    )


def stepper(system: str, shape: dict, dtype: str, device: torch.device = CPU):
    """A function doing one training update on (src, tgt_in, tgt_out) for `system`, on `device`."""
    torch.manual_seed(0)
    if system == "aiayn":
        model = aiayn_model(shape).to(device).train()
        cfg = TrainConfig(dtype=dtype)
        opt = make_optimizer(model, cfg)  # on CUDA: the fused Adam
        return lambda batch: train_step(model, opt, [list(batch)], 1e-4, cfg)
    model = TorchTransformer(**shape) if system == "torch.nn" else marian_model(shape)
    model.to(device).train()
    fused = device.type == "cuda"  # the peers get the fused Adam too: the same optimizer work
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=fused)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")

    def step(batch):
        src, tgt_in, tgt_out = batch
        with autocast:
            if system == "torch.nn":
                logits = model(src, tgt_in)
            else:
                logits = model(
                    input_ids=src,
                    attention_mask=src != PAD,
                    decoder_input_ids=tgt_in,
                    decoder_attention_mask=tgt_in != PAD,
                ).logits
        n = int((tgt_out != PAD).sum())
        loss = F.cross_entropy(
            logits.float().flatten(0, 1),
            tgt_out.flatten(),
            ignore_index=PAD,
            label_smoothing=0.1,
            reduction="sum",
        )
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item(), n

    return step


def train_flops(shape: dict, src: torch.Tensor, tgt: torch.Tensor) -> float:
    """Model FLOPs of forward + backward (3x forward) on the padded batch: matmuls and attention."""
    B, S = src.shape
    T = tgt.size(1)
    D, Fd, L, V = shape["d_model"], shape["d_ff"], shape["n_layers"], shape["vocab"]
    enc = 2 * B * S * (4 * D * D + 2 * D * Fd) + 4 * B * S * S * D
    dec = 2 * B * T * (4 * D * D + 2 * D * Fd) + 4 * B * T * T * D  # self-attention + feed-forward
    dec += 2 * B * T * 2 * D * D + 2 * B * S * 2 * D * D + 4 * B * T * S * D  # encoder-decoder attention
    return 3 * (L * (enc + dec) + 2 * B * T * D * V)


def measure(step, batches) -> float:
    """Non-padding target tokens per second over the given batches."""
    start, tokens = time.perf_counter(), 0
    for batch in batches:
        tokens += step(batch)[1]
    return tokens / (time.perf_counter() - start)


def child_rss(system: str, config: str, dtype: str, bucket: bool) -> float:
    """Peak RSS (MB) of a fresh process doing 3 updates: memory is measured one system at a time."""
    cmd = [sys.executable, __file__, "--child", system, config, dtype] + (["--bucket"] if bucket else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def run_child(system: str, config: str, dtype: str, bucket: bool) -> None:
    set_threads()
    shape = CONFIGS[config]
    src, tgt = workload(shape["vocab"], 2000)
    batches = (
        make_batches([len(s) for s in src], [len(t) + 1 for t in tgt], MAX_TOKENS, seed=0, epoch=0)
        if bucket
        else fixed_batches(src, tgt)
    )
    step = stepper(system, shape, dtype)
    for batch in tensors(src, tgt, batches[:3]):
        step(batch)
    print(peak_rss_mb())


MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"}


def cpu_profile(step, batches, vocab: int, rows: int = 15) -> tuple[dict, str]:
    """What aiayn's update is made of on the CPU: the shares of its operators' own time spent on the output
    layer (the products with a side as long as the vocabulary, and the softmax and loss over it), on the
    dropout masks (model.Dropout's random bits) and in Adam's step (all of it), and torch.profiler's
    operators by their own CPU time."""
    from torch.profiler import ProfilerActivity, profile

    for batch in batches:
        step(batch)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for batch in batches:
            step(batch)
    by_shape = prof.key_averages(group_by_input_shape=True)
    total = sum(e.self_cpu_time_total for e in by_shape)

    def share(keep) -> float:
        return sum(e.self_cpu_time_total for e in by_shape if keep(e)) / total

    def output_layer(e) -> bool:
        vocabulary = e.key in MATMULS and any(vocab in shape for shape in e.input_shapes if shape)
        return vocabulary or "log_softmax" in e.key or "nll_loss" in e.key

    adam = sum(e.cpu_time_total for e in prof.key_averages() if e.key.startswith("Optimizer.step#"))
    shares = {
        "output_layer": share(output_layer),
        "dropout_masks": share(lambda e: e.key == "aten::random_"),
        "adam": adam / total,
    }
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return shares, table


# --- On CUDA -------------------------------------------------------------------------------------------

# Dense bf16 matrix peak by the datasheet (SXM parts, without sparsity), what MFU is quoted against in the
# field; the H200 is the H100's chip with more memory. The GEMM peak measured in the same run is reported
# beside it.
DATASHEET_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}
CUDA_BUDGETS = "4096,8192,16384,25000"


def datasheet_peak(gpu: str) -> float | None:
    return next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in gpu), None)


def cuda_gemm_peak(dtype: torch.dtype, n: int = 8192, reps: int = 10, device: str = "cuda") -> float:
    """Measured torch.matmul throughput (TFLOP/s) of an n x n x n product on the GPU, mean of `reps`."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


def cuda_measure(step, batches) -> float:
    """Non-padding target tokens per second over the batches, the GPU's queue drained at both ends."""
    torch.cuda.synchronize()
    start, tokens = time.perf_counter(), 0
    for batch in batches:
        tokens += step(batch)[1]
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start)


def cuda_systems(systems: list[str], shape: dict, dtype: str, device: torch.device, batch) -> dict:
    """Each system's update function, its model built once on the GPU (initialised there: seconds less a
    model than on the CPU), and the memory it holds between updates (weights and Adam's two moments,
    made by one update): {name: (step, persistent bytes)}."""
    out = {}
    for name in systems:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with device:
            step = stepper(name, shape, dtype, device)
        step(batch)  # Adam's state exists from the first update on; gradients are freed after each
        torch.cuda.synchronize()
        out[name] = (step, torch.cuda.memory_allocated() - before)
    return out


def cuda_peak_memory(step, persistent: int, batches) -> float:
    """Peak GPU memory (MB, torch's allocator) of one system doing the updates as if it were alone: what it
    holds between updates plus the most its updates allocated on top (activations, gradients). The other
    systems' models stay on the GPU meanwhile, unchanged, so they cancel out."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    for batch in batches:
        step(batch)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before + persistent) / 2**20


def cuda_profile(step, batches, rows: int = 25) -> str:
    """What aiayn's update is made of on the GPU: torch.profiler's kernels by GPU time, and the share of
    the wall time the GPU was busy (a launch-bound loop leaves it idle between kernels)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for batch in batches:
        step(batch)
    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for batch in batches:
            step(batch)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    events = prof.key_averages()
    # the kernels' own entries (an operator's row repeats its kernels' time): microseconds -> s
    busy = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e6
    table = events.table(sort_by="self_device_time_total", row_limit=rows)
    head = f"wall {1e3 * wall:.1f} ms under the profiler, kernels {1e3 * busy:.1f} ms ({100 * busy / wall:.0f}% busy)"
    return head + "\n" + table


def cuda_main(args) -> None:
    """Training on the GPU: the same systems and batches as on the CPU, at several batch sizes (padded
    target tokens per batch), peak memory from torch's allocator, MFU against the dense bf16 peak."""
    from aiayn.precision import configure

    device = torch.device(args.device)
    configure(device)  # TF32 for fp32 matmuls, as aiayn's training sets it; the peers run in this process too
    gpu = torch.cuda.get_device_name(device)
    dtypes = args.dtypes.split(",") if args.dtypes else ["bf16"]
    budgets = [int(b) for b in (args.max_tokens or CUDA_BUDGETS).split(",")]
    systems = ["aiayn", "torch.nn"] + (["marian"] if have("transformers") else [])
    notes = [] if have("transformers") else ["transformers not installed: Hugging Face Marian skipped"]
    measured = {
        d: cuda_gemm_peak({"fp32": torch.float32, "bf16": torch.bfloat16}[d], device=args.device)
        for d in dtypes
    }
    sheet = datasheet_peak(gpu)
    where = f"{gpu}, CUDA {torch.version.cuda}, torch {torch.__version__}"
    print(f"device: {where}")
    print(
        "GEMM peak (8192^3 torch.matmul): " + ", ".join(f"{d} {v:.0f} TFLOP/s" for d, v in measured.items())
    )
    if sheet:
        print(f"datasheet dense bf16 peak: {sheet:.0f} TFLOP/s")
    results, profiles = [], {}
    n = args.batches
    for config in args.configs.split(","):
        shape = CONFIGS[config]
        # enough pairs for n + 1 full batches at the largest budget (about 16 tokens a pair)
        src, tgt = workload(shape["vocab"], max(4000, (n + 2) * max(budgets) // 12))
        data = {}
        for budget in budgets:
            fixed = tensors(src, tgt, fixed_batches(src, tgt, budget)[: n + 1], device)
            order = make_batches([len(s) for s in src], [len(t) + 1 for t in tgt], budget, seed=0, epoch=0)
            data[budget] = fixed, tensors(src, tgt, order[: n + 1], device)
        for dtype in dtypes:
            built = cuda_systems(systems, shape, dtype, device, data[min(budgets)][0][0])
            steps = {name: step for name, (step, _) in built.items()}
            for budget in budgets:
                fixed, bucketed = data[budget]
                flops = sum(train_flops(shape, s, t) for s, t, _ in fixed[:n])
                tokens = sum(int((t != PAD).sum()) for _, _, t in fixed[:n])
                memory = {
                    name: cuda_peak_memory(step, held, fixed[:3]) for name, (step, held) in built.items()
                }
                memory["aiayn (bucketing)"] = cuda_peak_memory(
                    steps["aiayn"], built["aiayn"][1], bucketed[:3]
                )
                timed = {name: (lambda s=steps[name], b=fixed[:n]: cuda_measure(s, b)) for name in systems}
                timed["aiayn (bucketing)"] = lambda s=steps["aiayn"], b=bucketed[:n]: cuda_measure(s, b)
                rates = alternate(timed, args.reps)
                for name, values in rates.items():
                    rate = median(values)
                    row = {
                        "config": config,
                        "dtype": dtype,
                        "max_tokens": budget,
                        "system": name,
                        "tokens_per_s": rate,
                        "peak_memory_mb": memory[name],
                    }
                    if name != "aiayn (bucketing)":
                        seconds = tokens / rate
                        row["mfu_measured_peak"] = flops / seconds / 1e12 / measured[dtype]
                        if sheet and dtype == "bf16":
                            row["mfu"] = flops / seconds / 1e12 / sheet
                        row["tflops"] = flops / seconds / 1e12
                    results.append(row)
                if args.profile and budget == max(budgets):
                    profiles[f"{config}/{dtype}/{budget}"] = cuda_profile(steps["aiayn"], fixed[:n])
            del built, steps
            gc.collect()
            torch.cuda.empty_cache()
    print_cuda_table(results)
    summary = cuda_ratios(results)
    for line in summary["lines"]:
        print(line)
    for key, text in profiles.items():
        print(f"\nprofile of aiayn's updates, {key} tokens:\n{text}")
    print(
        json.dumps(
            {
                "benchmark": "train",
                "device": where,
                "gpu": gpu,
                "gemm_peak_tflops": measured,
                "datasheet_bf16_tflops": sheet,
                "results": results,
                "ratios": summary["ratios"],
                "notes": notes,
            }
        )
    )


def print_cuda_table(results: list[dict]) -> None:
    print(
        f"\n{'config':6} {'dtype':5} {'tokens':>6} {'system':18} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'peak MB':>8}"
    )
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        tf = f"{r['tflops']:.0f}" if "tflops" in r else "-"
        print(
            f"{r['config']:6} {r['dtype']:5} {r['max_tokens']:6} {r['system']:18} {r['tokens_per_s']:9.0f} "
            f"{tf:>8} {mfu:>6} {r['peak_memory_mb']:8.0f}"
        )


def cuda_ratios(results: list[dict]) -> dict:
    """aiayn / best peer in speed and / lowest peer in memory, per config, dtype and batch size."""
    out, lines = {}, []
    for key in sorted({(r["config"], r["dtype"], r["max_tokens"]) for r in results}):
        cell = {r["system"]: r for r in results if (r["config"], r["dtype"], r["max_tokens"]) == key}
        peers = {k: v for k, v in cell.items() if not k.startswith("aiayn")}
        if not peers:
            continue
        best = max(peers, key=lambda k: peers[k]["tokens_per_s"])
        low = min(peers, key=lambda k: peers[k]["peak_memory_mb"])
        entry = {
            "speed_vs_best_peer": cell["aiayn"]["tokens_per_s"] / peers[best]["tokens_per_s"],
            "best_peer": best,
            "memory_vs_lowest_peer": cell["aiayn"]["peak_memory_mb"] / peers[low]["peak_memory_mb"],
            "lowest_memory_peer": low,
        }
        out["/".join(map(str, key))] = entry
        lines.append(
            f"{key[0]} {key[1]} {key[2]} tokens: aiayn {entry['speed_vs_best_peer']:.2f}x the best peer ({best}), "
            f"memory {entry['memory_vs_lowest_peer']:.2f}x the lowest ({low})"
        )
    return {"ratios": out, "lines": lines}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--configs", help="default: low-resource,small,base on the CPU, base on CUDA")
    ap.add_argument("--dtypes", help="default: fp32,bf16 on the CPU, bf16 on CUDA")
    ap.add_argument(
        "--max-tokens", help=f"CUDA: padded target tokens per batch, each a cell ({CUDA_BUDGETS})"
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler of aiayn's updates (CUDA: at the largest batch; CPU: each config and dtype)",
    )
    ap.add_argument(
        "--isa",
        choices=sorted(ISA_CAPS),
        default="native",
        help="cap every system at this instruction set (avx2: what an AVX2 laptop runs; common.ISA_CAPS)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batches", type=int, default=3, help="batches per timed round")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-RSS child processes")
    ap.add_argument(
        "--results",
        help="also write the summary to this JSON file (docs/bench_*_cpu.json: the README's speed table)",
    )
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--bucket", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cap_isa(args.isa)
    if args.child:
        return run_child(*args.child, args.bucket)
    if args.device == "cuda":
        args.configs = args.configs or "base"
        return cuda_main(args)
    args.configs, args.dtypes = args.configs or "low-resource,small,base", args.dtypes or "fp32,bf16"

    set_threads()
    systems = ["aiayn", "torch.nn"] + (["marian"] if have("transformers") else [])
    notes = [] if have("transformers") else ["transformers not installed: Hugging Face Marian skipped"]
    dtypes = args.dtypes.split(",")
    if "bf16" in dtypes and not native_bf16():
        # without AVX512-BF16 or AMX, bf16 GEMMs are emulated: on an AVX2-only EPYC the bf16 peak alone
        # ran over 10 minutes on one thread, and its figures would say nothing about bf16 hardware
        dtypes.remove("bf16")
        notes.append("bf16 skipped: this CPU has neither AVX512-BF16 nor AMX (no native bf16)")
    # the GEMM peak of each dtype measured, and only of those
    peaks = {d: gemm_peak({"fp32": torch.float32, "bf16": torch.bfloat16}[d]) for d in dtypes}
    print(f"machine: {machine()}")
    print("GEMM peak (torch.matmul): " + ", ".join(f"{d} {v:.0f} GFLOP/s" for d, v in peaks.items()))
    results, profiles, steal0 = [], {}, steal_ticks()
    for config in args.configs.split(","):
        shape = CONFIGS[config]
        src, tgt = workload(shape["vocab"], 4000)
        fixed = tensors(src, tgt, fixed_batches(src, tgt))
        bucketed_idx = make_batches(
            [len(s) for s in src], [len(t) + 1 for t in tgt], MAX_TOKENS, seed=0, epoch=0
        )
        bucketed = tensors(src, tgt, bucketed_idx)
        n = args.batches
        flops = sum(train_flops(shape, s, t) for s, t, _ in fixed[:n])
        for dtype in dtypes:
            steps = {name: stepper(name, shape, dtype) for name in systems}
            fixed_n, bucketed_n = fixed[:n], bucketed[:n]
            timed = {name: (lambda s=steps[name], b=fixed_n: measure(s, b)) for name in systems}
            timed["aiayn (bucketing)"] = lambda s=steps["aiayn"], b=bucketed_n: measure(s, b)
            s0 = steal_ticks()
            rates = alternate(timed, args.reps)
            steal = (steal_ticks() - s0) / 100
            tokens = sum(int((t != PAD).sum()) for _, _, t in fixed[:n])
            for name, values in rates.items():
                rate = median(values)
                row = {
                    "config": config,
                    "dtype": dtype,
                    "system": name,
                    "tokens_per_s": rate,
                    "steal_s": steal,
                }
                if name != "aiayn (bucketing)":
                    row["mfu"] = flops / (tokens / rate) / 1e9 / peaks[dtype]
                if not args.no_memory:
                    base = name.split(" ")[0]
                    row["peak_rss_mb"] = child_rss(base, config, dtype, bucket=name != base)
                results.append(row)
            if args.profile:
                shares, table = cpu_profile(steps["aiayn"], fixed_n, shape["vocab"])
                profiles[f"{config}/{dtype}"] = shares
                print(
                    f"\nprofile of aiayn's updates, {config} {dtype}: "
                    + ", ".join(f"{name} {100 * value:.0f}%" for name, value in shares.items())
                    + f"\n{table}"
                )
    defaults = {c: training_dtype("auto", CPU, CONFIGS[c]["d_model"]) for c in args.configs.split(",")}
    print_table(results, defaults)
    summary = ratios(results)
    for line in summary["lines"]:
        print(line)
    report = {
        "benchmark": "train",
        "machine": machine(),
        "command": shlex.join(["python", *sys.argv]),
        "gemm_peak_gflops": peaks,
        "defaults": defaults,  # the dtype `aiayn train` takes for each config here
        "results": results,
        "ratios": summary["ratios"],
        "steal_s_total": (steal_ticks() - steal0) / 100,
        "notes": notes,
        **({"profiles": profiles} if profiles else {}),
    }
    print(json.dumps(report))
    save_results(args.results, report)


def print_table(results: list[dict], defaults: dict[str, str]) -> None:
    """The CPU's figures; * marks the dtype `aiayn train` takes for each config here."""
    print(f"\n{'config':12} {'dtype':6} {'system':18} {'tok/s':>8} {'MFU':>6} {'peak RSS MB':>12}")
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
        rss = f"{r['peak_rss_mb']:.0f}" if "peak_rss_mb" in r else "-"
        dtype = r["dtype"] + ("*" if defaults[r["config"]] == r["dtype"] else "")
        print(f"{r['config']:12} {dtype:6} {r['system']:18} {r['tokens_per_s']:8.0f} {mfu:>6} {rss:>12}")


def ratios(results: list[dict]) -> dict:
    """aiayn / best peer, per config and dtype, on identical batches."""
    out, lines = {}, []
    keys = sorted({(r["config"], r["dtype"]) for r in results})
    for config, dtype in keys:
        cell = {r["system"]: r for r in results if r["config"] == config and r["dtype"] == dtype}
        peers = {k: v for k, v in cell.items() if not k.startswith("aiayn")}
        if not peers:
            continue
        best = max(peers, key=lambda k: peers[k]["tokens_per_s"])
        speed = cell["aiayn"]["tokens_per_s"] / peers[best]["tokens_per_s"]
        entry = {"speed_vs_best_peer": speed, "best_peer": best}
        if "peak_rss_mb" in cell["aiayn"]:
            low = min(peers, key=lambda k: peers[k]["peak_rss_mb"])
            entry["memory_vs_lowest_peer"] = cell["aiayn"]["peak_rss_mb"] / peers[low]["peak_rss_mb"]
        out[f"{config}/{dtype}"] = entry
        lines.append(f"{config} {dtype}: aiayn {speed:.2f}x the best peer ({best})")
    return {"ratios": out, "lines": lines}


if __name__ == "__main__":
    main()
