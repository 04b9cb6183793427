"""Test support for the kernels: outputs poisoned with NaN, so an element a kernel leaves unwritten
fails the comparison with its reference, and a store outside the output is caught; bit-for-bit equality of
bf16 / fp32 outputs; the grouped MXFP4 GEMMs' random problems and their stage check (tests/kernels/test_fp4_moe.py
says why that tolerance)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dsv4_kernels.formats import quant_fp4


def into_poisoned(
    shape: tuple[int, ...], dtype: torch.dtype, fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """fn(out) with `out` a NaN-filled view of `shape` inside a larger buffer (offset by one and padded
    by two on every axis, so its strides are not its shape's); asserts that fn stored nothing outside
    the view and returns fn's result."""
    big = torch.full([s + 3 for s in shape], float("nan"), dtype=dtype)
    inside = tuple(slice(1, s + 1) for s in shape)
    result = fn(big[inside])
    border = big.clone()
    border[inside] = 0
    assert torch.isnan(border).sum() == border.numel() - math.prod(shape), "the kernel stored outside its output"
    return result


def bits(t: torch.Tensor) -> torch.Tensor:
    """A bf16 / fp32 tensor's bits as int16 / int32 (compared, -0.0 differs from 0.0)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def assert_bits_equal(out: torch.Tensor, ref: torch.Tensor) -> None:
    """The same dtype, shape and every bit."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    differ = bits(out) != bits(ref)
    assert not differ.any(), f"{int(differ.sum())} of {out.numel()} differ, e.g. {out[differ][:4]} vs {ref[differ][:4]}"


def _fp4_experts(e: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    packed, scales = zip(*(quant_fp4(torch.randn(n, k, generator=gen) * 0.08 * (1 + i % 3)) for i in range(e)))
    return torch.stack(packed), torch.stack(scales)  # int8 [E, N, K/2], e8m0 [E, N, K/32]


def fp4_moe_problem(t: int, topk: int, e: int, d: int, i: int, seed: int, unused: int = 0):
    """Weights and routing; the last `unused` experts receive no token."""
    gen = torch.Generator().manual_seed(seed)
    w1, s1 = _fp4_experts(e, i, d, gen)
    w3, s3 = _fp4_experts(e, i, d, gen)
    w2, s2 = _fp4_experts(e, d, i, gen)
    x = (torch.randn(t, d, generator=gen) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e - unused, generator=gen)[:topk] for _ in range(t)])
    weights = torch.rand(t, topk, generator=gen) * 2.5  # already route-scaled
    return x, (w1, s1, w3, s3, w2, s2), weights, ids


def assert_fp4_stage(out: torch.Tensor, ref: torch.Tensor) -> None:
    out, ref = out.float(), ref.float()
    assert not torch.isnan(out).any(), "unwritten output elements"
    assert bool(((out - ref).abs() <= 2.0**-8 * ref.abs()).all()), f"max err {(out - ref).abs().max()}"
    assert (out == ref).float().mean() >= 0.95
    assert torch.equal(out.to(torch.bfloat16).float(), out), "outputs must be bf16 values"
