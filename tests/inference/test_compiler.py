"""The rule compiled graphs choose each matrix product's kernel by (compiler.py). (That compiled graphs
follow it, time nothing and print nothing: test_compiled_store.py.)"""

import os
import subprocess
import sys

import pytest

from aiayn.inference import compiler
from aiayn.inference.compiled import shared_class
from aiayn.inference.compiler import choose, template_rows


@pytest.mark.parametrize(
    ("kind", "rows", "chosen"),
    [
        ("fp32", 1, "template"),
        ("fp32", template_rows()["fp32"] - 1, "template"),
        ("fp32", template_rows()["fp32"], "library"),
        ("woq", template_rows()["woq"] - 1, "template"),
        ("woq", template_rows()["woq"], "library"),
    ],
)
def test_the_rule_keeps_one_candidate_by_the_rows(kind, rows, chosen):
    """choose(): of a product's candidates, inductor's template below TEMPLATE_ROWS rows of its kind (fp32,
    or int8 weights: _weight_int8pack_mm) and the library's call from there; a product with one kind of
    candidate keeps them all."""
    from torch._inductor.select_algorithm import ExternKernelCaller  # first: it imports the one below

    from torch._inductor.codegen.cpp_template_kernel import CppTemplateCaller  # isort: skip

    class Layout:
        size = [rows, 64]

    template = object.__new__(CppTemplateCaller)
    library = object.__new__(ExternKernelCaller)
    name = "_weight_int8pack_mm" if kind == "woq" else "_linear_pointwise"
    for choice, called in ((template, "cpp_CppMicroGemmFP32Vec_0"), (library, name)):
        choice.layout, choice.name = Layout(), called
    assert choose([library, template]) == [template if chosen == "template" else library]
    assert choose([library]) == [library]


@pytest.mark.parametrize(
    ("cpu", "kind", "per_sentence", "few"),
    [
        # a memory is traced for 4 x 16 and 32 x 16 rows: the library's kernel and the many rows' int8
        # route in both, on either class of CPU
        ("vnni", "memory", 1, "any"),
        ("avx2", "memory", 1, "any"),
        # greedy's step, 4 and 32 rows: inductor's kernel (and the few rows' int8 route) against the library's
        ("vnni", "step", 1, "few"),
        ("avx2", "step", 1, "few"),
        # a beam of 4, 16 and 128 rows: the library's from 16 rows on with VNNI, from 64 (fp32) without
        ("vnni", "step", 4, "any"),
        ("avx2", "step", 4, "few"),
        ("vnni", "step", 5, "any"),
        ("avx2", "step", 5, "few"),
    ],
)
def test_the_few_and_the_many_share_a_graph_where_every_choice_by_rows_is_the_same(
    monkeypatch, cpu, kind, per_sentence, few
):
    """compiled.shared_class: a stored graph for two or more sentences ("any") where the few and the many
    classes, traced for 4 and 32 sentences, would choose every kernel (TEMPLATE_ROWS of the CPU's class)
    and int8 route (precision.row_class: few below 16 rows) alike; else each class its own. One sentence
    is always a class of its own."""
    monkeypatch.setattr(compiler, "kernels", lambda: cpu)
    assert shared_class(kind, "few", per_sentence) == few
    assert shared_class(kind, "many", per_sentence) == ("any" if few == "any" else "many")
    assert shared_class(kind, "one", per_sentence) == "one"


def test_the_compiler_is_asked_for_the_instruction_sets_instead_of_inductors_probes(tmp_path, monkeypatch):
    """Inductor's probe of an instruction set (a build of ATen's vector headers with the set's flags, and a
    load) costs a first compile seconds a set. What it can find wrong beside PyTorch's own check of the
    CPU is a compiler that does not take the flags, so the compiler is asked that alone: where it takes
    them, inductor is told around a compile that its probes hold; where it does not (an old g++ that knows
    no such flags), they run as before. (A compile's probes: test_compiled_store's two processes.)"""
    from torch._inductor import config

    monkeypatch.setattr(compiler, "_isas_hold", None)
    with compiler._isas_by_flags():
        assert config.cpp.vec_isa_ok is (True if compiler._candidate_isas() else None)
    assert config.cpp.vec_isa_ok is None  # only around a compile
    old = tmp_path / "g++"
    old.write_text(
        '#!/bin/sh\nfor a; do case "$a" in -m*) echo "g++: error: unrecognized command-line option $a" >&2; '
        'exit 1;; esac; done\nexec g++ "$@"\n'
    )
    old.chmod(0o755)
    monkeypatch.setattr(compiler, "_isas_hold", None)
    with config.patch({"cpp.cxx": (str(old),)}), compiler._isas_by_flags():
        assert config.cpp.vec_isa_ok is None


CACHED = """
import torch
from aiayn.config import preset
from aiayn.inference.compiled import CompiledDecoder
from aiayn.inference.search import greedy_candidates
from aiayn.model import Transformer

torch.manual_seed(0)
decoder = CompiledDecoder(Transformer(preset("tiny", vocab_size=60)).eval(), max_autotune=False)
for rows in (5, 3):  # the sentences a dynamic size of the graph
    logits, log_prob = torch.randn(rows, 60) * 3, torch.randn(rows)
    limit, length = torch.full((rows,), 20), torch.tensor([3])
    with torch.inference_mode():
        want = greedy_candidates(logits, log_prob, limit, length)
        got = decoder.greedy_candidates(logits, log_prob, limit, length)
    assert torch.equal(got.token, want.token), (got.token, want.token)
    assert torch.allclose(got.log_prob, want.log_prob, atol=1e-5), (got.log_prob, want.log_prob)
print(torch.backends.cpu.get_cpu_capability())
"""


def test_a_graph_cached_for_other_vector_instructions_is_not_served(tmp_path):
    """Inductor's cache of compiled graphs, shared by a process of the CPU's own kernels and then one capped
    at AVX2 (ATEN_CPU_CAPABILITY=avx2): the capped one compiles its own graph and gets eager's numbers. (On
    a CPU with AVX-512, served the first one's graph, it built that graph's AVX-512 kernel source with
    AVX2's vectors of half the width: other tokens, other log-probabilities.)"""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    capabilities = []
    for cap in ({}, {"ATEN_CPU_CAPABILITY": "avx2"}):
        out = subprocess.run(
            [sys.executable, "-c", CACHED], env={**env, **cap}, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr[-2000:]
        capabilities.append(out.stdout.split()[-1])
    assert capabilities[1] == "AVX2"
