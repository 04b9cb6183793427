"""Lightning indexer (dsv4-model.md §2.5): picks the top-k compressed entries for CSA queries.

score[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]), over entries visible to t; the indexer keys come
from its own overlapping compressor (`indexer.compressor`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4serve.model.args import ModelArgs
from dsv4serve.model.compressor import Compressor
from dsv4serve.model.layers import Linear, Normed
from dsv4serve.model.numerics import FP4_BLOCK, Numerics, fp4_quant_dequant, hadamard
from dsv4serve.model.rope import Rotation


class Indexer(nn.Module):
    def __init__(self, args: ModelArgs, ratio: int):
        super().__init__()
        self.n_heads, self.head_dim, self.index_topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, fp8_act=True)
        self.weights_proj = Linear(args.dim, self.n_heads, fp8_act=False)
        self.compressor = Compressor(args, ratio, self.head_dim, rotate=True)
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5
        # the head weights project the compressor's input: on Triton they ride in its projection's launch
        self.compressor.carry_tail(self.weights_proj, self.weight_scale)

    def queries(
        self,
        x: torch.Tensor,
        qr: torch.Tensor | Normed,
        rot: Rotation,
        num: Numerics,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D], qr [N, q_lora] (or the attention's q_norm still to apply: layers.Normed) -> (q [N, H_I, d_I]
        compute dtype, head weights [N, H_I] fp32). `weights`: the head weights already computed (the
        compressor's `project_with_tail`), else they are computed here."""
        q = self.wq_b(qr, num).unflatten(-1, (self.n_heads, self.head_dim))
        if rot.angles is not None:  # one launch: RoPE, Hadamard, FP4
            from dsv4_kernels.token_ops import indexer_q

            q = indexer_q(q, rot.angles, num.indexer_fp4)
        else:
            q = rot.apply(q)
            if num.indexer_fp4:
                q = fp4_quant_dequant(hadamard(q), FP4_BLOCK)
        if weights is None:
            weights = self.weights_proj(x, num).float() * self.weight_scale
        return q, weights

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """q [T, H_I, d_I], weights [T, H_I], keys [S, d_I], visible [T, S] -> chosen [T, S] bool.

        Scores are accumulated in fp32. Each query keeps its top `index_topk` visible entries; equal
        scores (common: ReLU zeros, FP4-quantized q and k) go to the earlier entry, so the choice does
        not depend on how many not-yet-visible entries a chunk holds.
        """
        n_entries = keys.shape[0]
        if n_entries == 0:
            return visible
        # an elementwise product and a last-dim sum: each score independent of how many keys exist
        scores = (q.float().unsqueeze(2) * keys.float()).sum(dim=-1).relu_()  # [T, H_I, S]
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [T, S]
        scores = scores.masked_fill(~visible, float("-inf"))
        top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : self.index_topk]
        chosen = torch.zeros_like(visible).scatter_(1, top, True)
        return chosen & visible

    def as_indices(self, chosen: torch.Tensor) -> torch.Tensor:
        """A choice chosen [T, S] bool (at most `index_topk` a row) -> [T, index_topk] int32 entry
        indices in ascending order, -1 padded: the indexer_topk kernel's output layout."""
        n_entries = chosen.shape[1]
        cols = torch.arange(n_entries, device=chosen.device).expand_as(chosen)
        order = torch.where(chosen, cols, cols + n_entries).sort(dim=1).values[:, : self.index_topk]
        order = torch.where(order < n_entries, order, -1)
        return F.pad(order, (0, self.index_topk - order.shape[1]), value=-1).to(torch.int32)

    @staticmethod
    def chosen(top: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Entry indices top [T, K] (-1 padded, as `as_indices` or the kernel give them), visible [T, S]
        -> the chosen visible entries [T, S] bool. A -1 marks fewer than K visible entries, all chosen."""
        if visible.shape[1] == 0:
            return visible
        return torch.zeros_like(visible).scatter_(1, top.long().clamp_min(0), True) & visible
