"""Small-row matrix products of a decoding step, by kernel: microseconds per call (median of 5 x 200 calls,
weights in cache). fp32: PyTorch's F.linear (MKL on x86) and oneDNN with a prepacked weight; int8:
int8 weights with bf16 or fp32 activations (_weight_int8pack_mm), int8 x int8 (torch._int_mm, oneDNN
with VNNI; and oneDNN's qlinear with a prepacked weight), and fbgemm's dynamic quantisation (the
deprecated quantize_dynamic).

    python benchmarks/bench_gemm.py [--threads 2] [--rows 1,4,32] [--isa avx2] [--results FILE]
The last line printed is JSON. The int8 route a CPU class takes (precision.INT8_ROUTES) is read from these
files, one per class: docs/bench_gemm_cpu.json natively, docs/bench_gemm_cpu_avx2.json capped at AVX2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ISA_CAPS, cap_isa, machine, save_results  # noqa: E402

SHAPES = ((256, 256), (256, 1024), (1024, 256), (256, 8000), (512, 2048))  # (in, out)


def timeit(fn, n: int = 200) -> float:
    for _ in range(20):
        fn()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(rounds)


def kernels(M: int, K: int, N: int) -> dict[str, float]:
    x, w, b = torch.randn(M, K), torch.randn(N, K) * 0.05, torch.randn(N)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, M)
    scale = w.abs().amax(1) / 127
    wq = (w / scale[:, None]).round().to(torch.int8)
    xb, sb, xq, wq_t = (
        x.bfloat16(),
        scale.bfloat16(),
        torch.randint(-127, 127, (M, K), dtype=torch.int8),
        wq.t().contiguous(),
    )
    linear = torch.nn.Linear(K, N)
    linear.weight.data, linear.bias.data = w, b
    fbgemm = torch.ao.quantization.quantize_dynamic(
        torch.nn.Sequential(linear), {torch.nn.Linear}, dtype=torch.qint8
    )
    return {
        "mkl_fp32": timeit(lambda: F.linear(x, w, b)),
        "onednn_fp32": timeit(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")),
        "int8_weights_bf16_act": timeit(lambda: torch.ops.aten._weight_int8pack_mm(xb, wq, sb)),
        "int8_weights_fp32_act": timeit(lambda: torch.ops.aten._weight_int8pack_mm(x, wq, scale)),
        "int_mm_int8": timeit(lambda: torch._int_mm(xq, wq_t)),
        "onednn_qlinear": qlinear(M, K, N, wq, scale, b),
        "fbgemm_dynamic": timeit(lambda: fbgemm(x)),
    }  # fmt: skip


def qlinear(M: int, K: int, N: int, wq: torch.Tensor, scale: torch.Tensor, b: torch.Tensor) -> float:
    """oneDNN's int8 linear with a prepacked weight (what inductor lowers PT2E int8 to): int8 activations
    with one scale for the whole (M, K) input, fp32 out with the bias added; NaN where this build lacks it."""
    try:
        packed = torch.ops.onednn.qlinear_prepack(wq, [M, K])
        xq = torch.randint(-127, 127, (M, K), dtype=torch.int8)
        x_scale, zero = torch.tensor(0.02), torch.tensor(0, dtype=torch.int32)
        w_zero = torch.zeros(N, dtype=torch.int32)
        args = (xq, x_scale, zero, packed, scale, w_zero, b, 1.0, 0, torch.float32, "none", [], "")
        return timeit(lambda: torch.ops.onednn.qlinear_pointwise.tensor(*args))
    except (RuntimeError, AttributeError):
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,32")
    ap.add_argument("--isa", choices=sorted(ISA_CAPS), default="native", help="cap at this instruction set")
    ap.add_argument("--results", help="also write the summary to this JSON file")
    args = ap.parse_args()
    cap_isa(args.isa)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"machine: {machine()}, {args.threads} threads")
    rows = []
    with torch.inference_mode():
        for M in (int(m) for m in args.rows.split(",")):
            for K, N in SHAPES:
                cell = {"rows": M, "in": K, "out": N, **kernels(M, K, N)}
                rows.append(cell)
                print(
                    f"{M:4} x {K:4} -> {N:4}  "
                    + "  ".join(f"{k} {v:8.1f}" for k, v in cell.items() if k not in ("rows", "in", "out")),
                    flush=True,
                )
    summary = {"benchmark": "gemm", "machine": machine(), "threads": args.threads, "us_per_call": rows}
    print(json.dumps(summary))
    save_results(args.results, summary)


if __name__ == "__main__":
    main()
