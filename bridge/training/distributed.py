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
    #: a one-rank process group this process made for itself (FSDP2 on one device)
    own_group: bool = False

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


def init_distributed(device: torch.device, single_rank_group: bool = False) -> DistInfo:
    """The rank's place in the run. `single_rank_group`: outside torchrun, still make a one-rank
    process group (in-memory store), so FSDP2 runs on one device through the code path it takes
    on several."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        if not single_rank_group:
            return DistInfo()
        if dist.is_initialized():
            return DistInfo()
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        return DistInfo(own_group=True)
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


def union_across_ranks(items: set[str], info: DistInfo) -> set[str]:
    """The union of every rank's `items` (a collective: every rank calls it at the same point)."""
    if not info.enabled:
        return set(items)
    gathered: list = [None] * info.world_size
    dist.all_gather_object(gathered, sorted(items))
    return {item for part in gathered for item in part}


def shutdown(info: DistInfo, *, finished: bool = True) -> None:
    """Tear the process group down. After a finished run every rank first meets the others at a
    barrier: a rank that destroyed its group while a peer still talked to it (the last checkpoint's
    gather) aborted at exit now and then ("terminate called without an active exception"). After an
    error there is no barrier, since a peer that already failed would never arrive."""
    if (info.enabled or info.own_group) and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()
