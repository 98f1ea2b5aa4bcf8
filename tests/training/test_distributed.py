"""Several processes train as one (torchrun, DDP, gloo on this CPU): the gradient of W ranks is the
gradient of one process accumulating W micro-batches, the command line gives the same weights, an
epoch's odd tail or a one-batch corpus does not hang, a signal stops every rank at one update and the
run resumes bit for bit, and only rank 0 writes or speaks.

Every subprocess has a timeout and the process group a short one, so a hang fails instead of stalling.
"""

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import RecordingSGD, run_cli

from aiayn import checkpoint
from aiayn.config import TrainConfig, preset
from aiayn.data.corpus import collate
from aiayn.data.synthetic import generate
from aiayn.model import Transformer
from aiayn.training.distributed import Ranks
from aiayn.training.train import Step, dropout_seed, train_step

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TIMEOUT = 180  # seconds for one torchrun; the process group gives up after dist_timeout_minutes


# --- The gradient of W ranks ---------------------------------------------------------------------------


def setup():
    """A tiny model with dropout and three updates of two micro-batches with unequal token counts."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=40, dropout=0.1))
    g = torch.Generator().manual_seed(1)
    updates = []
    for _ in range(3):
        group = []
        for rows, length in ((3, 9), (5, 4)):  # 27 and 20 target tokens
            ids = [(torch.randint(4, 40, (length,), generator=g).tolist() + [2]) for _ in range(rows)]
            group.append(list(collate(ids, ids, list(range(rows)))))
        updates.append(group)
    return model, updates


class PerRankNormalised(Ranks):
    """The bug the test must catch: each rank divides by its own tokens (no all-reduce of the count)."""

    def sum(self, values, device):
        return values if all(float(v).is_integer() for v in values) else super().sum(values, device)


def rank_gradients(rank: int, store: str) -> None:
    """Both ways of normalising, one after the other, in one process group (two process starts fewer)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    for per_rank in (False, True):
        ranks = (PerRankNormalised if per_rank else Ranks)(rank, 2, 0)
        model, updates = setup()
        optimizer = RecordingSGD(model)
        ddp = ranks.wrap(model.train())
        for u, group in enumerate(updates):
            step = Step(0.1, seeds=[dropout_seed(1, u + 1, rank)], ranks=ranks)
            train_step(ddp, optimizer, [group[rank]], 0.1, TrainConfig(dtype="fp32"), step=step)
        if rank == 0:
            torch.save(optimizer.grads, f"{store}.grads-{per_rank}")
    del ddp
    # the run's own close: the ranks leave together, the DDP wrappers (in reference cycles) freed before
    # the group (one left to the interpreter's exit ended this rank with SIGABRT, "terminate called
    # without an active exception")
    ranks.close()
    os._exit(0)  # what this rank gives is in its files: no interpreter shutdown (2 s of the test's time)


def two_rank_gradients(tmp_path: Path) -> dict[bool, list[list[torch.Tensor]]]:
    """Rank 0's recorded gradients, normalised by the ranks' tokens together (False) and by each rank's own
    (True)."""
    store = str(tmp_path / "store")
    mp.spawn(rank_gradients, args=(store,), nprocs=2, join=True)
    return {per_rank: torch.load(f"{store}.grads-{per_rank}") for per_rank in (False, True)}


def test_two_ranks_give_the_gradient_of_one_process_accumulating_two(tmp_path):
    model, updates = setup()
    optimizer = RecordingSGD(model)
    model.train()
    for u, group in enumerate(updates):
        step = Step(0.1, seeds=[dropout_seed(1, u + 1, j) for j in range(2)])
        train_step(model, optimizer, group, 0.1, TrainConfig(dtype="fp32"), step=step)
    want = optimizer.grads
    gradients = two_rank_gradients(tmp_path)
    got = gradients[False]
    for update, (a, b) in enumerate(zip(got, want)):
        for p, q in zip(a, b):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=f"update {update}")  # bit for bit
    # The check has teeth: normalising by each rank's own tokens gives other gradients.
    wrong = gradients[True]
    assert any(not torch.allclose(p, q, rtol=1e-3) for p, q in zip(wrong[0], want[0]))


# --- The command line under torchrun -------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ddp")
    src, tgt = generate(300, seed=2)
    for lang, lines in (("en", src), ("xx", tgt)):
        (root / f"c.{lang}").write_text("".join(line + "\n" for line in lines))
        (root / f"v.{lang}").write_text("".join(line + "\n" for line in lines[:6]))
        (root / f"one.{lang}").write_text("".join(line + "\n" for line in lines[:5]))  # one batch
    return root


PAPER = ("--set", "schedule=paper")


def flags(corpus: Path, *extra) -> list[str]:
    return [
        "--train", corpus / "c", "--valid", corpus / "v", "--src-lang", "en", "--tgt-lang", "xx",
        "--preset", "tiny", "--vocab-size", 300, "--max-tokens", 300, "--quiet", "--device", "cpu",
        "--set", "valid_every=3", "--set", "dropout=0.1", "--set", "dtype=fp32", "--set", "dist_timeout_minutes=0.5",
        *extra,
    ]  # fmt: skip


def aiayn(*argv, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "aiayn", *map(str, argv)]
    return subprocess.run(command, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=TIMEOUT,
                          **kwargs)  # fmt: skip


def test_more_processes_than_gpus_or_one_gpu_for_all_is_refused_before_cuda_is_touched(monkeypatch):
    """Rank 1 of two on a machine with one GPU (as torchrun describes it): a ValueError saying so, not CUDA's
    "invalid device ordinal" from inside the first kernel; --device cuda:N under torchrun likewise, since
    every rank takes the GPU of its local rank. The same on a real one-GPU machine: tests/test_cuda.py."""
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"2 processes on this machine but 1 GPU\(s\).*--device cpu"):
        Ranks.start(device="auto")
    with pytest.raises(ValueError, match="--device cuda:1 with 2 processes"):
        Ranks.start(device="cuda:1")
    assert not dist.is_initialized()


def torchrun(logs: Path, *argv) -> list:
    """torchrun of `aiayn ARGV` on 2 ranks, each rank's output in a file of its own under logs."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--log-dir", str(logs), "--redirects", "3", "-m", "aiayn", *map(str, argv),
    ]  # fmt: skip


def rank_output(logs: Path, rank: int) -> str:
    return "".join(p.read_text() for p in sorted(logs.glob(f"*/attempt_0/{rank}/std*.log")))


def weights(out: Path, step: int) -> bytes:
    return (checkpoint.checkpoint_path(out, step) / checkpoint.WEIGHTS).read_bytes()


def odd_epoch(out: Path) -> int:
    """Batches in the first epoch of the run in OUT (its prepared data, its max_tokens)."""
    from aiayn.data.corpus import batch_plan
    from aiayn.data.prepare import open_prepared

    data, cfg = open_prepared(out / "data"), json.loads((out / "train.json").read_text())
    return len(batch_plan(data.src.lengths, data.tgt.lengths, cfg["max_tokens"], seed=cfg["seed"], epoch=0))


REFERENCE = ("--max-updates", 12, "--max-tokens", 500, *PAPER)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """12 updates of the paper's schedule through an epoch of 19 batches, whose last update has one (rank
    1 runs a zero-weight batch), trained twice: by `aiayn train --nproc 2` (which runs torchrun itself) in
    ROOT/ddp, and by one process (this one: a process start fewer) accumulating two micro-batches an update
    in ROOT/one. The runs the tests below compare theirs with."""
    root = tmp_path_factory.mktemp("reference")
    code, stdout, stderr = run_cli(
        ["train", *flags(corpus, *REFERENCE, "--out", root / "one", "--set", "accumulate=2")]
    )
    assert code == 0, stderr
    assert odd_epoch(root / "one") == 19  # an odd tail at update 10
    temporary = root / "tmp"  # the run's temporary directory: torchrun leaves nothing of its own there
    temporary.mkdir()
    ddp = aiayn("train", *flags(corpus, *REFERENCE, "--out", root / "ddp", "--nproc", 2),
                env={"TMPDIR": str(temporary)})  # fmt: skip
    assert ddp.returncode == 0, ddp.stderr
    assert list(temporary.glob("torchelastic_*")) == []
    assert ddp.stdout == stdout  # the last line, the run's: rank 0's alone (rank 1 prints nothing)
    return root


def test_torchrun_with_two_ranks_gives_the_weights_of_one_process_accumulating_two(reference):
    root = reference
    for step in (3, 6, 9, 12):
        assert weights(root / "ddp", step) == weights(root / "one", step)
    assert not [p for p in (root / "ddp").rglob("*") if p.name.endswith(".tmp")]
    records = [json.loads(line) for line in (root / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("event") for r in records].count("data") == 1  # one writer
    assert {r["epoch"] for r in records if "valid_bleu" in r} == {0, 1}


def test_a_corpus_of_one_batch_runs_as_one_process(corpus, tmp_path):
    """Every update has one micro-batch for two ranks: rank 1 always runs a zero-weight one; no hang."""
    args = flags(corpus, "--train", corpus / "one", "--max-updates", 3)
    code, _, stderr = run_cli(["train", *args, "--out", tmp_path / "one", "--set", "accumulate=2"])
    assert code == 0, stderr
    assert odd_epoch(tmp_path / "one") == 1
    ddp = subprocess.run(
        torchrun(tmp_path / "logs", "train", *args, "--out", tmp_path / "ddp"),
        env=ENV, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert ddp.returncode == 0, ddp.stderr
    assert weights(tmp_path / "ddp", 3) == weights(tmp_path / "one", 3)


def test_sigterm_to_torchrun_stops_every_rank_at_one_update_and_the_run_resumes_bit_for_bit(
    corpus, reference, tmp_path
):
    # The paper's schedule: the interrupted run is given a budget it cannot reach (100,000 updates), and a
    # budget schedule would follow it; resuming one under its own budget is tested in test_train.py.
    root = reference
    out, logs = tmp_path / "run", tmp_path / "logs"
    proc = subprocess.Popen(
        torchrun(logs, "train", *flags(corpus, *REFERENCE, "--out", out, "--max-updates", 100_000)),
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    errors = ""
    try:
        deadline = time.monotonic() + TIMEOUT
        while not checkpoint.list_checkpoints(out):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, errors = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    said = f"rank 0: {rank_output(logs, 0)!r}; rank 1: {rank_output(logs, 1)!r}; torchrun: {errors}"
    stop = json.loads(rank_output(logs, 0).splitlines()[-1])
    assert stop["reason"] == "signal SIGTERM" and rank_output(logs, 1) == "", said
    last = checkpoint.list_checkpoints(out)[-1]
    assert last.name == f"step_{stop['step']:08d}" and stop["step"] < 12, said
    assert checkpoint.load_state(last)["progress"]["step"] == stop["step"]  # resumable, complete
    shutil.copytree(out, tmp_path / "copy")
    resumed = subprocess.run(
        torchrun(tmp_path / "logs2", "train", *flags(corpus, *REFERENCE, "--out", out, "--resume")),
        env=ENV, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert weights(out, 12) == weights(root / "ddp", 12)
    # One process may take the run on with the same micro-batches per update (2 ranks x 1 = 1 x 2).
    args = flags(corpus, *REFERENCE, "--out", tmp_path / "copy", "--resume", "--set", "accumulate=2")
    code, _, stderr = run_cli(["train", *args])
    assert code == 0, stderr
    assert weights(tmp_path / "copy", 12) == weights(root / "ddp", 12)


def test_a_rank_that_dies_ends_the_run_instead_of_hanging(corpus, tmp_path):
    """SIGKILL to rank 1 mid-run: torchrun ends rank 0 too, well within the process-group timeout, and
    OUT keeps its last complete checkpoint."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        torchrun(tmp_path / "logs", "train", *flags(corpus, "--out", out, "--max-updates", 100_000)),
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT
        while not checkpoint.list_checkpoints(out):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        workers = worker_pids(proc.pid)
        (rank1,) = [pid for pid in workers if environ(pid).get("RANK") == "1"]
        os.kill(rank1, signal.SIGKILL)
        started = time.monotonic()
        proc.communicate(timeout=60)
        assert proc.returncode != 0 and time.monotonic() - started < 60
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]  # no rank left behind
    checkpoint.load_state(checkpoint.list_checkpoints(out)[-1])  # complete and readable


def worker_pids(parent: int) -> list[int]:
    """The processes torchrun started (its children)."""
    children = Path(f"/proc/{parent}/task/{parent}/children")
    return [int(p) for p in children.read_text().split()] if children.exists() else []


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def test_an_error_on_another_rank_names_it(corpus, tmp_path, monkeypatch):
    from conftest import assert_one_line_error, run_cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    code, _, stderr = run_cli(["train", *flags(corpus, "--out", tmp_path / "o", "--set", "dropout=2")])
    assert_one_line_error(code, stderr, "rank 1: ", "dropout must be in [0, 1)")
