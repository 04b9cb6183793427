"""One tensor-parallel rank in the census's single process: its collectives counted, none run.

    tp = CountedRank(rank=0, size=N)       # model/layers.TensorParallel: all_reduce_sum, all_gather, reset
    tp.calls                               # the last step's (the runner resets it as a step starts)

The census counts what a rank's device would launch; the values of a rank alone (partials never summed) are
not a model's, and nothing the census counts depends on them: the step is static in its shapes (the census's
own check), routing included. The counting is dsv4serve/parallel/collectives.Collectives' own; only its
transport is replaced: the all-reduce leaves this rank's partial as it is, and the all-gather returns `size`
copies of this rank's part, the shape the real one returns, made by the same concatenation.
"""

from __future__ import annotations

import torch

from dsv4serve.parallel.collectives import Collectives
from dsv4serve.parallel.group import RankGroup


class CountedRank(Collectives):
    def __init__(self, rank: int, size: int):
        super().__init__(RankGroup.single())  # no process group: nothing is sent
        self._rank, self._size = rank, size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def _sum_in_place(self, out: torch.Tensor) -> None:
        pass  # the census counts the call; no other rank's partial is added

    def _gather_parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x] * self._size
