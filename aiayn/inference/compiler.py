"""How aiayn's graphs are compiled on a CPU (compiled.py compiles every graph inside `compiling()`): each
matrix product's kernel chosen by rule instead of timed, the C++ that every package's wrapper shares built
once, a package's C++ builds at once, what a process's first compile needs before its graph built ahead of
time (prepare), and a quiet console.

Inductor's max_autotune times, for every matrix product of a graph, its own C++ kernel (a template
instantiated for the product's shapes) against the library's call (oneDNN, with the weight prepacked)
and keeps the faster; each timing costs a g++ build of the template, and a graph of `small` has a dozen
products: about half of what compiling a graph cost, paid again for every number of rows. Which kernel
wins follows the rows, on every CPU measured (inductor's own timings of every product of the decoding
graphs, `small` and `base`, fp32 and int8, 1 to 128 rows, natively and capped at AVX2): at a few rows
the library's fixed cost per call outweighs the arithmetic and inductor's kernel, inlined into the
graph, is several times faster; at many rows the library's blocking wins. So the kernel is chosen by
the rows, TEMPLATE_ROWS, and nothing is timed: no decision is made twice, in any graph or
process, because none is made at all.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import shlex
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from math import prod
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from aiayn.precision import kernels, rows_traced

# Inductor's own C++ kernel for a matrix product of fewer rows than this, the library's from it: per
# CPU class's kernels (precision.kernels) and kind of product, "fp32" (oneDNN's or MKL's prepacked
# linear) or "woq" (int8 weights, _weight_int8pack_mm: precision.Int8Linear's weight-only route; its
# integer route has no template, nothing to choose). From inductor's own timings (above), where the
# library starts to win.
TEMPLATE_ROWS = MappingProxyType(
    {
        "vnni": MappingProxyType({"fp32": 16, "woq": 8}),
        "avx2": MappingProxyType({"fp32": 64, "woq": 16}),
    }
)


def template_rows() -> Mapping[str, int]:
    """This process's CPU class's row of TEMPLATE_ROWS."""
    return TEMPLATE_ROWS[kernels()]


def may_choose_template(rows: int | None) -> bool:
    """Whether a graph whose products have this many rows runs any of them in inductor's own kernel."""
    return rows is not None and rows < max(template_rows().values())


@contextlib.contextmanager
def compiling(builds_at_once: bool = True) -> Iterator[None]:
    """Around a graph's compile: kernels by rule, a package's wrapper built without the part every wrapper
    shares, its two builds at once (unless the cores are shared with other compiling processes), and
    nothing on the console that a user cannot act on (errors still raise)."""
    with _kernels_by_rule(), _builds(builds_at_once), _quiet(), _isas_by_flags(), _cache_keyed_by_isa():
        yield


def choose(choices: list[Any]) -> list[Any]:
    """Inductor's candidate kernels of one matrix product -> the one TEMPLATE_ROWS names for its rows (a
    product with only one kind of candidate keeps them: there is nothing to choose). Rows that are a
    dynamic size count as the rows the graph is traced for (precision.traced_rows), or as many."""
    import sympy  # here, not at the top: a translation that compiles nothing never imports it (slow)
    from torch._inductor.select_algorithm import ExternKernelCaller

    # the library's calls, and inductor's own kernels: C++ templates on a CPU (some wrapped in a caller
    # that prepares their inputs)
    library = [c for c in choices if isinstance(c, ExternKernelCaller)]
    templates = [c for c in choices if not isinstance(c, ExternKernelCaller) and c.name.startswith("cpp_")]
    if not templates or not library:
        return choices
    size = choices[0].layout.size[:-1]  # (M, N) or (..., N): the rows M
    if all(isinstance(s, (int, sympy.Integer)) for s in size):
        rows: int | None = prod(int(s) for s in size)
    else:
        rows = rows_traced()
    kind = "woq" if "int8pack" in library[0].name else "fp32"
    return templates[:1] if rows is not None and rows < template_rows()[kind] else library[:1]


@contextlib.contextmanager
def _kernels_by_rule() -> Iterator[None]:
    """choose() as a preprocessing step of inductor's kernel selection: one candidate left, none timed."""
    from torch._inductor.select_algorithm import get_algorithm_selector_cache

    selector = get_algorithm_selector_cache()
    selector.add_preprocessing_fn(choose)
    try:
        yield
    finally:
        selector.preprocessing_fns.remove(choose)


_prepared: threading.Thread | None = None


def prepare(device: torch.device) -> None:
    """Start, in the background, what a process's first package otherwise builds one piece after another
    before anything of its graph: inductor's probes of the CPU's vector instructions (each a build and a
    load, one after another when inductor first picks an instruction set) and its two precompiled headers
    (the wrapper's and the kernels', one after the other). Here the probes run at once, then the headers
    at once, beside the tracing and lowering that come first. Both are inductor's own calls, cached on disk
    under its locks, so a compile that reaches them first waits for the same files instead of building
    them twice; once they are cached this costs a few loads. Once a process; call it where a process is
    about to compile packages for device (nothing for a GPU's)."""
    global _prepared
    if _prepared is None and device.type == "cpu":
        # dynamo and inductor imported here first, in the caller's thread: the thread below imports inductor
        # while the caller goes on into dynamo, which imports inductor too, and the second of two threads
        # importing one package at once gets it half initialised (an ImportError of a circular import)
        import torch._dynamo
        import torch._inductor.utils  # noqa: F401

        _prepared = threading.Thread(target=_prepare, name="aiayn-prepare-compiler", daemon=True)
        _prepared.start()


def _prepare() -> None:
    with contextlib.suppress(Exception), _isas_by_flags():  # only ahead: the compile says what fails
        _parallel([lambda isa=isa: bool(isa) for isa in _candidate_isas()])
        _parallel([lambda header=h: _precompiled_header(header) for h in ("wrapper", "kernel")])


def _parallel(calls: list[Callable[[], Any]]) -> None:
    """calls, each in a thread of its own with the caller's settings of inductor (context variables, which
    a new thread would not have), until all have returned (an error is left for the compile)."""

    def quietly(call: Callable[[], Any]) -> None:
        with contextlib.suppress(Exception):
            call()

    threads = [
        threading.Thread(target=contextvars.copy_context().run, args=(quietly, call), daemon=True)
        for call in calls
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _candidate_isas() -> list[Any]:
    """The instruction sets inductor's valid_vec_isa_list probes on this CPU (those its flags name)."""
    from torch._inductor import cpu_vec_isa

    flags = cpu_vec_isa.x86_isa_checker()
    return [
        isa
        for isa in cpu_vec_isa.supported_vec_isa_list
        if str(isa) and all(f in flags for f in str(isa).split())
    ]


_isas_hold: bool | None = None  # _isas_by_flags's answer, once a process
_isas_lock = threading.Lock()


@contextlib.contextmanager
def _isas_by_flags() -> Iterator[None]:
    """Inductor takes an instruction set the CPU's flags name once a probe has built a file of ATen's vector
    headers with the set's compiler flags and loaded it in a child process: seconds a set, three sets on
    a CPU with AVX-512, before a process's first graph can build anything (at once on a small machine's
    first compile, a few loads once cached; benchmarks/bench_serve.py --cold-start). What a probe can find
    wrong there is a compiler that does not take the flags: the sets are those PyTorch's own CPU check
    names (x86_isa_checker), which asks the processor and whether the system enabled them. So the
    compiler is asked that alone, of an empty file with every candidate set's flags (milliseconds), once
    a process, and where it takes them inductor is told here that its probes hold (config.cpp.vec_isa_ok,
    a setting of the thread, as all of inductor's); where not, or where the setting is set already,
    inductor probes as before."""
    global _isas_hold
    from torch._inductor import config
    from torch._inductor.cpp_builder import get_cpp_compiler

    with _isas_lock:
        if _isas_hold is None:
            _isas_hold = False
            with contextlib.suppress(Exception):  # no answer: inductor's own probes decide
                isas = _candidate_isas()
                flags = [flag for isa in isas for flag in shlex.split(isa.build_arch_flags())]
                command = [get_cpp_compiler(), *flags, "-x", "c++", "-fsyntax-only", "-"]
                built = subprocess.run(command, input=b"", capture_output=True, timeout=60)
                _isas_hold = bool(isas) and built.returncode == 0
    if _isas_hold and config.cpp.vec_isa_ok is None:
        with config.patch({"cpp.vec_isa_ok": True}):
            yield
    else:
        yield


@contextlib.contextmanager
def _cache_keyed_by_isa() -> Iterator[None]:
    """Inductor's cache of compiled graphs keys a graph by its code and inductor's settings, not by the
    vector instructions its kernels were written for (torch 2.13): a graph compiled where ATen's kernels
    are AVX-512 was served to a process capped at AVX2 (ATEN_CPU_CAPABILITY=avx2), whose build of the
    same kernel source has vectors of half the width, and decoded other tokens than eager. Naming the
    vector width inductor picks as its setting (cpp.simdlen, which picks that same instruction set)
    puts it in the key."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa() if config.cpp.simdlen is None else None
    if not isa:  # no vector instructions (or a width already set): nothing to key
        yield
        return
    with config.patch({"cpp.simdlen": isa.bit_width()}):
        yield


def _precompiled_header(which: str) -> str:
    """Inductor's precompiled header of an AOTInductor package's wrapper or kernels, as
    AotCodeCompiler.compile asks for it on a CPU (the same header, command line and options: the same
    file; a test compares them with a real compile's)."""
    from torch._inductor import codecache
    from torch._inductor.config import aot_inductor
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    options = CppTorchDeviceOptions(vec_isa=isa, device_type="cpu", aot_mode=True)
    command_line = repr(CppBuilder(name="o", sources="i", BuildOption=options).get_command_line())
    command = {"aot_mode": True, "device_type": "cpu", "use_mmap_weights": False,
               "use_mmap_weights_external": False, "use_relative_path": False, "vec_isa": isa}  # fmt: skip
    if which == "wrapper":
        header = codecache._get_cpp_wrapper_header("cpu", aot_mode=True)
        return codecache._precompile_header(
            header, command_line, min_optimize=not aot_inductor.package_cpp_only, **command
        )
    return codecache._precompile_header(codecache._get_cpp_prefix_header("cpu"), command_line, **command)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No autotuning tables (there should be none to print) and no deprecation warnings from inside the
    compiler (a TypedStorage one from inductor's own code)."""
    with (
        torch._inductor.config.patch(
            autotune_num_choices_displayed=0, max_autotune_report_choices_stats=False
        ),
        warnings.catch_warnings(),
    ):
        warnings.filterwarnings("ignore", category=UserWarning, message=".*TypedStorage is deprecated")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


# The part of every AOTInductor wrapper that is the same whatever the graph: the runtime's C interface and
# its model container, and the model base class that the graph's own part instantiated (a std::regex
# parsing the device among it, most of what that part compiled). Built once into an object of the
# inductor cache and linked into every package since, each wrapper compiling its graph's part alone:
# g++'s fixed cost a package was most of a small graph's build.
_INTERFACE_BEGIN = "// Definition of AOTI runtime interface functions"
_INTERFACE_END = '\n} // extern "C"\n'
_MODEL_BASE = "torch::aot_inductor::AOTInductorModelBase<torch::aot_inductor::AOTInductorModel>"


def _split_wrapper(source: str) -> tuple[str, str] | None:
    """An AOTInductor wrapper's C++ -> (its shared part, with the model base instantiated; its graph's part,
    told the base is instantiated elsewhere), or None where the wrapper is not laid out as expected."""
    begin = source.find(_INTERFACE_BEGIN)
    end = source.find(_INTERFACE_END, begin)
    if begin < 0 or end < 0 or "AOTInductorModel::run_impl" not in source:
        return None
    end += len(_INTERFACE_END)
    includes = "".join(line + "\n" for line in source[begin:end].splitlines() if line.startswith("#include "))
    shared = f"{source[:end]}\ntemplate class {_MODEL_BASE};\n"
    graph = f"{source[:begin]}{includes}extern template class {_MODEL_BASE};\n{source[end:]}"
    return shared, graph


@contextlib.contextmanager
def _builds(at_once: bool) -> Iterator[None]:
    """An AOTInductor package is two C++ files built one after the other, the wrapper (the graph's calls)
    and the kernels, then linked. The wrapper's part that is the same for every graph is built once, into
    the inductor cache (_split_wrapper), and linked into every package; the rest of the wrapper is built
    alone. With at_once, the wrapper's builds are started in the background (the shared part's beside the
    graph's, where the cache does not have it yet) and the kernels' runs beside them, the link waiting for
    all. (Where inductor builds otherwise, as for an autotuning candidate, nothing changes.)"""
    from torch._inductor import cpp_builder
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    run = cpp_builder.run_compile_cmd
    at_once = at_once and (os.cpu_count() or 1) > 1
    # builds started and not yet waited for: (process, command, log, what to do once it has built, what to
    # do instead of raising if it fails)
    pending: list[tuple[subprocess.Popen, str, Any, Callable[[], None], Callable[[], None] | None]] = []
    # a split wrapper's object -> the shared object its link adds, and how to build the whole wrapper instead
    split: dict[str, tuple[str, Callable[[], None]]] = {}
    scratch: list[Path] = []  # a shared part's files being built, removed whatever happens

    def start(cmd_line: str, cwd: str | None, built: Callable[[], None] = lambda: None,
              failed: Callable[[], None] | None = None) -> None:  # fmt: skip
        log = tempfile.TemporaryFile()
        process = subprocess.Popen(shlex.split(cmd_line), cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        pending.append((process, cmd_line, log, built, failed))

    def finish() -> None:
        """Wait for every build started, then settle each in the order started (a fallback rebuilds a file
        that no build is writing any more)."""
        started = list(pending)
        codes = [process.wait() for process, *_ in started]
        pending.clear()
        try:
            for code, (_, command, log, built, failed) in zip(codes, started):
                if not code:
                    built()
                elif failed is not None:  # a part of a split wrapper did not build: the whole one instead
                    failed()
                else:
                    log.seek(0)  # raised as inductor would, with the compiler's output
                    raise cpp_builder.exc.CppCompileError(
                        shlex.split(command), log.read().decode(errors="replace")
                    )
        finally:
            for _, _, log, _, _ in started:
                log.close()

    def build_wrapper(cmd_line: str, cwd: str) -> None:
        words = shlex.split(cmd_line)
        named = next(word for word in words if word.endswith(".wrapper.cpp"))
        source = Path(named)
        output = words[words.index("-o") + 1]
        parts = _split_wrapper(source.read_text())
        if parts is None:  # the whole wrapper, as inductor builds it
            return start(cmd_line, cwd) if at_once else run(cmd_line, cwd)
        shared_text, graph_text = parts
        # the graph's part beside inductor's file, which stays whole (inductor writes a source only if it is
        # not there: a graph compiled again finds it)
        graph = source.with_suffix(".graph.cpp")
        graph.write_text(graph_text)

        def build_whole() -> None:
            if split.pop(output, None) is not None:
                run(cmd_line, str(source.parent))

        # the shared part's object in the cache, named by a hash of its text, its flags and torch's version
        flags = cmd_line.replace(named, "").replace(output, "")
        digest = hashlib.sha256(f"{shared_text}\0{flags}\0{torch.__version__}".encode()).hexdigest()[:32]
        common = Path(cache_dir()) / "aiayn-aoti-shared" / f"{digest}.o"
        split[output] = (str(common), build_whole)
        if not common.is_file():
            common.parent.mkdir(parents=True, exist_ok=True)
            shared_source, building = (common.with_suffix(f".{os.getpid()}{ext}") for ext in (".cpp", ".o"))
            scratch.extend((shared_source, building))
            shared_source.write_text(shared_text)

            def shared_built() -> None:
                os.replace(building, common)  # whole or not there: other processes may build it at once

            command = cmd_line.replace(named, str(shared_source)).replace(output, str(building))
            start(command, cwd, shared_built, build_whole)
        start(cmd_line.replace(named, str(graph)), cwd, failed=build_whole)
        if not at_once:
            finish()

    def link(cmd_line: str, cwd: str) -> None:
        finish()
        wrappers = [w for w in split if w in cmd_line]
        if not wrappers:
            return run(cmd_line, cwd)
        try:
            linked = cmd_line
            for wrapper in wrappers:
                linked = linked.replace(wrapper, f"{wrapper} {shlex.quote(split[wrapper][0])}", 1)
            run(linked, cwd)
        except cpp_builder.exc.CppCompileError:  # linked as inductor would, the whole wrapper built
            for wrapper in wrappers:
                split[wrapper][1]()
            run(cmd_line, cwd)
        for wrapper in wrappers:
            split.pop(wrapper, None)

    def run_compile_cmd(cmd_line: str, cwd: str) -> None:
        if " -c " in f" {cmd_line} " and ".wrapper.cpp " in cmd_line:
            return build_wrapper(cmd_line, cwd)
        if " -shared" in f" {cmd_line} ":
            return link(cmd_line, cwd)
        run(cmd_line, cwd)

    cpp_builder.run_compile_cmd = run_compile_cmd
    try:
        yield
        finish()
    finally:
        for process, _, log, _, _ in pending:  # an error on the way: nothing left running
            process.kill()
            process.wait()
            log.close()
        for path in scratch:
            path.unlink(missing_ok=True)
        cpp_builder.run_compile_cmd = run
