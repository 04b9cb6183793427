"""Torch reference of `dsv4_kernels.moe_combine`: the MoE layer's routed sum, addends and cast, as the model's torch
form writes them (dsv4serve/model/moe.py): a sum over the k routes in fp32, then each addend added in place in
fp32, then one cast."""

from __future__ import annotations

import torch


def moe_combine_ref(
    pairs: torch.Tensor, addends: tuple[torch.Tensor, ...] = (), out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """pairs [T, k, D], addends ([T, D], ...) -> [T, D] out_dtype."""
    y = torch.sum(pairs, dim=1, dtype=torch.float32)
    for a in addends:
        y += a  # fp32 += any float dtype: an exact upcast, then the fp32 add
    return y.to(out_dtype)
