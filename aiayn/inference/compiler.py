"""How aiayn's graphs are compiled on a CPU (compiled.py compiles every graph inside `compiling()`): each
matrix product's kernel chosen by rule instead of timed, a package's two C++ builds at once, and a quiet
console.

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
import os
import shlex
import subprocess
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from math import prod
from types import MappingProxyType
from typing import Any

import sympy
import torch

from aiayn.precision import cpu_class, rows_traced

# Inductor's own C++ kernel for a matrix product of fewer rows than this, the library's from it: per CPU
# class (precision.cpu_class) and kind of product, "fp32" (oneDNN's or MKL's prepacked linear) or "woq"
# (int8 weights, _weight_int8pack_mm: precision.Int8Linear's weight-only route; its integer route has
# no template, nothing to choose). From inductor's own timings (above), where the library starts to win.
TEMPLATE_ROWS = MappingProxyType(
    {
        "vnni": MappingProxyType({"fp32": 16, "woq": 8}),
        "avx2": MappingProxyType({"fp32": 64, "woq": 16}),
    }
)


def template_rows() -> Mapping[str, int]:
    """This process's CPU class's row of TEMPLATE_ROWS."""
    return TEMPLATE_ROWS[cpu_class()]


def may_choose_template(rows: int | None) -> bool:
    """Whether a graph whose products have this many rows runs any of them in inductor's own kernel."""
    return rows is not None and rows < max(template_rows().values())


@contextlib.contextmanager
def compiling(builds_at_once: bool = True) -> Iterator[None]:
    """Around a graph's compile: kernels by rule, the two builds of a package at once (unless the cores
    are shared with other compiling processes), and nothing on the console that a user cannot act on
    (errors still raise)."""
    with _kernels_by_rule(), _builds_at_once() if builds_at_once else contextlib.nullcontext(), _quiet():
        yield


def choose(choices: list[Any]) -> list[Any]:
    """Inductor's candidate kernels of one matrix product -> the one TEMPLATE_ROWS names for its rows (a
    product with only one kind of candidate keeps them: there is nothing to choose). Rows that are a
    dynamic size count as the rows the graph is traced for (precision.traced_rows), or as many."""
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


@contextlib.contextmanager
def _builds_at_once() -> Iterator[None]:
    """An AOTInductor package is two C++ files built one after the other, the wrapper (the graph's calls)
    and the kernels, then linked: the wrapper's build is started in the background and the kernels' runs
    beside it, on the other core, the link waiting for both. (Where inductor builds otherwise, as for an
    autotuning candidate, nothing changes.)"""
    from torch._inductor import cpp_builder

    run = cpp_builder.run_compile_cmd
    pending: list[tuple[subprocess.Popen, str, Any]] = []

    def finish() -> None:
        while pending:
            process, command, log = pending.pop()
            with log:
                if process.wait():  # built again as inductor would, which raises its error with the output
                    log.seek(0)
                    raise cpp_builder.exc.CppCompileError(
                        shlex.split(command), log.read().decode(errors="replace")
                    )

    def run_compile_cmd(cmd_line: str, cwd: str) -> None:
        if " -c " in f" {cmd_line} " and ".wrapper.cpp " in cmd_line and (os.cpu_count() or 1) > 1:
            log = tempfile.TemporaryFile()
            # started here, in the build's directory, which the builder removes once this returns
            pending.append(
                (
                    subprocess.Popen(shlex.split(cmd_line), cwd=cwd, stdout=log, stderr=subprocess.STDOUT),
                    cmd_line,
                    log,
                )
            )
            return
        if " -shared" in f" {cmd_line} ":
            finish()
        run(cmd_line, cwd)

    cpp_builder.run_compile_cmd = run_compile_cmd
    try:
        yield
        finish()
    finally:
        for process, _, log in pending:  # an error on the way: nothing left running
            process.kill()
            process.wait()
            log.close()
        cpp_builder.run_compile_cmd = run
