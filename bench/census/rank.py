"""One tensor-parallel rank in the census's single process: its collectives counted, none run.

    tp = CountedRank(rank=0, size=N)       # model/layers.TensorParallel: all_reduce_sum, all_gather, reset
    tp.calls                               # the last step's (the runner resets it as a step starts)

The census counts what a rank's device would launch; the values of a rank alone (partials never summed) are
not a model's, and nothing the census counts depends on them: the step is static in its shapes (the census's
own check), routing included. all_gather returns `size` copies of this rank's part: the shape the real one
returns, made by the same concatenation (dsv4serve/parallel/collectives.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4serve.parallel.collectives import CollectiveCall


@dataclass
class CountedRank:
    rank: int
    size: int
    calls: list[CollectiveCall] = field(default_factory=list)

    def reset(self) -> None:
        self.calls.clear()

    def all_reduce_sum(self, x: torch.Tensor, what: str) -> torch.Tensor:
        out = x.contiguous()
        self.calls.append(CollectiveCall("all_reduce", what, out.numel() * out.element_size()))
        return out

    def all_gather(self, x: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        x = x.contiguous()
        self.calls.append(CollectiveCall("all_gather", what, x.numel() * x.element_size()))
        return torch.cat([x] * self.size, dim=dim)
