"""The package's shape, held to what its docstring draws: imports go down the layers only, no module
keeps mutable state at module level, and the training loop stays short enough to read on one screen."""

import ast
import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import aiayn
from aiayn import train

PACKAGE = Path(aiayn.__file__).parent


def layers() -> dict[str, int]:
    """{module: layer} from the table in aiayn/__init__.py, bottom layer 0."""
    table = aiayn.__doc__.split("layers, bottom to top")[1]
    rows = re.findall(r"^    ((?:\w+ )*\w+)\s{2,}", table, re.MULTILINE)
    return {module: i for i, row in enumerate(rows) for module in row.split()}


def imported(path: Path) -> set[str]:
    """The aiayn modules a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("aiayn"):
            if node.module == "aiayn":  # from aiayn import checkpoint
                found |= {alias.name for alias in node.names}
            else:
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("aiayn.")}
    return found


def test_every_module_has_its_place_in_the_table():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert set(layers()) == modules


def test_imports_only_go_down_the_layers():
    layer = layers()
    wrong = [
        f"{path.stem} (layer {layer[path.stem]}) imports {name} (layer {layer[name]})"
        for path in sorted(PACKAGE.glob("*.py"))
        if path.stem != "__init__"
        for name in sorted(imported(path))
        if layer[name] >= layer[path.stem]
    ]
    assert not wrong


def test_the_layer_check_catches_an_upward_import(tmp_path):
    """The test above has teeth: a model that imported train would be reported."""
    path = tmp_path / "model.py"
    path.write_text("def f():\n    from aiayn.train import train\n")
    assert imported(path) == {"train"} and layers()["train"] > layers()["model"]


def test_no_module_keeps_mutable_state():
    """Module-level lists, dicts and sets are shared by every caller in the process (a server's
    threads, two runs): tables are read-only mappings or tuples, and state lives in objects."""
    mutable = []
    for info in pkgutil.iter_modules([str(PACKAGE)]):
        module = importlib.import_module(f"aiayn.{info.name}")
        for name, value in vars(module).items():
            if not name.startswith("__") and isinstance(value, (list, dict, set, bytearray)):
                mutable.append(f"aiayn.{info.name}.{name}")
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
    so aiayn.keras_model sets KERAS_BACKEND=torch (when unset) just before; that is what lets it load
    without TensorFlow. The same check sees it, which shows the check has teeth."""
    order = sorted((m for m in layers() if m != "__main__"), key=lambda m: layers()[m])
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run([sys.executable, "-c", SNAPSHOT, *order], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"keras_model": ["environment"]}
