"""The optional packages: a command or flag that needs one refuses, before any work, in one line naming
the extra of pyproject.toml that installs it (serve, hf, plots, ctranslate2, keras, tensorboard,
transformers, sentencepiece)."""

from __future__ import annotations

import importlib.util


def need(what: str, extra: str, *modules: str) -> None:
    """A ValueError, `WHAT needs the MODULE package: pip install 'aiayn[EXTRA]'`, for the first of the
    modules that is not installed. Looked up by name, not imported: fastapi or datasets take a second to
    import, and a command checks before it starts. (A module set to None in sys.modules counts as
    missing: find_spec answers None for it, as import raises ImportError.)"""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"{what} needs the {module} package: pip install 'aiayn[{extra}]'")
