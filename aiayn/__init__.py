"""aiayn: the Transformer of "Attention Is All You Need", faithful by default, tested and fast."""

from aiayn.config import ModelConfig, SearchConfig, TrainConfig, preset

__all__ = ["ModelConfig", "TrainConfig", "SearchConfig", "preset"]
