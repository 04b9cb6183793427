"""The routed experts as stacks on the torch path: one batched product for the gate / up of every expert, one
for every down, when a step keeps most experts busy.

MoE._routed_torch runs three GEMMs per used expert (w1, w3, w2), each a separate call of a few rows: on the
CPU, where a batch of 16 decoding rows of dsv4-tiny uses all 8 experts of a layer, those 24 small calls and
their glue cost more than their FLOPs (0.62 ms a layer against 0.24 for one row's 2 experts). Held as
K-major stacks [E, D, 2I] (w1's columns, then w3's) and [E, I, D], the same products run as two `bmm` over the
experts, each expert's pairs padded with zero rows to the busiest expert's count (0.39 ms). K-major, because the
CPU's compiled loop (model/moe_cpu.py, which serves every step on the CPU without batch invariance) sums over K
vectorized across the outputs; MKL reads either layout (a transposed operand, no copy). Only where that padding at
most doubles the rows (`worth`): one row uses 2 of 8 experts (8 padded rows for 2), a large model's batch a
fraction of 256; there the per-expert loop reads and computes only what it uses.

The experts' own weights become views of the stacks (`stack`: no second copy; each [out, in] view K-major, as
layers.Linear.hold_k_major holds the head), so every other reader (state dict, MXFP4 packing, the per-expert loop)
sees the same tensors. The roundings are the loop's: gate
and up in the compute dtype, w2's input through act_quant, w2's product in its weight's dtype then through
fp32 to the compute dtype (numerics.reduced); the sums over D and I run in MKL's batched GEMM instead of
its single one: bit for bit the loop's with the FP8 / MXFP4 simulation on (products of few significant bits,
whose fp32 sums do not round on dsv4-tiny), within fp32 rounding without it (tests/unit/test_moe_stacked.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsv4serve.model.layers import Linear

PARTS = ("w1", "w3", "w2")  # an expert's projections, in the order of the stacks' views
PADDING_MAX = 2  # padded rows a pair at most: above it the per-expert loop does less work


@dataclass(frozen=True)
class Placement:
    """Where each pair sits in the padded stacks: expert and row, for the pairs sorted by expert."""

    at: tuple[torch.Tensor, torch.Tensor]  # ([P] expert, [P] row within the expert's padded block)
    width: int  # rows a block: the busiest expert's pairs


@dataclass(frozen=True)
class StackedExperts:
    w13: torch.Tensor  # [E, D, 2I] K-major: expert e's w1 columns, then its w3 columns (the weight's dtype)
    w2: torch.Tensor  # [E, I, D] K-major
    views: tuple[nn.Parameter, ...]  # each expert's w1, w3, w2 as `stack` made them

    def holds(self, experts: nn.ModuleList) -> bool:
        """Whether the experts' weights are still the stacks' views (a later cut or reload replaces them). Asked
        every step: it reads the modules' registries directly (~3 us for 8 experts; ~95 through `get_submodule`
        and nn.Module's attribute lookup)."""
        if 3 * len(experts) != len(self.views):
            return False
        views = iter(self.views)
        for expert in experts:
            parts = expert._modules
            for name in PARTS:
                part = parts.get(name)
                if part is None or part._parameters.get("weight") is not next(views):
                    return False
        return True

    @staticmethod
    def worth(counts: list[int]) -> bool:
        """Whether the pairs (`counts` per expert) pad to at most twice their number: every expert's block is
        as tall as the busiest's, and an idle expert's block is all zero rows."""
        return len(counts) * max(counts) <= PADDING_MAX * sum(counts)

    @property
    def inter_dim(self) -> int:
        return self.w2.shape[1]

    @staticmethod
    def place(ids: torch.Tensor, order: torch.Tensor, counts: list[int]) -> Placement:
        """ids [N, k], `order` the pairs n * k + j sorted by expert (stable), `counts` each expert's pairs."""
        by_expert = ids.flatten().index_select(0, order)  # [P] each sorted pair's expert
        starts = torch.tensor([0, *counts[:-1]], device=ids.device).cumsum(0)
        row = torch.arange(order.numel(), device=ids.device) - starts.index_select(0, by_expert)
        return Placement((by_expert, row), max(counts))

    def gate_up(self, xs: torch.Tensor, where: Placement) -> torch.Tensor:
        """Each sorted pair's input [P, D] -> its [w1 | w3] product [P, 2I] in the weights' dtype."""
        return self._product(xs, self.w13, where)

    def down(self, act: torch.Tensor, where: Placement) -> torch.Tensor:
        """Each sorted pair's w2 input [P, I] -> its w2 product [P, D] in the weights' dtype."""
        return self._product(act, self.w2, where)

    @staticmethod
    def _product(rows: torch.Tensor, stacked: torch.Tensor, where: Placement) -> torch.Tensor:
        padded = rows.new_zeros(stacked.shape[0], where.width, rows.shape[1], dtype=stacked.dtype)
        padded[where.at] = rows.to(stacked.dtype)
        return torch.bmm(padded, stacked)[where.at]


def stack(experts: nn.ModuleList) -> StackedExperts | None:
    """Re-home the experts' dense w1 / w3 / w2 in two stacks and point each expert's weights at its views.
    None (nothing changed) when the experts do not share one shape, dtype and device."""
    weights = [tuple(part.weight for part in _linears(ex)) for ex in experts]
    if not weights or any(w is None for ws in weights for w in ws):
        return None
    w1, w3, w2 = weights[0]
    if any(
        (a.shape, b.shape, c.shape) != (w1.shape, w3.shape, w2.shape)
        or {a.dtype, b.dtype, c.dtype} != {w1.dtype}
        or {a.device, b.device, c.device} != {w1.device}
        for a, b, c in weights
    ):
        return None
    inter = w1.shape[0]
    with torch.inference_mode(False), torch.no_grad():
        w13 = torch.stack([torch.cat((a.detach(), b.detach())).t() for a, b, _ in weights])  # copies: contiguous
        w2s = torch.stack([c.detach().t() for _, _, c in weights])
        views: list[nn.Parameter] = []
        for e, ex in enumerate(experts):
            for part, view in zip(_linears(ex), (w13[e, :, :inter].t(), w13[e, :, inter:].t(), w2s[e].t())):
                part.weight = nn.Parameter(view, requires_grad=False)
                views.append(part.weight)
    return StackedExperts(w13, w2s, tuple(views))


def _linears(expert: nn.Module) -> tuple[Linear, Linear, Linear]:
    """An expert's w1, w3, w2."""
    w1, w3, w2 = (expert.get_submodule(name) for name in PARTS)
    assert isinstance(w1, Linear) and isinstance(w3, Linear) and isinstance(w2, Linear)
    return w1, w3, w2
