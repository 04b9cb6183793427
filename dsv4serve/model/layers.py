"""Small building blocks: the projection module and RMSNorm (statistics and weight product in fp32)."""

from __future__ import annotations

import torch
from torch import nn

from dsv4serve.model.numerics import Numerics, linear


class Linear(nn.Module):
    """A bias-free projection; `fp8_act` marks one the checkpoint stores in FP8 or FP4."""

    def __init__(self, in_dim: int, out_dim: int, fp8_act: bool):
        super().__init__()
        self.fp8_act = fp8_act
        self.weight = nn.Parameter(torch.empty(out_dim, in_dim))

    def forward(self, x: torch.Tensor, num: Numerics, x_quantized: bool = False) -> torch.Tensor:
        return linear(x, self.weight, num, self.fp8_act, x_quantized)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-vector RMS normalization without weight; statistics in fp32, result in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
