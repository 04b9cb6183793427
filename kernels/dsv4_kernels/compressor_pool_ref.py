"""Torch reference of the KV compressor's gated pooling (dsv4-model.md §2.4; kernel:
`compressor_pool.compressor_pool`).

pooled[w, c] = sum_l softmax_l(score[w, :, c]) * kv[w, l, c], the softmax over the L slots of window
w, separately for each channel. L = ratio (HCA, 128) or 2 * ratio (the overlapping CSA form: window
w-1's A halves, then window w's B halves). A slot that does not exist carries score -inf (weight 0).

A channel whose every slot is -inf pools to 0. The model (`Compressor.update`) never produces such a
channel: only the first window's previous half is missing, and its own half is always finite; there
torch's softmax would give NaN, here 0, so that a padded or empty window cannot poison its neighbours.

Evaluated in fp64 and rounded once to fp32: the exact pooling, for the kernel's fp32 arithmetic to be
measured against.
"""

from __future__ import annotations

import torch


def compressor_pool_ref(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """kv, score [n_windows, L, d] fp32 -> pooled [n_windows, d] fp32."""
    score = score.double()
    top = score.amax(dim=1, keepdim=True)
    top = torch.where(torch.isinf(top), 0.0, top)  # an all -inf channel: every weight exp(-inf) = 0
    weight = torch.exp(score - top)
    total = weight.sum(dim=1)
    pooled = (weight * kv.double()).sum(dim=1)
    return torch.where(total > 0, pooled / total, 0.0).float()
