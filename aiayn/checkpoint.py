"""Model directories: save and safe load of weights, configs and training state; averaging (§6.1).

A model directory holds `config.json` (ModelConfig), `model.safetensors`, the tokenizer file(s) and, when
it was trained by aiayn, `search.json` (the SearchConfig it is meant to be decoded with) and, where they
are known, `languages.json` (the languages it reads and writes: Languages);
a training checkpoint (OUT/checkpoints/step_N) adds `state.pt` (optimizer, progress, RNG) and
`train.json` (TrainConfig). A model directory is written as a set whose config.json lands last, and a
checkpoint under a temporary name renamed whole, so a kill at any moment leaves the previous version
loadable (files.py). Nothing is unpickled: weights are safetensors and `state.pt` is read with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import struct
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import safetensors
import safetensors.torch
import torch

from aiayn.config import ModelConfig, SearchConfig, TrainConfig, from_dict, read_json, save_json
from aiayn.files import atomic_write, check_replaceable, staged_dir, write_contents, write_set
from aiayn.model import Transformer
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer

CONFIG, WEIGHTS, STATE, TRAIN_CONFIG = "config.json", "model.safetensors", "state.pt", "train.json"
SEARCH = "search.json"
LANGUAGES = "languages.json"
EXPORT_CONFIG = "aiayn_config.json"  # our ModelConfig in an export, beside the other engine's config.json
CHECKPOINTS = "checkpoints"

# Names of model directories written before the special ids left ModelConfig and the layer norms left
# their Residual wrappers; such directories still load.
_LEGACY_IDS = MappingProxyType({"pad_id": PAD_ID, "bos_id": BOS_ID, "eos_id": EOS_ID})
_LEGACY_NAMES = MappingProxyType(
    {
        "res_attn.norm.": "self_attn_norm.",
        "res_self.norm.": "self_attn_norm.",
        "res_cross.norm.": "cross_attn_norm.",
        "res_ff.norm.": "feed_forward_norm.",
    }
)


# --- Weights --------------------------------------------------------------------------------------


def weights_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The state dict with each shared matrix stored once, under the first of its names in sorted order
    (the tied output projection keeps `generator.weight`); loading ties them again."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in sorted(model.state_dict().items()):
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in seen:
            seen.add(key)
            tensors[name] = tensor.detach().contiguous()
    return tensors


def write_weights(model: Transformer, path: Path) -> None:
    """safetensors of the model's weights; the same weights give the same bytes."""
    safetensors.torch.save_file(weights_dict(model), str(path))


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file by name (old names renamed); a damaged file is a ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{path}: not readable (permission denied)")
    try:
        tensors = safetensors.torch.load_file(str(path))
    except (safetensors.SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise ValueError(f"{path}: cannot read model weights ({e})") from None
    renamed = {}
    for name, tensor in tensors.items():
        for old, new in _LEGACY_NAMES.items():
            name = name.replace(old, new)
        renamed[name] = tensor
    return renamed


def load_weights(model: Transformer, path: str | Path) -> None:
    """Load safetensors weights; a truncated, corrupted or mismatched file is a ValueError naming it."""
    tensors = read_weights(path)
    expected = model.state_dict()
    wrong = [n for n, t in tensors.items() if n in expected and t.shape != expected[n].shape]
    if wrong:
        n = wrong[0]
        raise ValueError(
            f"{path}: weights do not fit config.json ({n} is {tuple(tensors[n].shape)}, the config makes it "
            f"{tuple(expected[n].shape)})"
        )
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    stored = set(weights_dict(model))  # a tied name is missing from the file by design
    missing = [n for n in missing if n in stored]
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not fit config.json (missing {missing}, unexpected {unexpected})"
        )


# --- Languages ------------------------------------------------------------------------------------

# A language as OPUS-MT's names and tags write one: ISO 639-1 or 639-3 letters, then optionally a script
# and a region (zh_Hant, pt_br, es_419), joined by "_" or "-". The suffixes keep the case the model uses:
# a tag must be written exactly as its vocabulary holds it.
_CODE = re.compile(r"[a-z]{2,3}(?:[_-][A-Za-z]{4})?(?:[_-](?:[A-Za-z]{2}|[0-9]{3}))?")
CODE_FORM = "two or three lowercase letters, then optionally a script or region: de, deu, pt_br, zh_Hant"


def is_language_code(code: object) -> bool:
    return isinstance(code, str) and _CODE.fullmatch(code) is not None


@dataclass(frozen=True)
class Languages:
    """What a model translates (languages.json): the languages it reads, those it writes and, for a
    multilingual OPUS-MT model, the token put in front of a source text to choose each target (>>fr<<).
    A ValueError names a value that is not a language code."""

    source: tuple[str, ...]  # ("de",)
    target: tuple[str, ...]  # ("en",)
    # target -> its tag; empty: the model has none
    tags: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", tuple(self.source))
        object.__setattr__(self, "target", tuple(self.target))
        object.__setattr__(self, "tags", MappingProxyType(dict(self.tags)))
        for side, codes in (("source", self.source), ("target", self.target)):
            if not codes:
                raise ValueError(f"no {side} language")
            for code in codes:
                if not is_language_code(code):
                    raise ValueError(f"{side} {code!r} is not a language code ({CODE_FORM})")
            if len(set(codes)) != len(codes):
                raise ValueError(f"{side} names a language twice: {list(codes)}")
        if self.tags and set(self.tags) != set(self.target):
            raise ValueError(
                f"tags {dict(self.tags)} must name each target language {list(self.target)} once"
            )
        for code, tag in self.tags.items():
            if not isinstance(tag, str) or not tag or tag != tag.strip() or " " in tag:
                raise ValueError(f"the tag of {code} must be one token (e.g. >>{code}<<), got {tag!r}")

    def __hash__(self) -> int:  # (a mapping has no hash of its own)
        return hash((self.source, self.target, tuple(sorted(self.tags.items()))))

    def pairs(self) -> tuple[tuple[str, str], ...]:
        """The (source, target) directions the model serves."""
        return tuple((s, t) for s in self.source for t in self.target if s != t)

    def prefix(self, target: str) -> str:
        """What goes in front of a source text to translate it into `target`: its tag and a space, or ""
        for a model without tags; a ValueError naming the code for a language the model does not write."""
        if target not in self.target:
            raise ValueError(f"{target}: not a language the model writes (it translates {self.describe()})")
        return f"{self.tags[target]} " if self.tags else ""

    def describe(self) -> str:
        """One line: "de -> en", "en -> de, fr (tags >>de<<, >>fr<<)"."""
        tags = f" (tags {', '.join(self.tags[t] for t in self.target)})" if self.tags else ""
        return f"{', '.join(self.source)} -> {', '.join(self.target)}{tags}"

    def to_json(self) -> dict[str, Any]:
        return {"source": list(self.source), "target": list(self.target), "tags": dict(self.tags)}


def save_languages(languages: Languages, path: Path) -> None:
    path.write_text(json.dumps(languages.to_json(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def load_languages(directory: str | Path) -> Languages | None:
    """A model directory's languages.json; None where it has none (made before models knew their
    languages, or by an import that could not tell them); a damaged one is a ValueError naming it."""
    path = Path(directory) / LANGUAGES
    if not path.exists():
        return None
    values = read_json(path)
    expected = {"source": list, "target": list, "tags": dict}
    if set(values) != set(expected) or any(not isinstance(values[k], t) for k, t in expected.items()):
        raise ValueError(f"{path}: expected source and target (lists of language codes) and tags (code: tag)")
    try:
        return Languages(tuple(values["source"]), tuple(values["target"]), values["tags"])
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


# --- Model directories ----------------------------------------------------------------------------


def save_model(
    directory: str | Path,
    model: Transformer,
    tokenizer: Tokenizer,
    search: SearchConfig | None = None,
    languages: Languages | None = None,
) -> None:
    """Write (or replace) a model directory that Translator.load reads: never a mix of two models.
    search: the search the model is meant for (search.json); None: none is written (readers use §6.1's).
    languages: what it translates (languages.json); None: none is written (not known)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = {WEIGHTS: lambda tmp: write_weights(model, tmp)}
    for name, data in tokenizer.files().items():
        files[name] = lambda tmp, data=data: write_contents(tmp, data)
    if search is not None:
        files[SEARCH] = lambda tmp: save_json(search, tmp)
    if languages is not None:
        files[LANGUAGES] = lambda tmp: save_languages(languages, tmp)
    files[CONFIG] = lambda tmp: save_json(model.config, tmp)
    stale = tokenizer.stale_files() + (() if search is not None else (SEARCH,))
    stale += () if languages is not None else (LANGUAGES,)
    write_set(directory, files, last=CONFIG, stale=stale)


def load_search(directory: str | Path) -> SearchConfig:
    """The search a model directory is meant for, like Hugging Face's generation_config.json: its
    search.json (the recipe's, written by training), else §6.1's (beam 4, alpha 0.6)."""
    path = Path(directory) / SEARCH
    if not path.is_file():
        return SearchConfig()
    return from_dict(SearchConfig, read_json(path), where=str(path))


def read_model_config(path: str | Path) -> ModelConfig:
    """A ModelConfig file; special ids saved by earlier versions are accepted when they are the tokenizer's."""
    values = read_json(path)
    for key, expected in _LEGACY_IDS.items():
        if key in values:
            if values[key] != expected:
                raise ValueError(
                    f"{path}: {key}={values[key]}, but the tokenizer's {key} is {expected}; this model "
                    "was made for another vocabulary layout"
                )
            del values[key]
    return from_dict(ModelConfig, values, where=str(path))


def load_model_config(directory: str | Path) -> ModelConfig:
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory")
    if not (directory / CONFIG).is_file():
        raise ValueError(f"{directory}: not a model directory (no {CONFIG})")
    return read_model_config(directory / CONFIG)


def load_model(directory: str | Path, device: str | torch.device = "cpu") -> Transformer:
    """Rebuild the model from config.json and load its weights, in eval mode."""
    return _with_weights(load_model_config(directory), Path(directory), device)


def _with_weights(config: ModelConfig, directory: Path, device: str | torch.device) -> Transformer:
    model = Transformer(config)
    load_weights(model, directory / WEIGHTS)
    return model.to(device).eval()


@dataclass(frozen=True)
class ModelDir:
    """A model directory read once, where its use begins (translating, serving, exporting, averaging,
    fine-tuning): its configuration, tokenizer, search and languages, each checked on the way in, and its
    weights read when a model is asked for. What the directory holds is read here and nowhere else, and
    what needs it is given this instead of the path."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    search: SearchConfig  # search.json, else §6.1's
    languages: Languages | None  # languages.json; None: not known

    @classmethod
    def read(cls, directory: str | Path | ModelDir) -> ModelDir:
        """The model directory at a path (a ValueError naming it where it holds no model); one already
        read is returned as it is."""
        if isinstance(directory, ModelDir):
            return directory
        directory = Path(directory)
        config, tokenizer = load_model_config(directory), Tokenizer.load(directory)
        return cls(directory, config, tokenizer, load_search(directory), load_languages(directory))

    def model(self, device: str | torch.device = "cpu") -> Transformer:
        """Its model with the weights loaded, in eval mode."""
        return _with_weights(self.config, self.path, device)


def check_export_out(model_dir: Path, out: Path, force: bool) -> None:
    """An export's OUT may replace (with force) only an earlier export (holding EXPORT_CONFIG) or an empty
    directory, never the model directory it reads nor one holding it."""
    if out.exists() and (
        out.resolve() == model_dir.resolve() or out.resolve() in model_dir.resolve().parents
    ):
        raise ValueError(f"{out}: the export cannot replace the model directory it reads, or one holding it")
    check_replaceable(out, force)
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / EXPORT_CONFIG).is_file())):
        raise ValueError(f"{out}: --force replaces only an earlier export (with {EXPORT_CONFIG}), not this")


# --- Training checkpoints -------------------------------------------------------------------------


def save_checkpoint(
    out: str | Path,
    step: int,
    model: Transformer,
    tokenizer: Tokenizer,
    train_config: TrainConfig,
    state: dict[str, Any],
    languages: Languages | None = None,
) -> Path:
    """Write OUT/checkpoints/step_N as a complete directory, made under a temporary name and renamed."""
    root = Path(out) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    # the same step may be saved again (e.g. an interrupt right after a validation): replaced whole
    with staged_dir(final) as tmp:
        save_model(tmp, model, tokenizer, train_config.search, languages)
        atomic_write(tmp / TRAIN_CONFIG, lambda p: save_json(train_config, p))
        atomic_write(tmp / STATE, lambda p: torch.save(state, p))
    return final


def list_checkpoints(out: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories of an interrupted save are ignored)."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))


def step_of(checkpoint: Path) -> int:
    """The update a checkpoint directory (step_N) was saved at."""
    return int(checkpoint.name.removeprefix("step_"))


def checkpoint_path(out: str | Path, step: int) -> Path:
    return Path(out) / CHECKPOINTS / f"step_{step:08d}"


def prune_checkpoints(out: str | Path, keep_last: int, keep: Sequence[Path] = ()) -> None:
    """Delete all but the newest `keep_last` checkpoints, and never those in `keep`."""
    protected = {path.resolve() for path in keep}
    for path in list_checkpoints(out)[:-keep_last]:
        if path.resolve() not in protected:
            shutil.rmtree(path)


# The ways torch.load reports a damaged file (zip, pickle or tensor data), found by corrupting state files.
_DAMAGED = (
    RuntimeError, OSError, EOFError, ValueError, IndexError, KeyError, TypeError, AttributeError,
    pickle.UnpicklingError, zipfile.BadZipFile, struct.error,
)  # fmt: skip


def load_state(directory: str | Path) -> dict[str, Any]:
    """Training state; weights_only=True so the file cannot execute code."""
    path = Path(directory) / STATE
    if not path.is_file():
        raise ValueError(f"{path}: no training state here (not a training checkpoint)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except _DAMAGED as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""  # torch's can run to a page
        raise ValueError(f"{path}: cannot read training state ({type(e).__name__}: {first})") from None
    parts = {"optimizer": dict, "progress": dict, "rng": dict}
    if not isinstance(state, dict) or any(not isinstance(state.get(k), t) for k, t in parts.items()):
        raise ValueError(f"{path}: not a training state (expected {sorted(parts)})")
    return state


# --- §6.1 Averaging -------------------------------------------------------------------------------


def average_checkpoints(directories: list[Path]) -> dict[str, torch.Tensor]:
    """§6.1: the element-wise mean of the parameters of several checkpoints of one model."""
    if not directories:
        raise ValueError("no checkpoints to average")
    models = [ModelDir.read(d) for d in directories]
    if len({m.config for m in models}) > 1:
        raise ValueError(f"checkpoints {[str(d) for d in directories]} have different configs")
    tokenizers = {tuple(sorted(m.tokenizer.files().items())) for m in models}
    if len(tokenizers) > 1 or len({m.languages for m in models}) > 1:
        raise ValueError(
            f"checkpoints {[str(d) for d in directories]} have different tokenizers or languages: they are "
            "not one run"
        )
    total: dict[str, torch.Tensor] = {}
    first = directories[0]
    for d in directories:
        tensors = read_weights(d / WEIGHTS)
        if total and {n: t.shape for n, t in tensors.items()} != {n: t.shape for n, t in total.items()}:
            raise ValueError(f"{d / WEIGHTS}: its tensors differ in names or shapes from {first / WEIGHTS}")
        for name, tensor in tensors.items():
            total[name] = total.get(name, 0) + tensor.double()
    return {name: (t / len(directories)).float() for name, t in total.items()}


def average(out: str | Path, last: int, dest: str | Path, force: bool = False) -> Path:
    """Average the last N checkpoints of a training directory into a new model directory DEST."""
    out, dest = Path(out), Path(dest)
    if not out.is_dir():
        raise ValueError(f"{out}: not a directory (a run directory that `aiayn train --out` wrote)")
    if last < 1:  # checkpoints[-0:] would be all of them
        raise ValueError(f"the number of checkpoints to average must be at least 1, got {last}")
    checkpoints = list_checkpoints(out)
    if len(checkpoints) < last:
        raise ValueError(f"{out}: asked to average the last {last} checkpoints, found {len(checkpoints)}")
    if dest.exists():
        inside = dest.resolve() == out.resolve() or out.resolve() in dest.resolve().parents
        if inside:
            raise ValueError(
                f"{dest}: the average cannot be written into the run it reads ({out} holds the run's best "
                "model and its checkpoints); choose a new directory"
            )
        check_replaceable(dest, force)
    chosen = checkpoints[-last:]
    last_one = ModelDir.read(chosen[-1])
    save_model(dest, averaged_model(chosen), last_one.tokenizer, last_one.search, last_one.languages)
    return dest


def averaged_model(directories: list[Path]) -> Transformer:
    """§6.1: the model whose parameters are the mean of those of several checkpoints of one run."""
    tensors = average_checkpoints(directories)  # (which checks that they are one model)
    model = Transformer(ModelDir.read(directories[0]).config)
    load_state_dict_tied(model, tensors)
    return model.eval()


def load_state_dict_tied(model: Transformer, tensors: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and not set(missing) & set(weights_dict(model)), (missing, unexpected)
