"""Where and in what number format the model runs: device, dtype, autocast, int8 and the inference layout.

One policy for training and translation alike. `Dtype` "auto" (the one default, everywhere) is bf16
where it is fast, CUDA or a CPU with AMX tiles, and fp32 elsewhere.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
from torch import nn

Dtype = Literal["auto", "fp32", "bf16", "fp16", "int8"]
TrainDtype = Literal["auto", "fp32", "bf16", "fp16"]  # int8 is for translation only
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


def resolve_dtype(dtype: Dtype, device: torch.device) -> Literal["bf16", "fp32", "fp16", "int8"]:
    """ "auto" -> bf16 where it is fast: CUDA, or a CPU with AMX tiles; fp32 elsewhere.

    Without AMX (e.g. a VM that hides it), CPU bf16 matmuls run on AVX-512 and were measured
    slower than fp32 here (about 80 vs 140 GFLOP/s). fp16 (with a gradient scaler in training) is a
    CUDA option for GPUs without bf16.
    """
    if dtype == "fp16" and device.type != "cuda":
        raise ValueError("dtype fp16 is for CUDA; on the CPU use bf16 or fp32")
    if dtype != "auto":
        return dtype
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if torch._C._cpu._init_amx() else "fp32"


def autocast(device: torch.device, dtype: Dtype) -> contextlib.AbstractContextManager:
    """bf16 or fp16 autocast, or nothing for fp32 (and int8, whose quantised layers choose for themselves)."""
    resolved = resolve_dtype(dtype, device)
    if resolved not in ("bf16", "fp16"):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if resolved == "bf16" else torch.float16)


def for_inference(model: nn.Module, dtype: Dtype) -> nn.Module:
    """The model as translation runs it; training and saving must keep using the original.

    int8: a copy with every Linear layer dynamically quantised (int8 weights, activations per batch; CPU).
    Otherwise the same model in eval mode with its Linear weights stored column-major on the CPU:
    the same numbers, but x W^T then streams W^T row by row, which the CPU GEMM runs 1.3-2x faster at the
    few rows of a decoding step (4-32 measured, about even at 128; README, Speed). safetensors refuses
    such non-contiguous tensors, which is why this model is not the one to save.
    """
    device = next(model.parameters()).device
    if resolve_dtype(dtype, device) == "int8":
        if device.type != "cpu":
            raise ValueError("dtype int8 (dynamic quantisation) is for CPU translation; use bf16 on a GPU")
        return torch.ao.quantization.quantize_dynamic(model.eval(), {nn.Linear}, dtype=torch.qint8)
    if device.type == "cpu":
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.Linear) and module.weight.is_contiguous():
                    # The tied output projection shares the target embedding's storage, whose row
                    # lookups do not mind the layout.
                    module.weight.data = module.weight.data.t().contiguous().t()  # (out, in), column-major
    return model.eval()
