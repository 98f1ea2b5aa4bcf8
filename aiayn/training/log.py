"""What a running run reports as it goes, and its clock: OUT/metrics.jsonl (a JSON record a line),
TensorBoard when asked for, the progress bar and the terminal, and the training minutes of the whole run
across resumes (what budgets, schedules and checkpoints read). Only rank 0 writes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from aiayn.extras import need
from aiayn.files import atomic_write, writing

METRICS, TENSORBOARD = "metrics.jsonl", "tensorboard"


class Step(Protocol):  # training.run.Progress: where training stands
    step: int
    epoch: int


class RunLog:
    """The records, the progress and the clock of the run in OUT."""

    def __init__(self, out: Path, progress: bool, tensorboard: bool, main: bool = True):
        self.out, self.main = out, main
        self.progress = progress and main
        self.tensorboard = tensorboard and main
        if self.tensorboard:  # asked for and missing: refused before the run begins, not a warning
            need("--tensorboard", "tensorboard", "tensorboard")
        self.writer: Any = None  # TensorBoard's SummaryWriter while the run is open
        self.bar: tqdm | None = None
        self.minutes_before = 0.0
        self.clock = time.monotonic()
        self.tokens, self.tick = 0, self.clock  # target tokens since the last throughput figure

    def start(self, minutes_before: float) -> None:
        """The clock goes on from the minutes the run had trained before; the writers open."""
        self.minutes_before = minutes_before
        self.clock = self.tick = time.monotonic()
        self.bar = tqdm(
            desc="train",
            unit="upd",
            disable=not self.progress,
            dynamic_ncols=True,
            mininterval=1 if sys.stderr.isatty() else 30,
        )
        if not self.tensorboard:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.out / TENSORBOARD))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def minutes(self) -> float:
        """Training minutes of the whole run, across resumes: the one clock."""
        return self.minutes_before + (time.monotonic() - self.clock) / 60

    def record(self, record: dict[str, Any], echo: bool = False) -> None:
        """Append to OUT/metrics.jsonl; numbers also go to TensorBoard; echo: also to the terminal."""
        if not self.main:
            return
        with writing(self.out / METRICS), open(self.out / METRICS, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None and "step" in record:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "epoch"):
                    self.writer.add_scalar(key, value, record["step"])
        if echo and self.progress:
            tqdm.write(json.dumps(record), file=sys.stderr)

    def say(self, text: str) -> None:
        if self.progress:
            tqdm.write(text, file=sys.stderr)

    def update(self, state: Step, loss: float, lr: float, n_tokens: int) -> None:
        """After an update: the progress bar and, every 10 updates, a training record."""
        self.bar.update(1)
        self.tokens += n_tokens
        if state.step % 10:
            return
        rate = self.tokens / max(time.monotonic() - self.tick, 1e-9)
        self.bar.set_postfix(
            epoch=state.epoch + 1, loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{rate:.0f}", refresh=False
        )
        record = {"step": state.step, "epoch": state.epoch, "loss": loss, "lr": lr, "tokens_per_s": rate}
        self.record({**record, "minutes": self.minutes()})
        self.tokens, self.tick = 0, time.monotonic()

    def length(self) -> int:
        """The bytes of metrics.jsonl: a checkpoint keeps it, so a resume can drop what came after."""
        path = self.out / METRICS
        return path.stat().st_size if path.is_file() else 0

    def truncate(self, length: int) -> None:
        """Drop the records of the updates and validations after the last checkpoint, which the resumed
        run redoes; the records of what happened to the run (it stopped, resumed) stay."""
        path = self.out / METRICS
        if length < 0 or not path.is_file() or path.stat().st_size <= length:
            return
        with open(path, "rb") as f:
            f.seek(length)
            tail = f.read().decode("utf-8", errors="replace").splitlines(keepends=True)
        kept = [line for line in tail if is_run_event(line)]
        atomic_write(path, lambda tmp: tmp.write_bytes(path.read_bytes()[:length] + "".join(kept).encode()))


def is_run_event(line: str) -> bool:
    """A metrics line about the run as a whole (stop, resume, data), not about an update it redoes."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:  # half written by a killed run
        return False
    return isinstance(record, dict) and record.get("event") in ("stop", "resume", "data")
