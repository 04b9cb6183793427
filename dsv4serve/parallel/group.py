"""A tensor-parallel rank group over torch.distributed, and the start of one on this host.

    RankGroup(rank, size, process_group, control)   size 1: no process group, no communication
    RankGroup.single()                          the one-rank group
    free_port() -> int                          a TCP port free on 127.0.0.1 now (rendezvous.py, torch-free)
    start_group(rank, size, port, device) -> RankGroup    env:// rendezvous on 127.0.0.1:port
    stop_group(group)                           leave the process group (every rank calls it)
    agree_min(group, values) -> values          each value's minimum over the ranks
    gather_lines(group, line) -> [line]         every rank's line, rank order

Backend: NCCL on CUDA, gloo on the CPU (the tests). `control` is a gloo group over the same ranks on CUDA too:
the step plans and sampled tokens (step_link.py) are host data, and travel host to host. torch.distributed is
imported inside the functions that start and stop a group, never when this module is imported: the one-GPU
path never loads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from dsv4serve.parallel.rendezvous import RENDEZVOUS_HOST, free_port

__all__ = ["RankGroup", "agree_min", "backend_for", "free_port", "gather_lines", "start_group", "stop_group"]
# every collective's timeout, the rendezvous's too: long enough for a rank still loading its shards of the real
# checkpoint while the others wait at the first collective; an idle server's ranks are pinged well within it
# (worker/main.py). A rank that dies is noticed by the supervisor at once, which stops the whole group.
GROUP_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class RankGroup:
    rank: int
    size: int
    process_group: Any = None  # torch.distributed.ProcessGroup; None for the one-rank group
    control: Any = None  # a gloo group of the same ranks (host data); the process group itself on the CPU

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} out of range for a group of {self.size}")
        if self.size > 1 and self.process_group is None:
            raise ValueError("a group of more than one rank needs its process group")

    @staticmethod
    def single() -> RankGroup:
        return RankGroup(0, 1)


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
        backend_for(device), init_method="env://", rank=rank, world_size=size, timeout=GROUP_TIMEOUT
    )
    world = dist.group.WORLD
    control = world if device.type != "cuda" else dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
    return RankGroup(rank, size, world, control)


def stop_group(group: RankGroup) -> None:
    if group.size == 1:
        return
    import torch.distributed as dist

    dist.destroy_process_group()


def agree_min(group: RankGroup, values: list[int]) -> list[int]:
    """Each value's minimum over the ranks (on the control group): what every rank must size the same way from
    what each measured alone (free memory: the KV capacity, the calibration prefill's tokens)."""
    if group.size == 1:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.control)
    return [int(v) for v in t.tolist()]


def gather_lines(group: RankGroup, line: str) -> list[str]:
    """Every rank's `line`, in rank order, on every rank (the start-up report's per-rank lines)."""
    if group.size == 1:
        return [line]
    import torch.distributed as dist

    lines: list[object] = [None] * group.size
    dist.all_gather_object(lines, line, group=group.control)
    return [str(x) for x in lines]
