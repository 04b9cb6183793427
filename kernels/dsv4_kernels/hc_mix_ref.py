"""Torch reference of the mHC mixing (dsv4-model.md §2.1), the math of dsv4serve/model/hc.py written
out again here (kernels/ imports nothing of dsv4serve), in a chosen precision.

`dtype=torch.float32` mirrors the model's torch path: the mixes, norms and sums in fp32, the sigmoid
and softmax evaluated in fp64 and rounded back (the model's `in_fp64`). `dtype=torch.float64` runs
everything in fp64: the near-exact values the kernel tests measure the fp32 kernels' error against.
The sub-layer input `x` and the new streams are rounded to the streams' dtype either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _in_fp64(fn, x: torch.Tensor) -> torch.Tensor:
    return fn(x.double()).to(x.dtype)


def mixes_ref(h: torch.Tensor, fn: torch.Tensor, norm_eps: float, dtype: torch.dtype) -> torch.Tensor:
    """h [N, hc, D] -> (fn . flat(h)) * rsqrt(mean(flat(h)^2) + norm_eps): [N, n_mix] in `dtype`."""
    flat = h.flatten(1).to(dtype)
    rho = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return F.linear(flat, fn.to(dtype)) * rho


def sinkhorn_ref(logits: torch.Tensor, n_iters: int, eps: float) -> torch.Tensor:
    """[N, hc, hc] -> row softmax + eps, a column normalization, then n_iters - 1 row/column rounds."""
    comb = _in_fp64(lambda z: torch.softmax(z, dim=-1), logits) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(n_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_k pre[:, k] * h[:, k]: [N, hc, D] -> [N, D] in h's dtype."""
    return (pre.unsqueeze(-1) * h.to(pre.dtype)).sum(dim=1).to(h.dtype)


def hc_pre_ref(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    n_iters: int,
    hc_eps: float,
    norm_eps: float,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [N, hc, D] -> (x [N, D] in h's dtype, post [N, hc], comb [N, hc, hc] in `dtype`)."""
    hc = h.shape[1]
    m = mixes_ref(h, fn, norm_eps, dtype)
    scale, base = scale.to(dtype), base.to(dtype)
    pre = _in_fp64(torch.sigmoid, m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * _in_fp64(torch.sigmoid, m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb_logits = m[:, 2 * hc :].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc :].view(hc, hc)
    return _collapse(h, pre), post, sinkhorn_ref(comb_logits, n_iters, hc_eps)


def hc_post_ref(
    out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """new[:, k] = post[:, k] * out + sum_j comb[:, j, k] * h[:, j]: [N, hc, D] in h's dtype."""
    mixed = (comb.to(dtype).unsqueeze(-1) * h.to(dtype).unsqueeze(2)).sum(dim=1)
    return (post.to(dtype).unsqueeze(-1) * out.to(dtype).unsqueeze(1) + mixed).to(h.dtype)


def hc_head_ref(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The final collapse: h [N, hc, D] -> x [N, D] in h's dtype (fn [hc, hc * D], scale [1], base [hc])."""
    m = mixes_ref(h, fn, norm_eps, dtype)
    pre = _in_fp64(torch.sigmoid, m * scale.to(dtype) + base.to(dtype)) + hc_eps
    return _collapse(h, pre)
