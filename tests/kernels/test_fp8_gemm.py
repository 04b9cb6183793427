"""FP8 block-scaled GEMM (dsv4_kernels.fp8_gemm) in the interpreter against its torch reference.

Tolerance, and why: every product of two dequantized e4m3 values is exact in fp32, so the kernel's
fp32 result differs from the exact sum only by fp32 summation order, at most
gamma_K * sum_k |a_k b_k| with gamma_K ~ K * 2^-24 (doubled here for margin); the bf16 output adds
at most half an ulp, 2^-9 |ref|, and we allow one ulp (2^-8 |ref|) since the exact value can sit
on a rounding boundary. The reference is the exact sum (fp64) of the same dequantized operands.
Each run writes into a NaN-poisoned view of a larger buffer: an element left unwritten fails the
match, a store outside the view fails the untouched-border check.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.formats import dequant_fp8_block, quant_fp8_block
from dsv4_kernels.fp8_gemm import act_quant_fp8, fp8_gemm, fp8_linear, store_dtype
from dsv4_kernels.fp8_gemm_ref import dequant_act_fp8_ref, fp8_gemm_ref
from dsv4_kernels.testing import into_poisoned
from dsv4serve.model.numerics import NUMERICS_ON, fp8_quant_dequant, linear


def _operands(m: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)  # per-block scales differ
    w = torch.randn(n, k, generator=gen) * 0.05
    w[: n // 2] *= 8.0  # weight blocks with different e8m0 scales
    b, b_scale = quant_fp8_block(w)
    a, a_scale = act_quant_fp8(x.to(torch.bfloat16))
    return a, a_scale, b, b_scale


def _bound(a, a_scale, b, b_scale, ref: torch.Tensor) -> torch.Tensor:
    k = a.shape[1]
    mag = dequant_act_fp8_ref(a, a_scale).abs() @ dequant_fp8_block(b, b_scale).abs().t()
    return 2.0**-8 * ref.abs() + 2 * k * 2.0**-24 * mag + 1e-30


def _run_poisoned(a, a_scale, b, b_scale, blocks=None) -> torch.Tensor:
    return into_poisoned(
        (a.shape[0], b.shape[0]), store_dtype(), lambda out: fp8_gemm(a, a_scale, b, b_scale, blocks=blocks, out=out)
    )


# (M, N, K): decode m=1 with ragged N and K (300 = 2 blocks + 44, 200 = 128 + 72), exact blocks,
# a decode batch over one 16-row tile (17), and a prefill shape (the 64-row, unswapped path)
SHAPES = [(1, 300, 200), (4, 128, 128), (17, 130, 384), (70, 200, 264)]


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_fp8_gemm_matches_reference(m: int, n: int, k: int) -> None:
    a, a_scale, b, b_scale = _operands(m, n, k, seed=m * 7 + n)
    out = _run_poisoned(a, a_scale, b, b_scale)
    ref = fp8_gemm_ref(a, a_scale, b, b_scale)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert not torch.isnan(out).any()
    err = (out.float() - ref).abs()
    assert bool((err <= _bound(a, a_scale, b, b_scale, ref)).all()), f"max err {err.max().item()}"


@pytest.mark.parametrize("blocks", [(16, 64, True), (16, 64, False), (32, 128, False), (64, 128, True)])
def test_fp8_gemm_tile_forms_agree(blocks) -> None:
    """Both the swapped (decode) and the plain form, at several tiles, on one ragged shape."""
    a, a_scale, b, b_scale = _operands(5, 150, 160, seed=3)
    out = _run_poisoned(a, a_scale, b, b_scale, blocks=blocks)
    ref = fp8_gemm_ref(a, a_scale, b, b_scale)
    assert bool(((out.float() - ref).abs() <= _bound(a, a_scale, b, b_scale, ref)).all())


def test_act_quant_matches_model_numerics() -> None:
    """The wrapper's activation quantization is the model's FP8 simulation, bit for bit."""
    x = (torch.randn(3, 200) * 5).to(torch.bfloat16)
    q, s = act_quant_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    assert torch.equal(torch.frexp(s).mantissa, torch.full_like(s, 0.5))  # powers of two
    assert torch.equal(dequant_act_fp8_ref(q, s).to(torch.bfloat16), fp8_quant_dequant(x, 128))


@pytest.mark.parametrize(("m", "n", "k"), [(1, 300, 200), (6, 256, 256)])
def test_fp8_linear_matches_model_linear(m: int, n: int, k: int) -> None:
    """Independent oracle: dsv4serve.model.numerics.linear on the dequantized weight (what the model's
    FP8 projections run). Same tolerance; the model's matmul runs in fp32 too."""
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b, b_scale = quant_fp8_block(torch.randn(n, k, generator=gen) * 0.1)
    ours = fp8_linear(x, b, b_scale)
    model = linear(x, dequant_fp8_block(b, b_scale), NUMERICS_ON, fp8_act=True)
    a, a_scale = act_quant_fp8(x)
    bound = _bound(a, a_scale, b, b_scale, model.float()) * 2  # both sides round to bf16
    assert bool(((ours.float() - model.float()).abs() <= bound).all())


def test_fp8_gemm_rejects_mismatched_scales() -> None:
    a, a_scale, b, b_scale = _operands(2, 130, 200, seed=1)
    with pytest.raises(ValueError):
        fp8_gemm(a, a_scale[:, :1], b, b_scale)
