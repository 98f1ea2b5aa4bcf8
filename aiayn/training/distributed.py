"""The processes of one training run (`torchrun`): which rank this is, and the few collective steps that
make W ranks train as one process would. PyTorch's process group and DDP do the work.

One process is the case W = 1: every method then returns at once, with no process group.
"""

from __future__ import annotations

import datetime
import gc
import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0  # the process's index on its machine: its GPU

    @property
    def main(self) -> bool:
        """Rank 0 alone writes OUT, logs, validates and prints."""
        return self.rank == 0

    @classmethod
    def start(cls, backend: str = "auto", device: str = "auto", timeout_minutes: float = 30.0) -> Ranks:
        """The process group torchrun described in the environment (RANK, WORLD_SIZE, MASTER_ADDR...), or
        one process. backend auto: NCCL when the ranks run on CUDA, gloo on the CPU."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if backend == "auto":
            backend = "nccl" if on_cuda else "gloo"
        if on_cuda:
            if device.startswith("cuda:"):
                raise ValueError(
                    f"--device {device} with {world} processes: each process takes the GPU of its local rank; "
                    "use --device cuda (CUDA_VISIBLE_DEVICES picks which GPUs)"
                )
            gpus = torch.cuda.device_count()
            if local_rank >= gpus:
                processes = os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1))
                raise ValueError(
                    f"{processes} processes on this machine but {gpus} GPU(s): one GPU a process; start at "
                    f"most {gpus} (--nproc, torchrun --nproc-per-node) or train on the CPU with --device cpu"
                )
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            timeout = datetime.timedelta(minutes=timeout_minutes)
            dist.init_process_group(backend, timeout=timeout)
        return cls(rank, world, local_rank)

    def device(self, device: str) -> torch.device:
        """This rank's device: cuda:LOCAL_RANK on CUDA (one GPU per rank; start() refused cuda:N), else
        as asked."""
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and self.world > 1:
            return torch.device("cuda", self.local_rank)
        return torch.device(device)

    # --- Collectives (no-ops for one process) -------------------------------------------------------

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        """Element-wise sums over the ranks, in float64 (token counts stay exact)."""
        return self._all_reduce(values, torch.float64, dist.ReduceOp.SUM, device)

    def max(self, values: list[int], device: torch.device) -> list[int]:
        """Element-wise maxima over the ranks: what one rank flags, all see."""
        return self._all_reduce(values, torch.int64, dist.ReduceOp.MAX, device)

    def _all_reduce(self, values: list, dtype: torch.dtype, op: Any, device: torch.device) -> list:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=dtype, device=device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def share(self, value: Any) -> Any:
        """Rank 0's value on every rank."""
        if self.world == 1:
            return value
        box = [value if self.main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP for W > 1, summing (not averaging) gradients: each rank's loss is already divided by the
        target tokens of the whole update, so the sum is the gradient one process would compute."""
        if self.world == 1:
            return model
        device_ids = [self.local_rank] if next(model.parameters()).device.type == "cuda" else None
        # No buffer needs syncing (the sinusoid table is computed alike on every rank). PyTorch 2.13 renamed
        # the switch and deprecated the old name; older releases know only the old one.
        no_sync = {_SYNC_BUFFERS: False}
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **no_sync)
        ddp.register_comm_hook(None, _sum_hook)
        return ddp

    def close(self, together: bool = True) -> None:
        """End the process group. together: every rank got here without an error, so they wait for each
        other first (not after an error: a rank that failed never comes)."""
        if self.world > 1 and dist.is_initialized():
            # Rank 0 validates alone at the end of a run: a rank that tore its side of gloo down meanwhile
            # and left made rank 0's own teardown abort now and then (SIGABRT, "terminate called without
            # an active exception", after its final line was written). So the ranks leave together. And
            # the DDP wrapper sits in reference cycles (hooks), so it would otherwise be freed at
            # interpreter exit, with gloo's threads still holding the group (the same abort): freed now,
            # then the group destroyed.
            if together:
                dist.barrier()
            gc.collect()
            dist.destroy_process_group()


ONE = Ranks()  # one process, no process group

_SYNC_BUFFERS = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
    else "broadcast_buffers"
)


def _sum_hook(state, bucket):  # noqa: ANN001 (DDP checks these annotations; as strings they fail)
    """DDP's all-reduce without its division by the world size: bucket (dist.GradBucket) -> Future."""
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda f: f.value()[0])


def env_rank() -> int:
    """This process's rank as torchrun set it (0 outside torchrun): for naming it in an error."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


__all__ = ["Ranks", "ONE", "env_rank"]
