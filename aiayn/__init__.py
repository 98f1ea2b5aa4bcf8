"""aiayn: the Transformer of "Attention Is All You Need", faithful by default, tested and fast.

The core at the top, then one subpackage for each thing a user does, in layers, bottom to top. A module
imports only from layers below its own, or from its own subpackage without a cycle, so data flows one
way (tests/test_layers.py holds the code to this table):

    files precision extras           writing results safely; device and number format; optional packages
    config tokenizer                 frozen configs and presets; vocabularies and the special ids
    model                            the Transformer (§3)
    checkpoint                       model directories, training checkpoints, averaging (§6.1)
    data                             reading and batching text; prepared corpora; the demo's task
    inference                        search; the translator; compiled decoding; shortlist; sacreBLEU; pictures
    training                         the training loop; its run directory; torchrun's ranks; the demo
    interop                          CTranslate2 and Keras 3
    serving                          the HTTP API and its page
    cli                              the command line, a module per group of commands
    __main__                         python -m aiayn (what torchrun runs)

The public API is importable from here: Transformer, Translator, train, the configs and preset. Only
the configs load with `import aiayn`; the others when first named (they bring PyTorch and more).
"""

from typing import Any

from aiayn.config import ModelConfig, SearchConfig, ServeConfig, TrainConfig, preset

__version__ = "0.1.0"  # the one place; pyproject.toml reads it

# name -> the module that defines it, imported when the name is first asked for
_LAZY = {
    "Transformer": "aiayn.model",
    "Translator": "aiayn.inference.translate",
    "train": "aiayn.training.train",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'aiayn' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = ["ModelConfig", "TrainConfig", "SearchConfig", "ServeConfig", "preset", *_LAZY]
