"""The store of compiled graphs: AOTInductor packages on disk, one a graph and model, which a later
process loads instead of tracing and compiling again (compiled.py makes them).

A package's name holds its graph's key and a fingerprint of all it depends on (the weights, the code
traced, the options, PyTorch and the processor), so a store is shared by every model, version and
machine without one ever running another's package; every package is checked before it is loaded.
Loading needs neither dynamo nor inductor, whose imports cost a process seconds on a small CPU.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from aiayn.files import atomic_write
from aiayn.inference import compiler
from aiayn.inference.static_cache import TRACED_SENTENCES, TRACED_TOKENS
from aiayn.model import Transformer
from aiayn.precision import Int8Linear, cpu_flags, cpu_info

SEARCH_WORK = ("beam", "greedy")  # the graphs of a search's own work, which read no weights
GRAPH = "aiayn.graph"  # a package's metadata: the name of the store file it was compiled for, without .pt2


# What zipfile raises reading a damaged archive: BadZipFile is its word for it, but header fields it
# trusts, damaged, raise the others (found by flipping each byte of a package's headers). Caught around
# zipfile's reading alone, where none of them can be a mistake of ours; an OSError (the disk, a
# permission) is not damage, and goes through.
ZIP_DAMAGE = (zipfile.BadZipFile, EOFError, NotImplementedError, OverflowError, RuntimeError, ValueError,
              zlib.error)  # fmt: skip


class Damaged(Exception):
    """A store file that is not a whole package of the graph its name names: compiled again."""


def load_stored(path: Path) -> Package:
    """The package at path, checked before it is trusted; Damaged, saying why, where the file is empty,
    truncated, corrupted, not a package, or a package of another graph or of other weights."""
    # Every member's CRC-32 first: PyTorch's loader checks none, and it dlopens the library it unpacks,
    # so a few flipped bytes in it crashed the process (a segfault, or ld.so's assertion) instead of
    # raising. Stored (uncompressed) members: this reads the file once, which loading does anyway.
    try:
        with zipfile.ZipFile(path) as archive:
            for member in archive.infolist():
                with archive.open(member) as data:
                    while data.read(1 << 20):
                        pass
    except ZIP_DAMAGE as error:
        raise Damaged(f"not a whole package ({error})") from None
    # A whole zip archive that is no AOTInductor package (no library for its model in it) is refused with
    # a RuntimeError, as is a library that cannot be loaded; only the loader runs in the try.
    try:
        loader = _loader(path)
    except RuntimeError as error:
        raise Damaged(f"not a package PyTorch can load ({str(error).splitlines()[0]})") from None
    # A whole package of another graph (another key, or another fingerprint's weights) loads and then runs
    # on arguments it was not compiled for: with other shapes of as many tensors, nothing checks them.
    graph = loader.get_metadata().get(GRAPH)
    if graph != path.stem:
        raise Damaged(f"a package of {graph or 'an unnamed graph'}, not of {path.stem}")
    return Package(loader)


def _loader(path: Path) -> Any:
    """PyTorch's loader of the AOTInductor package at path: what torch._inductor.aoti_load_package makes,
    without importing inductor (seconds of a process's start on a small CPU, for nothing a package runs)."""
    return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)


class Package:
    """A loaded AOTInductor package called with the graph's own arguments. Its own __call__ parses its
    input and output specifications from JSON on every call; this reads the output's once."""

    def __init__(self, loader: Any):
        self.run = loader.boxed_run
        self.out_spec = pytree.treespec_loads(loader.get_call_spec()[1])

    def __call__(self, *args: Any) -> Any:
        return pytree.tree_unflatten(self.run(tensors(args, [])), self.out_spec)


def tensors(args: tuple | list, out: list[Tensor]) -> list[Tensor]:
    """The tensors of args, nested in tuples and lists, in pytree's order (a package takes them flat; the
    other leaves are constants of the graph). Cheaper than pytree.tree_leaves, on every step's call."""
    for arg in args:
        if isinstance(arg, Tensor):
            out.append(arg)
        elif isinstance(arg, (tuple, list)):
            tensors(arg, out)
    return out


def default_store() -> Path | None:
    """Where `--compile` keeps its packages between processes: $AIAYN_COMPILE_STORE ("" or "none": nowhere,
    compile in memory in every process), else $XDG_CACHE_HOME/aiayn/compiled (~/.cache/aiayn/compiled)."""
    value = os.environ.get("AIAYN_COMPILE_STORE")
    if value is not None:
        return None if value.strip().lower() in ("", "none") else Path(value)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aiayn" / "compiled"


# The source files the graphs are traced from: a package compiled from other code (an older aiayn, or
# one edited in place) must never be loaded, whatever the weights.
TRACED_CODE = (
    "model.py",
    "precision.py",
    "inference/search.py",
    "inference/compiled.py",
    "inference/static_cache.py",
    "inference/compiler.py",
    "inference/warmup.py",  # the batches graphs are compiled with, whose sizes shape their loops
)


def fingerprint(model: Transformer, options: dict, weights: bool = True) -> str:
    """A hash of what a compiled package depends on: the weights, the modules that use them and the
    model's configuration (the number of heads, say, which no weight shows), the code traced, the compile
    options, PyTorch's version and the processor (kernels are compiled for its instructions). weights=False:
    all but the model's own (its device aside), for a graph that reads none (a search's own work)."""
    digest = hashlib.blake2b(digest_size=12)
    for name in TRACED_CODE:
        digest.update((Path(__file__).parents[1] / name).read_bytes())
    modules = []
    if weights:
        digest.update(repr(model.config).encode())
        modules = [
            (name, type(m).__name__, sorted(m.routes.items()) if isinstance(m, Int8Linear) else None)
            for name, m in model.named_modules()
        ]
    cpu = cpu_info()
    device = next(model.parameters()).device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    # (the vector instructions PyTorch and inductor use, which ATEN_CPU_CAPABILITY may cap below the CPU's)
    isa = torch.backends.cpu.get_cpu_capability()
    digest.update(repr((modules, sorted(options.items()), torch.__version__, cpu.get("model name"),
                        cpu.get("cpu family"), cpu.get("model"), sorted(cpu_flags()), isa, str(device), gpu,
                        sorted(compiler.template_rows().items()), sorted(TRACED_SENTENCES.items()), TRACED_TOKENS)).encode())  # fmt: skip
    for name, tensor in model.state_dict().items() if weights else ():
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def compile_options(model: Transformer, **options: Any) -> dict[str, Any]:
    """The inductor options CompiledDecoder(model, **options) compiles with, which its packages' names hold.

    max_autotune on the CPU: inductor's own C++ GEMM kernels are candidates beside the library's call for
    each matrix product, several times faster at a few rows; compiler.py picks one by the rows, timing
    none. On a GPU it would time Triton templates for every product of every graph, minutes per model,
    where cuBLAS is already the fast choice: off there."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    return {"max_autotune": on_cpu, **options}


def stored(model: Transformer, store: str | Path | None, **options: Any) -> bool:
    """Whether store holds graphs of this model: packages that CompiledDecoder(model, store=store,
    **options) would load (the same weights, layout, configuration, code, options, PyTorch and processor).
    Cheap where the store holds no packages at all; else the weights are hashed (fingerprint), and no
    compiler is imported."""
    if store is None or not any(Path(store).glob("*.pt2")):
        return False
    return any(Path(store).glob(f"*-{fingerprint(model, compile_options(model, **options))}.pt2"))


class GraphStore:
    """A directory of packages, as one model with its compile options (compile_options) reads and writes
    it: the name each graph's package has there, checked loads, atomic writes."""

    def __init__(self, directory: str | Path, model: Transformer, options: dict[str, Any]):
        self.directory, self.model, self.options = Path(directory), model, options
        self._fingerprints: dict[bool, str] = {}  # fingerprint()'s, with the model's weights and without

    def fingerprint(self, weights: bool = True) -> str:
        """fingerprint() of the model and options, which its packages' names hold: hashed once (a large
        model's weights take a small CPU a good part of a second)."""
        if weights not in self._fingerprints:
            self._fingerprints[weights] = fingerprint(self.model, self.options, weights)
        return self._fingerprints[weights]

    def path(self, key: tuple) -> Path:
        """Where graph key's package is: its name holds the key and the fingerprint. A search's own work
        reads no weights: its packages serve every model (the fingerprint without the model's)."""
        name = self.fingerprint(weights=key[0] not in SEARCH_WORK)
        return self.directory / f"{'-'.join(map(str, key))}-{name}.pt2"

    def load(self, key: tuple) -> Package | None:
        """Graph key's package, or None where there is none, or what is there is not a whole package of
        this graph (load_stored: a damaged store is a cache miss, said in one line on stderr)."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            return load_stored(path)
        except Damaged as damage:
            print(f"aiayn: {path}: {damage}; compiling it again", file=sys.stderr)
            return None

    def write(self, key: tuple, build: Callable[[io.BytesIO, str], None]) -> Package:
        """Graph key's package as build(archive, name) writes it into an archive in memory (name: what the
        package's metadata names, GRAPH), then into the store atomically, and loaded. PyTorch's own
        package writer, out of space, leaves its zip unfinished and aborts the process when it is
        collected; atomic: processes sharing a store never read half a file, and two compiling the same
        graph at once each rename a whole file of their own over it."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(
                f"{self.directory}: cannot keep compiled graphs there ({error.strerror}); set "
                "AIAYN_COMPILE_STORE to a writable directory, or to none to compile in memory"
            ) from error
        path = self.path(key)
        archive = io.BytesIO()
        build(archive, path.stem)
        atomic_write(path, lambda tmp: tmp.write_bytes(archive.getbuffer()))
        # (not load_stored: a package just compiled that does not load is an error, not a cache miss)
        return Package(_loader(path))
