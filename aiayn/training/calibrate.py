"""What a time budget buys on this machine: updates a minute of the run's model, precision and batch,
measured in a few seconds before the corpus is prepared. The recipe decides by updates (config.choose),
not by minutes: a minute buys several times more updates on one CPU than on another."""

from __future__ import annotations

import time

import torch

from aiayn.config import ModelConfig, TrainConfig
from aiayn.model import Transformer
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.training.train import make_optimizer, train_step

LENGTH = 24  # tokens a side of the calibration's sentences: a bucket of a sentence corpus, padded
SECONDS = 5.0  # measured for at least this long, after one update to warm up


def updates_per_minute(
    config: ModelConfig, cfg: TrainConfig, device: torch.device, seconds: float = SECONDS
) -> float:
    """Updates a minute of training takes here: updates of a fresh model of `config` on random sentences
    of LENGTH tokens, max_tokens padded target tokens a micro-batch and cfg.accumulate micro-batches an
    update, in cfg's precision, timed after a first one (allocations, kernels). Reading and batching the
    corpus and validation are left out, so a run makes somewhat fewer. The process's random state is left
    as it was."""
    rows = max(1, cfg.max_tokens // LENGTH)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        model = Transformer(config).to(device).train()
        optimizer = make_optimizer(model, cfg)
        low = len((PAD_ID, BOS_ID, EOS_ID))  # ordinary tokens only
        src = torch.randint(low, config.src_vocab_size, (rows, LENGTH), device=device)
        tgt = torch.randint(low, config.tgt_vocab_size, (rows, LENGTH), device=device)
        tgt_in = torch.cat([torch.full((rows, 1), BOS_ID, device=device), tgt[:, :-1]], dim=1)
        tgt_out = torch.cat([tgt[:, :-1], torch.full((rows, 1), EOS_ID, device=device)], dim=1)
        update = [[src, tgt_in, tgt_out]] * cfg.accumulate
        train_step(model, optimizer, update, 1e-4, cfg)  # warm-up
        done, start = 0, time.perf_counter()
        while True:
            train_step(model, optimizer, update, 1e-4, cfg)
            done += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds and done >= 2:
                return done / elapsed * 60.0
