"""A tensor-parallel rank group over torch.distributed, and the start of one on this host.

    RankGroup(rank, size, process_group)        size 1: no process group, no communication
    RankGroup.single()                          the one-rank group
    free_port() -> int                          a TCP port free on 127.0.0.1 now (the rendezvous's)
    start_group(rank, size, port, device) -> RankGroup    env:// rendezvous on 127.0.0.1:port
    stop_group(group)                           leave the process group (every rank calls it)

Backend: NCCL on CUDA, gloo on the CPU (the tests). torch.distributed is imported inside the functions
that start and stop a group, never when this module is imported: the one-GPU path never loads it.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

RENDEZVOUS_HOST = "127.0.0.1"
START_TIMEOUT = timedelta(seconds=120)  # a rank that never arrives fails the others instead of hanging them


@dataclass(frozen=True)
class RankGroup:
    rank: int
    size: int
    process_group: Any = None  # torch.distributed.ProcessGroup; None for the one-rank group

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} out of range for a group of {self.size}")
        if self.size > 1 and self.process_group is None:
            raise ValueError("a group of more than one rank needs its process group")

    @staticmethod
    def single() -> RankGroup:
        return RankGroup(0, 1)


def free_port() -> int:
    """A port the OS says is free now; rank 0 binds it moments later (a race that a retry would cover)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((RENDEZVOUS_HOST, 0))
        return int(s.getsockname()[1])


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def start_group(rank: int, size: int, port: int, device: torch.device) -> RankGroup:
    """Join the group of `size` ranks meeting at 127.0.0.1:`port` (env:// rendezvous: the MASTER_ADDR /
    MASTER_PORT of this rank's process, set here). Size 1 starts nothing."""
    if size == 1:
        return RankGroup.single()
    import torch.distributed as dist  # lazy: see the module doc

    os.environ["MASTER_ADDR"] = RENDEZVOUS_HOST
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        backend_for(device), init_method="env://", rank=rank, world_size=size, timeout=START_TIMEOUT
    )
    return RankGroup(rank, size, dist.group.WORLD)


def stop_group(group: RankGroup) -> None:
    if group.size == 1:
        return
    import torch.distributed as dist

    dist.destroy_process_group()
