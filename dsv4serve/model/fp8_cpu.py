"""The FP8 activation simulation (numerics.fp8_quant_dequant) on the CPU, compiled by numba: bit for bit its torch
ops (numba_math.fp8_quant_dequant_row), in one call instead of ~12 ops (~35 us at one row of dsv4-tiny, ~25
calls a decode step: before every FP8 / FP4 projection and on the KV's nope dims).

Elementwise within each block, so batch invariance holds on either path. numba compiles on first use and keeps the
machine code in its cache; where it cannot compile, the torch ops run (logged; doctor's "CPU loops" line).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from dsv4serve.model.numba_loops import compile_loop
from dsv4serve.model.numba_math import fp8_quant_dequant_row


def _rows(x: np.ndarray, block: int, floor: np.float32, fp8_max: np.float32) -> None:  # pragma: no cover (compiled)
    """x [R, K] float32 in place, each row through fp8_quant_dequant_row."""
    scratch = np.empty(1, np.float32)
    for r in range(x.shape[0]):
        fp8_quant_dequant_row(x[r], block, floor, fp8_max, scratch)


WHAT = "FP8 activation simulation"  # its name in numba_loops' log and doctor's line


@functools.cache
def compiled() -> Callable[[np.ndarray, int, np.float32, np.float32], None] | None:
    """The compiled rows (compiled or loaded from numba's cache on the first call); None where numba cannot compile
    them on this machine (logged once): numerics then runs the torch ops."""
    sample = (np.ones((1, 2), np.float32), 1, np.float32(1e-4), np.float32(448.0))
    return compile_loop(_rows, sample, WHAT, "the torch ops run", helpers=(fp8_quant_dequant_row,))


def fp8_quant_dequant_cpu(x: torch.Tensor, block: int, floor: float, fp8_max: float) -> torch.Tensor | None:
    """x [..., K] float32 / bfloat16 on the CPU -> the same rounded to e4m3 with one ue8m0 scale per `block` channels
    (x untouched); None where the loop did not compile or x does not fit it (the caller's torch ops serve)."""
    loop = compiled()
    if loop is None or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.requires_grad:
        return None
    y = x.float().contiguous()
    if y.data_ptr() == x.data_ptr():  # fp32 contiguous x: `float()` is x itself, rounded in place below
        y = y.clone()
    loop(y.view(-1, x.shape[-1]).numpy(), block, np.float32(floor), np.float32(fp8_max))
    return y.to(x.dtype)
