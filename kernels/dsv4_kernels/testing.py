"""Test support for the kernels: outputs poisoned with NaN, so an element a kernel leaves unwritten
fails the comparison with its reference, and a store outside the output is caught."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


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
