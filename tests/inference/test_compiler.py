"""The rule compiled graphs choose each matrix product's kernel by (compiler.py). (That compiled graphs
follow it, time nothing and print nothing: test_compiled_store.py.)"""

import pytest

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
