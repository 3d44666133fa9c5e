"""Processes launched by ``torchrun``: joining the process group, and the few collectives the
benchmark and drafter training need (rank 0's value everywhere, a sum, everyone's objects).
Without ``torchrun`` (``WORLD_SIZE`` unset or 1) everything here is a no-op on one process."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

from .errors import InvalidInputError

__all__ = ["DistInfo", "all_objects", "all_sum", "barrier", "from_rank0", "init_distributed"]


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    device: str | None = None  # None = the caller's choice

    @property
    def distributed(self) -> bool:
        return self.world > 1


def init_distributed(device: str | None = None) -> DistInfo:
    """Join the process group when launched by ``torchrun`` (``WORLD_SIZE`` > 1): gloo on CPU,
    nccl on CUDA with one GPU per local rank. A single process needs nothing."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return DistInfo(device=device)
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    asks_cuda = device is not None and device.startswith("cuda")
    want_cuda = (device in (None, "auto") or asks_cuda) and torch.cuda.is_available()
    if asks_cuda and not torch.cuda.is_available():
        raise InvalidInputError("--device cuda was asked for, but CUDA is not available")
    if want_cuda:
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    else:
        device = "cpu"
    if not dist.is_initialized():
        # ranks finish at different times (prompts differ in length); the default timeout (10 min
        # for nccl) would kill the final gather of a long run
        dist.init_process_group(
            backend="nccl" if want_cuda else "gloo", timeout=datetime.timedelta(hours=72)
        )
    return DistInfo(rank=dist.get_rank(), world=dist.get_world_size(), device=device)


def barrier(info: DistInfo) -> None:
    """Wait for every rank of a data-parallel run (nothing to wait for in a single process)."""
    if info.distributed:
        import torch.distributed as dist

        dist.barrier()


def from_rank0(info: DistInfo, value: Any) -> Any:
    """Rank 0's ``value`` on every rank (so that ranks without a shared file system still agree
    on what is done); ``value`` itself in a single process."""
    if not info.distributed:
        return value
    import torch.distributed as dist

    box = [value if info.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_sum(info: DistInfo, value: Any) -> Any:
    """The sum of a tensor over the ranks (on the device, no host synchronisation with nccl)."""
    if not info.distributed:
        return value
    import torch.distributed as dist

    value = value.clone()
    dist.all_reduce(value)
    return value


def all_objects(info: DistInfo, value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable; between the job's own processes), by rank."""
    if not info.distributed:
        return [value]
    import torch.distributed as dist

    values: list[Any] = [None] * info.world
    dist.all_gather_object(values, value)
    return values
