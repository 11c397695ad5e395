"""torch.distributed plumbing for `torchrun -m bridge train`: one process per rank, read from the
environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK). gloo on CPU (so tests run two real
ranks on a laptop), NCCL on GPUs. A plain `bridge train` is world size 1 and touches none of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("train.device is cuda but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: torch.device) -> DistInfo:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return info


def local_rank_from_env() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def mean_across_ranks(value: float, info: DistInfo, device: torch.device) -> float:
    if not info.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / info.world_size


def shutdown(info: DistInfo, *, finished: bool = True) -> None:
    """Tear the process group down. After a finished run every rank first meets the others at a
    barrier: a rank that destroyed its group while a peer still talked to it (the last checkpoint's
    gather) aborted at exit now and then ("terminate called without an active exception"). After an
    error there is no barrier, since a peer that already failed would never arrive."""
    if info.enabled and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()
