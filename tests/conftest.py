"""Shared test settings: one thread (tiny models run faster without threading overhead on 2 cores)."""

import torch

torch.set_num_threads(1)
