"""Model directories: atomic save and safe load of weights, configs and training state; averaging (§6.1).

A model directory holds `config.json` (ModelConfig), `model.safetensors`, the tokenizer file(s)
and, in a training checkpoint, `state.pt` (optimizer, schedule, step, data position, RNG) and
`train.json` (TrainConfig). Everything is written to a temporary name, fsynced and renamed, so a
kill at any moment leaves the previous version loadable. Nothing is unpickled: weights are
safetensors and `state.pt` is read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from aiayn.config import ModelConfig, TrainConfig, load_json, save_json
from aiayn.model import Transformer
from aiayn.tokenizer import Tokenizer

CONFIG, WEIGHTS, STATE, TRAIN_CONFIG = "config.json", "model.safetensors", "state.pt", "train.json"
CHECKPOINTS = "checkpoints"


def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> None:
    """Call write(tmp) on a temporary file beside `path`, fsync it, then rename it over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; models and translations are not secrets
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_weights(model: Transformer, path: str | Path) -> None:
    """safetensors of the model's state; tied matrices are stored once (save_model dedups them)."""
    atomic_write(path, lambda tmp: safetensors.torch.save_model(model, str(tmp)))


def save_model(directory: str | Path, model: Transformer, tokenizer: Any) -> None:
    """Write (or overwrite, file by file, atomically) a model directory that Translator.load reads."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / CONFIG, lambda tmp: save_json(model.config, tmp))
    tokenizer.save(directory)
    save_weights(model, directory / WEIGHTS)


def load_model_config(directory: str | Path) -> ModelConfig:
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory")
    if not (directory / CONFIG).is_file():
        raise ValueError(f"{directory}: not a model directory (no {CONFIG})")
    return load_json(ModelConfig, directory / CONFIG)


def load_weights(model: Transformer, path: str | Path) -> None:
    """Load safetensors weights; a truncated, corrupted or mismatched file is a ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        missing, unexpected = safetensors.torch.load_model(model, str(path), strict=False)
    except (safetensors.SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ValueError(f"{path}: cannot read model weights ({e})") from None
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not fit config.json (missing {missing}, unexpected {unexpected})"
        )


def load_model(directory: str | Path, device: str | torch.device = "cpu") -> Transformer:
    """Rebuild the model from config.json and load its weights, in eval mode."""
    directory = Path(directory)
    model = Transformer(load_model_config(directory))
    load_weights(model, directory / WEIGHTS)
    return model.to(device).eval()


def save_checkpoint(
    out: str | Path,
    step: int,
    model: Transformer,
    tokenizer: Any,
    train_config: TrainConfig,
    state: dict[str, Any],
) -> Path:
    """Write OUT/checkpoints/step_N as a complete directory, made under a temporary name and renamed."""
    root = Path(out) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}.", suffix=".tmp"))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private, like mkstemp in atomic_write
        save_model(tmp, model, tokenizer)
        atomic_write(tmp / TRAIN_CONFIG, lambda p: save_json(train_config, p))
        atomic_write(tmp / STATE, lambda p: torch.save(state, p))
        if final.exists():  # the same step saved again (e.g. an interrupt right after a validation)
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


def list_checkpoints(out: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories of an interrupted save are ignored)."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))


def prune_checkpoints(out: str | Path, keep_last: int, keep: Path | None = None) -> None:
    """Delete all but the newest `keep_last` checkpoints, and never `keep` (the best one)."""
    for path in list_checkpoints(out)[:-keep_last]:
        if keep is None or path.resolve() != keep.resolve():
            shutil.rmtree(path)


def load_state(directory: str | Path) -> dict[str, Any]:
    """Training state; weights_only=True so the file cannot execute code."""
    path = Path(directory) / STATE
    if not path.is_file():
        raise ValueError(f"{path}: no training state here (not a training checkpoint)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a damaged zip/pickle; all mean the same here
        raise ValueError(f"{path}: cannot read training state ({type(e).__name__}: {e})") from None


def average_checkpoints(directories: list[Path]) -> dict[str, torch.Tensor]:
    """§6.1: the element-wise mean of the parameters of several checkpoints of one model."""
    if not directories:
        raise ValueError("no checkpoints to average")
    configs = {load_model_config(d) for d in directories}
    if len(configs) > 1:
        raise ValueError(f"checkpoints {[str(d) for d in directories]} have different configs")
    total: dict[str, torch.Tensor] = {}
    for d in directories:
        tensors = safetensors.torch.load_file(str(d / WEIGHTS))
        for name, tensor in tensors.items():
            total[name] = total.get(name, 0) + tensor.double()
    return {name: (t / len(directories)).float() for name, t in total.items()}


def average(out: str | Path, last: int, dest: str | Path) -> Path:
    """Average the last N checkpoints of a training directory into a new model directory."""
    if last < 1:  # checkpoints[-0:] would be all of them
        raise ValueError(f"the number of checkpoints to average must be at least 1, got {last}")
    checkpoints = list_checkpoints(out)
    if len(checkpoints) < last:
        raise ValueError(f"{out}: asked to average the last {last} checkpoints, found {len(checkpoints)}")
    chosen = checkpoints[-last:]
    model = Transformer(load_model_config(chosen[0]))
    missing, unexpected = model.load_state_dict(average_checkpoints(chosen), strict=False)
    tied = {"generator.weight", "src_embed.tokens.weight", "tgt_embed.tokens.weight"}
    assert not unexpected and set(missing) <= tied, (missing, unexpected)
    save_model(dest, model, Tokenizer.load(chosen[-1]))
    return Path(dest)
