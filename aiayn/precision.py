"""Where and in what number format the model runs: device, dtype, autocast, int8 and the inference layout,
and the CPU classes whose measured defaults decide them.

One owner for training and translation alike. `Dtype` "auto" (the one default, everywhere) is, on
CUDA, bf16; on a CPU, what CPU_DEFAULTS measured for the CPU's class (cpu_class): translation fp32 on
every class (exact and batch-invariant), training bf16 only where AMX multiplies it faster for the
model's width (training_dtype), fp32 elsewhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import os
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Literal, get_args

import torch
from torch import Tensor, nn
from torch.nn import functional as F

Dtype = Literal["auto", "fp32", "bf16", "fp16", "int8"]
TrainDtype = Literal["auto", "fp32", "bf16", "fp16"]  # int8 is for translation only
Resolved = Literal["fp32", "bf16", "fp16", "int8"]  # what "auto" becomes
DEFAULT_DTYPE = "auto"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(name: str = "auto") -> torch.device:
    """auto: CUDA when there is a GPU, else the CPU; cpu, cuda, cuda:N as torch names them."""
    if name == "auto":
        return default_device()
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r}: aiayn runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def configure(device: torch.device) -> None:
    """Process-wide settings for fast math on the device: TF32 matmuls and convolutions on CUDA (the
    inputs of fp32 matmuls rounded to 10 mantissa bits; bf16 autocast, the default there, is coarser)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def translation_dtype(dtype: Dtype, device: torch.device) -> Resolved:
    """The number format a model translates in: "auto" -> bf16 on CUDA (where the GPU has it), fp32 on
    every CPU class (CPU_DEFAULTS: exact, and a sentence's translation does not depend on its batch)."""
    check_dtype(dtype, device)
    if dtype != "auto":
        return dtype
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "fp32"


def training_dtype(dtype: TrainDtype, device: torch.device, d_model: int) -> Resolved:
    """The number format a model of this width trains in: "auto" -> bf16 on CUDA (where the GPU has it);
    on a CPU, bf16 where this CPU class's measurements say bf16 autocast trains a model this wide faster
    (CPU_DEFAULTS: AMX, from d_model 256), fp32 elsewhere."""
    check_dtype(dtype, device)
    if dtype != "auto":
        return dtype
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    bf16_from = CPU_DEFAULTS[cpu_class()].train_bf16_from
    return "bf16" if bf16_from is not None and d_model >= bf16_from else "fp32"


def check_dtype(dtype: Dtype, device: torch.device) -> None:
    """A ValueError for a number format the device does not run."""
    if dtype == "fp16" and device.type != "cuda":
        raise ValueError("dtype fp16 is for CUDA; on the CPU use bf16 or fp32")
    if dtype == "int8" and device.type != "cpu":
        raise ValueError("dtype int8 is for CPU translation; use bf16 on a GPU")


def autocast(device: torch.device, dtype: Dtype) -> contextlib.AbstractContextManager:
    """bf16 or fp16 autocast, or nothing for fp32 (and int8, whose quantised layers choose for themselves).
    "auto" is translation's (translation_dtype); training resolves its own first (training_dtype)."""
    resolved = translation_dtype(dtype, device)
    if resolved not in ("bf16", "fp16"):
        return contextlib.nullcontext()
    cast = torch.autocast(device.type, dtype=torch.bfloat16 if resolved == "bf16" else torch.float16)
    if device.type == "cpu" and resolved == "bf16" and _attention_packs_without_its_kernels():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        stack = contextlib.ExitStack()
        stack.enter_context(cast)
        stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        return stack
    return cast


def _attention_packs_without_its_kernels() -> bool:
    """Whether PyTorch's CPU flash attention would fail in bf16 here: on a CPU with AMX whose ATen kernels
    are capped below AVX-512 (ATEN_CPU_CAPABILITY=avx2) while oneDNN is not, it asks oneDNN whether to pack
    its bf16 blocks for AMX, then packs them with AVX-512 code it was built without ("pack_vnni2 is only
    supported when avx512 is supported", from about 64 keys on). The reference attention (SDPBackend.MATH)
    runs there instead: the same mathematics, another kernel."""
    return torch.backends.cpu.get_cpu_capability() != "AVX512" and bool(torch._C._cpu._init_amx())


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo (model name, cpu family, flags, ...); {} where there
    is none (not Linux)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip() and info:
                    break
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags, as the kernel reports them (PyTorch reports only some)."""
    return frozenset(cpu_info().get("flags", "").split())


# --- CPU classes: what each kind of processor runs, decided by measurement ------------------------------

# The classes, each with everything the one before has: AVX2 at most (and every CPU without AVX-512
# kernels: other architectures, or a process capped below AVX-512); AVX-512; with VNNI (integer dot
# products); with bf16 dot products (AVX512_BF16); with AMX tiles.
CpuClass = Literal["avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx"]
CPU_CLASSES: tuple[CpuClass, ...] = get_args(CpuClass)
# Names a class for this process whatever the CPU probes say: its defaults and routes, on this CPU's
# kernels (a test of another class's path, or another machine's choices reproduced on this one).
CPU_CLASS_VARIABLE = "AIAYN_CPU_CLASS"


@dataclasses.dataclass(frozen=True)
class Probes:
    """What a CPU class is read from."""

    capability: str  # torch.backends.cpu.get_cpu_capability(): ATen's kernels (ATEN_CPU_CAPABILITY caps them)
    flags: frozenset[str]  # the kernel's /proc/cpuinfo flags
    amx: bool  # torch._C._cpu._init_amx(): AMX tiles, and the OS lets this process use them


def probe() -> Probes:
    """This process's probes of its CPU."""
    return Probes(torch.backends.cpu.get_cpu_capability(), cpu_flags(), bool(torch._C._cpu._init_amx()))


def classify(probes: Probes) -> CpuClass:
    """The class of a CPU as its probes describe it. ATen's kernels decide first: a process whose kernels
    are capped below AVX-512 runs AVX2 code, whatever the CPU has (oneDNN's bf16 included)."""
    if probes.capability != "AVX512":
        return "avx2"
    if "avx512_vnni" not in probes.flags:
        return "avx512"
    if probes.amx:
        return "amx"
    return "avx512_bf16" if "avx512_bf16" in probes.flags else "avx512_vnni"


def cpu_class() -> CpuClass:
    """This process's CPU class: AIAYN_CPU_CLASS where it is set, else what the probes say."""
    named = os.environ.get(CPU_CLASS_VARIABLE)
    if named:
        if named not in CPU_CLASSES:
            raise ValueError(
                f"{CPU_CLASS_VARIABLE}={named!r}: not a CPU class; use one of {', '.join(CPU_CLASSES)}"
            )
        return named  # type: ignore[return-value]
    return classify(probe())


@dataclasses.dataclass(frozen=True)
class CpuDefaults:
    """What one CPU class runs where the user does not say."""

    # the row of INT8_ROUTES (and of compiler.TEMPLATE_ROWS) its kernels take: "vnni" where integer dot
    # products are vectorised, "avx2" (no VNNI) elsewhere
    kernels: Literal["vnni", "avx2"]
    # training's dtype auto: bf16 autocast for a model at least this wide (d_model), fp32 below; None:
    # fp32 at every width
    train_bf16_from: int | None = None


# Measured, not guessed: training by benchmarks/bench_train.py, fp32 against bf16 autocast per preset
# in one run (docs/bench_train_cpu.json; tests/test_cpu_classes.py holds the AMX row to it). With AMX,
# bf16 trains `small` (d_model 256) and `base` (512) faster than fp32, and `low-resource` (128) slower:
# autocast's casts of every weight and activation cost more than the tiles save on small products.
# Without AMX, bf16 products run on AVX-512 (with or without AVX512_BF16) or are emulated, slower than
# fp32's (docs/performance.md). Translation is fp32 on every class (translation_dtype): bf16 changes
# tokens against fp32, and in a batch a sentence's tokens depend on what shares it; `--dtype bf16` takes
# it where it is faster (docs/translation.md says what it changes).
CPU_DEFAULTS: Mapping[CpuClass, CpuDefaults] = MappingProxyType(
    {
        "avx2": CpuDefaults("avx2"),
        "avx512": CpuDefaults("avx2"),  # integer products without VNNI: as slow as on AVX2
        "avx512_vnni": CpuDefaults("vnni"),
        "avx512_bf16": CpuDefaults("vnni"),
        "amx": CpuDefaults("vnni", train_bf16_from=256),
    }
)


def kernels() -> Literal["vnni", "avx2"]:
    """The row of INT8_ROUTES (and compiler.TEMPLATE_ROWS) this process takes: its CPU class's."""
    return CPU_DEFAULTS[cpu_class()].kernels


Route = Literal["w8a8", "woq", "fp32"]
RowClass = Literal["one", "few", "many"]

# How an int8 layer multiplies, by CPU class and by the rows of the call: "one", a decoding step of one
# hypothesis (a matrix-vector product); "few", 2 to 15 rows (a step of beam 4 or of a few sentences);
# "many", 16 rows and more, and any count a compiled graph leaves dynamic (the encoder). The routes:
# "w8a8", int8 x int8 with torch._int_mm (oneDNN, integer products only vectorised with VNNI); "woq",
# int8 weights and bf16 activations (_weight_int8pack_mm, vectorised for AVX2 and AVX-512, which
# max_autotune replaces by inductor's own GEMM template); "fp32", the float weights (MKL). Measured, not
# guessed: per kernel by benchmarks/bench_gemm.py (docs/bench_gemm_cpu.json and, capped at AVX2,
# docs/bench_gemm_cpu_avx2.json; tests/test_precision.py checks the AVX2 row against its file) and per
# model by benchmarks/bench_translate.py (their files hold the figures). With VNNI, one row runs the
# weights-only route (faster than W8A8 in compiled greedy search of one sentence of `small` and of `base`:
# oneDNN's int8 matrix-vector call has a fixed cost whatever its size), a few rows too (oneDNN packs the
# weight for _int_mm on every call from two rows on, which costs more than W8A8's products save there),
# and a batch W8A8. Without VNNI integer products are slower than either float route, and from 16 rows on
# bf16 activations, which AVX2 widens to fp32 for every product, lose to fp32: there a batch runs the
# float weights, kept beside the int8 ones, and int8 is never slower than fp32.
INT8_ROUTES: Mapping[str, Mapping[RowClass, Route]] = MappingProxyType(
    {
        "vnni": MappingProxyType({"one": "woq", "few": "woq", "many": "w8a8"}),
        "avx2": MappingProxyType({"one": "woq", "few": "woq", "many": "fp32"}),  # every CPU without VNNI
    }
)


class Int8Linear(nn.Module):
    """y = x W^T + b with W stored as int8 and one scale per output row (symmetric: W ~ scale * W_int8),
    multiplied by the route the CPU class takes for the rows of the call (INT8_ROUTES).

    w8a8: the activations are quantised per row as well, on every call (as CTranslate2's int8), and
    `torch._int_mm` multiplies int8 by int8 into int32 (oneDNN). A row is quantised around its
    midpoint m = (max + min) / 2, x ~ m + s * x_int8 with s = (max - min) / 254, so that the 255 levels
    span the row's own range: the feed-forward's second layer reads ReLU outputs, all >= 0, which
    quantised around 0 would use half of them. Then x W^T = s * (x_int8 W^T) + m * (the sum of each row
    of W), the sums kept with the weight (on Multi30k, de->en: BLEU 0.10-0.16 closer to fp32 than around 0).
    Under torch.compile the quantisation of the activations fuses into one kernel.
    woq: only the weights are int8; the activations go in as bf16 (`_weight_int8pack_mm`).
    fp32: the float weights, kept beside the int8 ones where a row class takes them.
    """

    def __init__(self, linear: nn.Linear, routes: Route | Mapping[RowClass, Route]):
        super().__init__()
        if isinstance(routes, str):
            routes = dict.fromkeys(("one", "few", "many"), routes)
        self.routes = dict(routes)
        weight = linear.weight.detach().float()  # (N, K)
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        q = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8)  # (N, K)
        uses = set(self.routes.values())
        # the nn.Linear layout (N, K) for both kernels: _int_mm takes it as (K, N) column-major, W^T, which
        # at one row oneDNN multiplies as a matrix-vector product, faster than a (K, N) row-major copy
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("scale_bf16", scale.bfloat16())  # as _weight_int8pack_mm takes it
        row_sum = (
            q.float().sum(dim=1) * scale if "w8a8" in uses else None
        )  # (N,) W's rows dequantised, summed
        self.register_buffer("row_sum", row_sum)
        self.register_buffer("weight_fp32", weight.clone() if "fp32" in uses else None)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def w8a8(self) -> bool:
        """Whether some row class multiplies int8 by int8 (its rows() are dequantised with the fp32 scale)."""
        return "w8a8" in self.routes.values()

    def forward(self, x: Tensor) -> Tensor:
        """x (..., K) float -> (..., N) float32."""
        shape = x.shape
        route = self.routes[_row_class(x)]
        x = x.reshape(-1, shape[-1]).float()  # (M, K)
        if route == "fp32":
            return F.linear(x, self.weight_fp32, self.bias).reshape(*shape[:-1], self.out_features)
        if route == "w8a8":
            low, high = torch.aminmax(x, dim=1, keepdim=True)  # (M, 1) each
            mid, x_scale = (high + low) / 2, ((high - low) / 254).clamp(min=1e-12)  # (M, 1)
            xq = ((x - mid) / x_scale).round().clamp(-127, 127).to(torch.int8)  # (M, K)
            y = torch._int_mm(xq, self.weight.t()) * (x_scale * self.scale) + mid * self.row_sum  # (M, N)
        else:
            y = torch.ops.aten._weight_int8pack_mm(
                x.bfloat16(), self.weight, self.scale_bf16
            ).float()  # (M, N)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def rows(self, index: Tensor) -> Tensor:
        """(len(index), K) float32: the weight's rows `index` dequantised (an output-layer shortlist)."""
        scale = self.scale if self.w8a8 else self.scale_bf16.float()
        return self.weight.index_select(0, index).float() * scale.index_select(0, index)[:, None]

    def extra_repr(self) -> str:
        routes = ", ".join(f"{rows} rows {route}" for rows, route in self.routes.items())
        return f"in_features={self.in_features}, out_features={self.out_features}, {routes}"


def _row_class(x: Tensor) -> RowClass:
    """Which rows x (R, L, K) is (R * L of a decoding step): one, few (2 to 15) or many. Where a compiled
    graph leaves the rows dynamic, the rows it is traced for (traced_rows); an encoder's source length,
    dynamic in its graph, counts as many."""
    if x.dim() != 3 or type(x.size(1)) is not int:
        return "many"
    rows = x.size(0) if type(x.size(0)) is int else _TRACED_ROWS.get()
    if rows is None:
        return "many"
    return row_class(rows * x.size(1))


def row_class(rows: int) -> RowClass:
    """The class of a matrix product of this many rows."""
    return "one" if rows == 1 else "few" if rows < 16 else "many"


# The rows a graph whose row count is dynamic is traced and compiled for (compiled.py sets it around a
# compile): what its int8 layers' routes and its matrix products' kernels are chosen for, the same in
# every process whatever batch happens to compile it. None: none (a dynamic count is many rows).
_TRACED_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar("traced_rows", default=None)


@contextlib.contextmanager
def traced_rows(rows: int | None) -> Iterator[None]:
    """Trace and compile, where the rows are dynamic, as for this many rows."""
    token = _TRACED_ROWS.set(rows)
    try:
        yield
    finally:
        _TRACED_ROWS.reset(token)


def rows_traced() -> int | None:
    """The rows traced_rows() set, or None."""
    return _TRACED_ROWS.get()


def for_inference(model: nn.Module, dtype: Dtype) -> nn.Module:
    """The model as translation runs it; training and saving must keep using the original.

    int8: a copy with every Linear layer an Int8Linear (int8 weights with a scale per output row; CPU).
    Otherwise the same model in eval mode with its Linear weights stored column-major on the CPU:
    the same numbers, but x W^T then streams W^T row by row, which the CPU GEMM runs faster at the few
    rows of a decoding step, about even at 128. safetensors refuses
    such non-contiguous tensors, which is why this model is not the one to save.
    """
    device = next(model.parameters()).device
    if translation_dtype(dtype, device) == "int8":
        return _int8_copy(model.eval(), INT8_ROUTES[kernels()])
    if device.type == "cpu":
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.Linear) and module.weight.is_contiguous():
                    # The tied output projection shares the target embedding's storage, whose row
                    # lookups do not mind the layout.
                    module.weight.data = module.weight.data.t().contiguous().t()  # (out, in), column-major
    return model.eval()


def _int8_copy(model: nn.Module, routes: Mapping[RowClass, Route]) -> nn.Module:
    """A deep copy of model with every nn.Linear replaced by an Int8Linear (the model is left as it is)."""
    quantised = copy.deepcopy(model)
    for module in list(quantised.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Linear:
                setattr(module, name, Int8Linear(child, routes))
    return quantised
