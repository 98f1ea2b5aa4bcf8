"""How graphs are compiled on a CPU (compiler.py): each matrix product's kernel by rule, none timed in any
process, and nothing of the compiler's on the console. (That the graphs give eager's tokens:
test_compiled.py and test_compiled_store.py.)"""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import eos_heavy_model, sources
from torch._dynamo.utils import counters

from aiayn.inference.compiled import CompiledDecoder
from aiayn.inference.compiler import choose, template_rows
from aiayn.tokenizer import BOS_ID


def compile_one_graph(decoder: CompiledDecoder, name: str, sentences: int) -> None:
    """decoder's graph `name` ("memory" or the greedy "step") of a batch of `sentences` sentences, compiled
    alone: the memory a step needs runs eagerly (CompiledDecoder.compiles)."""
    decoder.compiles = lambda index: list(decoder.met)[index][0] == name
    with torch.inference_mode():
        memory = decoder.encode(sources(sentences, 9, seed=sentences))
        if name == "step":
            cache = decoder.new_cache(memory, 4)
            decoder.decode(torch.full((sentences, 1), BOS_ID), None, cache)


def package_code(path) -> str:
    """The C++ of a package: its kernels and the wrapper that calls them and the library."""
    with zipfile.ZipFile(path) as archive:
        return "".join(archive.read(n).decode() for n in archive.namelist() if n.endswith(".cpp"))


# Another process compiling the step of a few sentences with inductor's default options: how many choices
# it timed (inductor's own count).
COMPILE_IN_A_PROCESS = """
import json, sys
import torch
from torch._dynamo.utils import counters
torch._inductor.config.autotune_local_cache = False
sys.path[:0] = sys.argv[2:]
from conftest import eos_heavy_model
from test_compiler import compile_one_graph
from aiayn.inference.compiled import CompiledDecoder
compile_one_graph(CompiledDecoder(eos_heavy_model(), store=sys.argv[1]), "step", 3)
print(json.dumps({"timed": counters["inductor"]["select_algorithm_autotune"]}))
"""


def test_each_product_takes_the_kernel_of_its_rows_and_none_is_timed(tmp_path, capfd):
    """max_autotune (the default on a CPU) chooses between inductor's own GEMM kernel and the library's
    (oneDNN's linear) for every matrix product: here by rule, timing none, in this process and in another
    (so no decision is made twice anywhere). One sentence's step runs inductor's kernels, fewer rows than
    TEMPLATE_ROWS; a batch's memory, B x S rows, the library's. Nothing of inductor's autotuning or its
    warnings reaches the console."""
    assert 1 < template_rows()["fp32"] <= 64
    model = eos_heavy_model()
    counters.clear()
    with torch._inductor.config.patch(autotune_local_cache=False):  # no timing found in inductor's cache
        compile_one_graph(CompiledDecoder(model, store=tmp_path), "step", 1)  # default options: max_autotune
        compile_one_graph(CompiledDecoder(model, store=tmp_path), "memory", 2)
    assert counters["inductor"]["select_algorithm_autotune"] == 0
    one = package_code(next(tmp_path.glob("step-one-*.pt2")))
    assert "micro_gemm" in one and "_linear_pointwise" not in one  # inductor's kernels, inlined
    batch = package_code(next(tmp_path.glob("memory-few-*.pt2")))
    assert "_linear_pointwise" in batch and "micro_gemm" not in batch  # oneDNN's calls
    err = capfd.readouterr().err
    assert "AUTOTUNE" not in err and "Warning" not in err, err
    here = Path(__file__).parent
    argv = [sys.executable, "-c", COMPILE_IN_A_PROCESS, str(tmp_path), str(here.parent), str(here)]
    other = subprocess.run(argv, capture_output=True, text=True, check=True)
    assert json.loads(other.stdout.splitlines()[-1]) == {"timed": 0}
    assert "AUTOTUNE" not in other.stderr and "Warning" not in other.stderr, other.stderr


@pytest.mark.parametrize(
    ("rows", "kind"),
    [(1, "template"), (template_rows()["fp32"] - 1, "template"), (template_rows()["fp32"], "library")],
)
def test_the_rule_keeps_one_candidate_by_the_rows(rows, kind, monkeypatch):
    """choose(): of a product's candidates, inductor's template below TEMPLATE_ROWS rows and the library's
    call from there; a product with one kind of candidate keeps them all."""
    from torch._inductor.codegen.cpp_template_kernel import CppTemplateCaller
    from torch._inductor.select_algorithm import ExternKernelCaller

    class Layout:
        size = [rows, 64]

    template = object.__new__(CppTemplateCaller)
    library = object.__new__(ExternKernelCaller)
    for choice, name in ((template, "cpp_CppMicroGemmFP32Vec_0"), (library, "_linear_pointwise")):
        choice.layout, choice.name = Layout(), name
    assert choose([library, template]) == [template if kind == "template" else library]
    assert choose([library]) == [library]
