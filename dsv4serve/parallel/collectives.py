"""The collectives a split forward runs, each call counted (op, what, bytes) as the step census counts
launches: a step's communication is read off `calls` and compared with comm_volume.py's projection.

    Collectives(group).all_reduce_sum(x, what) -> x summed over the ranks
    Collectives(group).all_gather(x, dim, what) -> every rank's x concatenated along dim, rank order
    Collectives.calls: [CollectiveCall]         since construction or the last `reset()`

A model split over ranks holds one (model/layers.TensorParallel is its interface); a one-rank model holds
none, so it runs no collective and no counting.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import torch

from dsv4serve.parallel.group import RankGroup


@dataclass(frozen=True)
class CollectiveCall:
    op: Literal["all_reduce", "all_gather"]
    what: str  # the model's name for it (comm_volume.py's names)
    message_bytes: int  # the operand one rank contributes


@dataclass
class Collectives:
    group: RankGroup
    calls: list[CollectiveCall] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    def reset(self) -> None:
        self.calls.clear()

    def counts(self) -> Counter[tuple[str, str]]:
        """{(op, what): calls}."""
        return Counter((c.op, c.what) for c in self.calls)

    def all_reduce_sum(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """x [...] -> the element-wise sum over the ranks, reduced in place (the model hands over tensors it
        made for this; a non-contiguous x is copied first) and returned."""
        out = x.contiguous()
        self.calls.append(CollectiveCall("all_reduce", what, out.numel() * out.element_size()))
        if self.size > 1:
            self._sum_in_place(out)
        return out

    def all_gather(self, x: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        """x [..., n, ...] -> [..., size * n, ...]: rank r's x at [r * n, (r + 1) * n) along `dim`."""
        x = x.contiguous()
        self.calls.append(CollectiveCall("all_gather", what, x.numel() * x.element_size()))
        if self.size == 1:
            return x
        return torch.cat(self._gather_parts(x), dim=dim)

    # the transport (a stand-in that counts without communicating overrides these: bench/census/rank.py)
    def _sum_in_place(self, out: torch.Tensor) -> None:
        import torch.distributed as dist  # lazy: a group of size > 1 has it loaded already

        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group.process_group)

    def _gather_parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group.process_group)
        return parts
