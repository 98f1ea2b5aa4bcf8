"""The measurement the recipe decides its budget's choices by (training/calibrate.py)."""

import torch

from aiayn.config import TrainConfig, preset
from aiayn.training.calibrate import updates_per_minute


def test_updates_per_minute_is_measured_without_touching_the_runs_random_state():
    """A positive rate from updates of the run's own model and batch, and the process's random numbers
    afterwards are those it would have drawn without the measurement (a seeded run stays bit for bit)."""
    torch.manual_seed(7)
    before = torch.random.get_rng_state()
    rate = updates_per_minute(
        preset("tiny", vocab_size=50),
        TrainConfig(dtype="fp32", max_tokens=256),
        torch.device("cpu"),
        seconds=0.2,
    )
    assert rate > 0
    assert torch.equal(torch.random.get_rng_state(), before)
