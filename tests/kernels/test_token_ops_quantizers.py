"""The quantizer tiles the per-token chains use (dsv4_kernels.token_ops_tiles: `_fp8_blocks`, `_fp4_blocks`), alone,
in the interpreter, against torch (token_ops_ref) bit for bit: the e4m3 / e2m1 roundings (ties to even), ue8m0
scales, amax floors and clamps are integer and power-of-two arithmetic, so every bit must match on any input.
The chains around them: tests/kernels/test_token_ops.py.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dsv4_kernels.formats import E2M1_VALUES
from dsv4_kernels.testing import assert_bits_equal
from dsv4_kernels.token_ops_ref import fp4_qdq_ref, fp8_qdq_ref
from dsv4_kernels.token_ops_tiles import _fp4_blocks, _fp8_blocks


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, LIMIT: tl.constexpr, FP8: tl.constexpr, ROWS: tl.constexpr, W: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * W + tl.arange(0, W)[None, :]
    x = tl.load(x_ptr + offs)
    if FP8:
        y = _fp8_blocks(x, LIMIT, 64, ROWS, W)
    else:
        y = _fp4_blocks(x, LIMIT, ROWS, W)
    tl.store(out_ptr + offs, y)


def _grid_and_midpoints(values: torch.Tensor) -> torch.Tensor:
    """Every non-negative grid value and every midpoint between neighbours (the ties), both signs."""
    v = values.float().unique().sort().values
    v = v[torch.isfinite(v) & (v >= 0)]
    both = torch.cat((v, (v[1:] + v[:-1]) / 2))
    return torch.cat((both, -both, torch.tensor([-0.0])))


def _quantizer_rows(fp8: bool, width: int, gen: torch.Generator) -> torch.Tensor:
    """Rows (one block each) that hit every tie, both amax scale thresholds, the floor and -0.0."""
    if fp8:
        grid = _grid_and_midpoints(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn))
        top, threshold_mantissa = 448.0, 1.75
    else:
        grid = _grid_and_midpoints(torch.tensor(E2M1_VALUES))
        top, threshold_mantissa = 6.0, 1.5
    rows = []
    for scale in (2.0**-20, 2.0**-3, 1.0, 2.0**7):  # ties at several scales; amax = top * scale pins it
        for chunk in grid.split(width - 1):
            row = torch.zeros(width)
            row[: chunk.numel()] = chunk * scale
            row[-1] = top * scale
            rows.append(row)
    for exponent in (-9, 0, 13):  # amax = m 2^E at the scale thresholds, and one fp32 ulp above them
        for m in (threshold_mantissa, threshold_mantissa + 2.0**-23, 1.0, 2.0 - 2.0**-23):
            row = torch.randn(width, generator=gen) * 2.0**exponent * 0.3
            row[3] = -m * 2.0**exponent
            rows.append(row)
    rows.append(torch.randn(width, generator=gen) * 1e-6)  # below the FP8 floor (1e-4)
    rows.append(torch.zeros(width))
    rows.append(torch.full((width,), -0.0))
    rows.append(torch.randn(width, generator=gen) * 2.0**-125)  # near the FP4 floor, 6 * 2^-126
    for spread in (1.0, 1e3, 1e-3):
        rows.append(torch.randn(width, generator=gen) * torch.rand(width, generator=gen) ** 4 * spread)
    return torch.stack(rows)


@pytest.mark.parametrize("fp8", [True, False], ids=["e4m3", "e2m1"])
def test_quantizers_match_torch_bit_for_bit(fp8: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    width = 64 if fp8 else 32
    x = _quantizer_rows(fp8, width, gen)
    rows = triton.next_power_of_2(x.shape[0])
    x = torch.cat((x, torch.zeros(rows - x.shape[0], width)))
    out = torch.empty_like(x)
    _quantize_kernel[(1,)](x, out, LIMIT=width, FP8=fp8, ROWS=rows, W=width)
    ref = fp8_qdq_ref(x, 64) if fp8 else fp4_qdq_ref(x, 32)
    assert_bits_equal(out, ref)


def test_quantizer_leaves_channels_past_the_limit_and_blocks_a_partial_one() -> None:
    """LIMIT = 80 in a 128-wide tile: blocks [0, 64) and the partial [64, 80) alone; [80, 128) untouched."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 128, generator=gen) * 3
    x[1, 70] = 500.0  # a partial block's amax, not the next channels'
    out = torch.empty_like(x)
    _quantize_kernel[(1,)](x, out, LIMIT=80, FP8=True, ROWS=4, W=128)
    ref = torch.cat((fp8_qdq_ref(x[:, :80], 64), x[:, 80:]), dim=1)
    assert_bits_equal(out, ref)
