"""fp8_linear's fused RMSNorm (`norm=`): the attention's q_norm applied in wq_b's prologue, one launch for both.

Its reference is the pair it replaces: token_ops.rms_norm (w * (x * r) rounded to bf16) then fp8_linear on that.
Only the order in which the squares are summed differs (block by block in the GEMM, the whole row at once in
token_ops), so where that sum is exact in fp32 the two agree bit for bit, and elsewhere an ulp of r can move a
normed value by one bf16 ulp and, through the FP8 rounding, an output by a few of its own."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.formats import quant_fp8_block
from dsv4_kernels.fp8_gemm import fp8_linear
from dsv4_kernels.token_ops import rms_norm

EPS = 1e-6


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[: n // 2] *= 8.0
    return quant_fp8_block(w)


def _norm_weight(k: int) -> torch.Tensor:
    return 0.5 + torch.rand(k, generator=torch.Generator().manual_seed(3))


def _pair(x: torch.Tensor, w: torch.Tensor, b, b_scale, split_k=None) -> torch.Tensor:
    return fp8_linear(rms_norm(x, w, EPS), b, b_scale, split_k=split_k)


@pytest.mark.parametrize("m, k, split_k", [(1, 384, None), (3, 384, 3), (40, 384, None), (5, 200, None)])
def test_exact_sums_give_the_pairs_bits(m: int, k: int, split_k) -> None:
    """x on a coarse grid (multiples of 1/8 up to 1): every partial sum of squares is exact in fp32, whatever
    its order, so the fused launch must equal the two launches bit for bit: decode, split, prefill tiles, and a K
    that is not whole blocks."""
    gen = torch.Generator().manual_seed(m + k)
    x = (torch.randint(-8, 9, (m, k), generator=gen).float() / 8).bfloat16()
    if m > 2:
        x[1] = 0.0  # an all-zero row: r = 1 / sqrt(eps)
    b, b_scale = _weight(96, k, seed=1)
    w = _norm_weight(k)
    fused = fp8_linear(x, b, b_scale, split_k=split_k, norm=(w, EPS))
    assert torch.equal(fused, _pair(x, w, b, b_scale, split_k))


@pytest.mark.parametrize("m", [1, 16, 40])
def test_random_rows_stay_within_the_fp8_rounding_of_the_pair(m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    x = (torch.randn(m, 1024, generator=gen) * torch.logspace(-1, 1, 1024)).bfloat16()
    b, b_scale = _weight(256, 1024, seed=2)
    w = _norm_weight(1024)
    fused, pair = fp8_linear(x, b, b_scale, norm=(w, EPS)).float(), _pair(x, w, b, b_scale).float()
    scale = pair.abs().amax(dim=1, keepdim=True)
    assert ((fused - pair).abs() <= scale * 2.0**-6).all()
    assert (fused == pair).float().mean() > 0.9  # most rows' r has the same bits either way


def test_a_fused_norm_is_refused_where_it_cannot_be_the_pairs() -> None:
    b, b_scale = _weight(128, 256, seed=4)
    w = _norm_weight(256)
    with pytest.raises(ValueError, match="bf16 x"):
        fp8_linear(torch.ones(2, 256), b, b_scale, norm=(w, EPS))  # fp32 x: the norm would store fp32
    with pytest.raises(ValueError, match="weight"):
        fp8_linear(torch.ones(2, 256).bfloat16(), b, b_scale, norm=(w[:128], EPS))
