"""The package's shape, held to what its docstring draws: imports go down the layers only, no module
keeps mutable state at module level, and the training loop stays short enough to read on one screen."""

import ast
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import aiayn
from aiayn.training import train

PACKAGE = Path(aiayn.__file__).parent


def layers() -> dict[str, int]:
    """{module or subpackage: layer} from the table in aiayn/__init__.py, bottom layer 0."""
    table = aiayn.__doc__.split("layers, bottom to top")[1]
    rows = re.findall(r"^    ((?:\w+ )*\w+)\s{2,}", table, re.MULTILINE)
    return {unit: i for i, row in enumerate(rows) for unit in row.split()}


def modules() -> dict[str, Path]:
    """{dotted name under aiayn: file} of every module of the package, subpackages' included."""
    return {
        ".".join(path.relative_to(PACKAGE).with_suffix("").parts): path
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "__init__.py"
    }


def unit(module: str) -> str:
    """The row of the table a module belongs to: its subpackage, or itself at the top."""
    return module.split(".")[0]


def imported(path: Path) -> set[str]:
    """The aiayn modules a file imports (dotted under aiayn), at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("aiayn"):
            base = node.module.split(".")[1:]  # from aiayn.inference import search: ["inference"]
            for alias in node.names:
                name = ".".join([*base, alias.name])
                found.add(name if name in modules() else ".".join(base))
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("aiayn.")}
    return {m for m in found if m}


def test_every_module_has_its_place_in_the_table():
    assert set(layers()) == {unit(m) for m in modules()}
    for name in layers():  # a subpackage says what it owns, in its docstring
        init = PACKAGE / name / "__init__.py"
        assert not init.exists() or ast.get_docstring(ast.parse(init.read_text())), name


def test_imports_only_go_down_the_layers_and_never_in_a_circle():
    layer, graph = layers(), {m: imported(path) for m, path in modules().items()}
    wrong = [
        f"{module} (layer {layer[unit(module)]}) imports {name} (layer {layer[unit(name)]})"
        for module, names in graph.items()
        for name in sorted(names)
        if unit(name) != unit(module) and layer[unit(name)] >= layer[unit(module)]
    ]
    assert not wrong
    # within a subpackage any order is allowed, but no circle (a module imports a subpackage's
    # __init__, which imports nothing, when it names only the subpackage)
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"an import circle: {' -> '.join((*path, module))}"
        if module in done:
            return
        for name in graph.get(module, ()):
            visit(name, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())


def test_the_layer_check_catches_an_upward_import(tmp_path):
    """The test above has teeth: a model that imported train would be reported."""
    path = tmp_path / "model.py"
    path.write_text("def f():\n    from aiayn.training.train import train\n")
    assert imported(path) == {"training.train"} and layers()["training"] > layers()["model"]


def test_no_module_keeps_mutable_state():
    """Module-level lists, dicts and sets are shared by every caller in the process (a server's
    threads, two runs): tables are read-only mappings or tuples, and state lives in objects."""
    mutable = []
    for name in modules():
        if name == "__main__":
            continue
        module = importlib.import_module(f"aiayn.{name}")
        for key, value in vars(module).items():
            if not key.startswith("__") and isinstance(value, (list, dict, set, bytearray)):
                mutable.append(f"aiayn.{name}.{key}")
    assert not mutable


def test_the_training_loop_reads_on_one_screen():
    lines = inspect.getsource(train.train).splitlines()
    assert len(lines) <= 65, len(lines)


# What importing a module must leave as it was: only entry points change the process.
SNAPSHOT = """
import importlib, json, os, sys
import matplotlib, torch
def snapshot():
    return {
        "environment": dict(os.environ),
        "matplotlib backend": str(dict.__getitem__(matplotlib.rcParams, "backend")),
        "torch threads": torch.get_num_threads(),
        "TF32": (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32),
        "float32 matmul precision": torch.get_float32_matmul_precision(),
        "dynamo config": (torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit),
        "inductor config": (torch._inductor.config.freezing, torch._inductor.config.max_autotune),
    }
snapshot()  # reading the compilers' settings imports them, and inductor then names its cache in os.environ
changed = {}
for name in sys.argv[1:]:
    before = snapshot()
    importlib.import_module(f"aiayn.{name}")
    after = snapshot()
    changed.update({name: sorted(k for k in before if before[k] != after[k])} if before != after else {})
print(json.dumps(changed))
"""


def test_importing_a_module_changes_nothing_in_the_process():
    """Each module imported in a fresh process, bottom layer first (so a change shows at the module that
    makes it): the environment, matplotlib's backend, torch's threads, TF32 and the compilers' settings
    stay as they were. One exception, on purpose: Keras reads its backend once, when it is first imported,
    so aiayn.interop.keras_model sets KERAS_BACKEND=torch (when unset) just before; that is what lets it load
    without TensorFlow. The same check sees it, which shows the check has teeth."""
    order = sorted((m for m in modules() if m != "__main__"), key=lambda m: layers()[unit(m)])
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run([sys.executable, "-c", SNAPSHOT, *order], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"interop.keras_model": ["environment"]}
