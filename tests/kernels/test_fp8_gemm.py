"""FP8 block-scaled projection (dsv4_kernels.fp8_gemm) in the interpreter against its torch reference.

Two forms, one kernel: `fp8_linear` quantizes bf16 / fp32 activations inside the GEMM (what the model
runs), `fp8_gemm` takes them pre-quantized. The quantization must give the reference's bytes
(`act_quant_fp8_ref`): checked exactly through an identity weight (the output is then the
quantize-dequantize itself, exact in bf16), on the kernel's bit helpers against torch, and by the fused
form equalling the two-step form bit for bit (same bytes, same sum order in the same tiles).

Tolerance against the reference sum, and why: every product of two dequantized e4m3 values is exact
in fp32, so the kernel's fp32 result differs from the exact sum only by fp32 summation order, at most
gamma_K * sum_k |a_k b_k| with gamma_K ~ K * 2^-24 (doubled here for margin); the bf16 output adds
at most half an ulp, 2^-9 |ref|, and we allow one ulp (2^-8 |ref|) since the exact value can sit
on a rounding boundary. The reference is the exact sum (fp64) of the same dequantized operands.
Each run writes into a NaN-poisoned view of a larger buffer: an element left unwritten fails the
match, a store outside the view fails the untouched-border check.
"""

from __future__ import annotations

import collections

import pytest
import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4_kernels.formats import FP8_MAX, dequant_fp8_block, pow2_ceil, quant_fp8_block
from dsv4_kernels.fp8_gemm import AMAX_FLOOR, _pow2_scale, _round_to_e4m3, fp8_gemm, fp8_linear, store_dtype
from dsv4_kernels.fp8_gemm_ref import (
    FP8_AMAX_FLOOR,
    act_quant_fp8_ref,
    dequant_act_fp8_ref,
    fp8_gemm_ref,
    fp8_linear_ref,
)
from dsv4_kernels.testing import into_poisoned
from dsv4serve.model.numerics import NUMERICS_ON, fp8_quant_dequant, linear


def _activations(m: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Per-block magnitudes from 1e-2 to 10, one all-zero row and one huge row (scales near 2^100; the
    products still fit in fp32 and bf16)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 1, k)
    if m > 2:
        x[1] = 0.0
        x[2] *= 2.0**100
    return x.to(dtype)


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[: n // 2] *= 8.0  # weight blocks with different e8m0 scales
    return quant_fp8_block(w)


def _bound(a, a_scale, b, b_scale, ref: torch.Tensor) -> torch.Tensor:
    k = a.shape[1]
    mag = dequant_act_fp8_ref(a, a_scale).abs() @ dequant_fp8_block(b, b_scale).abs().t()
    return 2.0**-8 * ref.abs() + 2 * k * 2.0**-24 * mag + 1e-30


def _poisoned(m: int, n: int, fn) -> torch.Tensor:
    return into_poisoned((m, n), store_dtype(), fn)


# (M, N, K): decode m=1 with ragged N and K (300 = 2 blocks + 44, 200 = 128 + 72), exact blocks,
# a decode batch over one 16-row tile (17), and a prefill shape (the 64-row, unswapped path)
SHAPES = [(1, 300, 200), (4, 128, 128), (17, 130, 384), (70, 200, 264)]


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_fp8_gemm_matches_reference(m: int, n: int, k: int) -> None:
    """The pre-quantized form against the exact sum."""
    a, a_scale = act_quant_fp8_ref(_activations(m, k, seed=m * 7 + n))
    b, b_scale = _weight(n, k, seed=n)
    out = _poisoned(m, n, lambda o: fp8_gemm(a, a_scale, b, b_scale, out=o))
    ref = fp8_gemm_ref(a, a_scale, b, b_scale)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert not torch.isnan(out).any()
    err = (out.float() - ref).abs()
    assert bool((err <= _bound(a, a_scale, b, b_scale, ref)).all()), f"max err {err.max().item()}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_fp8_linear_fused_matches_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    """The fused form: within the bound of `fp8_linear_ref`, and bit for bit the two-step form (torch
    quantization, then the pre-quantized kernel in the same tiles): same bytes, same sum order."""
    x = _activations(m, k, seed=m + k, dtype=dtype)
    b, b_scale = _weight(n, k, seed=n + 1)
    out = _poisoned(m, n, lambda o: fp8_linear(x, b, b_scale, out=o))
    a, a_scale = act_quant_fp8_ref(x)
    ref = fp8_gemm_ref(a, a_scale, b, b_scale)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n) and not torch.isnan(out).any()
    assert bool(((out.float() - ref).abs() <= _bound(a, a_scale, b, b_scale, ref)).all())
    assert torch.equal(out, fp8_gemm(a, a_scale, b, b_scale))


def _quant_probe(k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows that hit every quantization corner: ties at normal and subnormal e4m3 values (round to
    even), amax exactly 448 * 2^e and one bf16 ulp above it (the scale's power steps there), values
    far below their block's amax (rounding to e4m3 subnormals or zero), zeros, the amax floor, huge."""
    gen = torch.Generator().manual_seed(k)
    rows = torch.randn(8, k, generator=gen) * torch.logspace(-3, 3, k)
    ties = torch.tensor([1.0625, 1.1875, 1.5 * 2**-9, 0.5 * 2**-9, 2.5 * 2**-9, 440.0, 13.0, -7.5])
    rows[0, : len(ties)], rows[0, len(ties)] = ties, 448.0  # scale 1: the ties stay ties
    rows[1, 0], rows[1, 1:] = 448.0 * 2**-3, rows[1, 1:].clamp(-1, 1) * 2**-12
    rows[2, 0] = 448.0 * 2**-3 * (1 + 2**-7)  # one bf16 ulp above: the scale doubles
    rows[3] = 0.0
    rows[4] = torch.randn(k, generator=gen) * 1e-6  # below the floor: scale 2^-22
    rows[5] *= 2.0**100
    rows[6, ::2] = -rows[6, ::2].abs()
    return rows.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [200, 256])
def test_fused_quantization_is_the_references(k: int, dtype: torch.dtype) -> None:
    """With the identity as weight (e4m3 256 with scale 2^-8: exact) the output is the quantized
    activation itself, exact in bf16: it must be the model's quantize-dequantize, bit for bit."""
    x = _quant_probe(k, dtype)
    eye, eye_scale = quant_fp8_block(torch.eye(k))
    for m, blocks in ((8, None), (1, None), (8, (64, 128, False))):  # decode (swapped) and prefill tiles
        rows = x[:m]
        out = _poisoned(
            m, k, lambda o, rows=rows, blocks=blocks: fp8_linear(rows, eye, eye_scale, blocks=blocks, out=o)
        )
        assert torch.equal(out, fp8_quant_dequant(rows.float(), 128).to(torch.bfloat16)), (m, blocks)
        assert torch.equal(out, fp8_linear_ref(rows, eye, eye_scale))


@triton.jit
def _helpers_kernel(v_ptr, rounded_ptr, scale_ptr, inv_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    v = tl.load(v_ptr + offs, mask=ok, other=0.0)
    tl.store(rounded_ptr + offs, _round_to_e4m3(v), mask=ok)
    scale, inv = _pow2_scale(tl.maximum(tl.abs(v), AMAX_FLOOR))
    tl.store(scale_ptr + offs, scale, mask=ok)
    tl.store(inv_ptr + offs, inv, mask=ok)


def test_bit_helpers_match_torch() -> None:
    """The kernel's e4m3 rounding against torch's cast (round to nearest even) on every e4m3 value,
    every midpoint and its neighbours; its scale rule against the reference's pow2_ceil(amax / 448)."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid.abs() <= FP8_MAX)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    v = torch.cat([grid, mids, mids.nextafter(grid[1:]), mids.nextafter(grid[:-1])])
    v = torch.cat([v, torch.randn(4096) * torch.logspace(-12, 2.6, 4096)]).clamp(-FP8_MAX, FP8_MAX)
    amax_edges = torch.tensor([448.0 * 2.0**e for e in range(-22, 40)])  # 448 2^e and its fp32 neighbours
    v = torch.cat([v, amax_edges, amax_edges.nextafter(amax_edges * 2), amax_edges.nextafter(amax_edges * 0)])
    v = torch.cat([v, torch.tensor([FP8_AMAX_FLOOR, 1e-30, 3e38])])
    rounded, scale, inv = (torch.empty_like(v) for _ in range(3))
    _helpers_kernel[(triton.cdiv(v.numel(), 4096),)](v, rounded, scale, inv, v.numel(), BLOCK=4096)
    small = v.abs() <= FP8_MAX
    assert torch.equal(rounded[small], v[small].to(torch.float8_e4m3fn).float())
    assert torch.equal(torch.signbit(rounded[small]), torch.signbit(v[small]))
    want = pow2_ceil(v.abs().clamp_min(FP8_AMAX_FLOOR) / FP8_MAX)
    assert torch.equal(scale, want) and torch.equal(inv, 1.0 / want)


class _LaunchCount(TorchDispatchMode):
    """aten ops that run a device kernel (allocations and views excluded) and Triton launches."""

    NO_KERNEL = {"empty.memory_format", "view.default", "view.dtype", "detach.default", "alias.default"}

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.launches = 0
        self.in_launch = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_launch and func.__name__ not in self.NO_KERNEL:
            self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_fp8_linear_is_one_launch(monkeypatch) -> None:
    """The decode budget: one projection, one launch. Under the interpreter the wrapper adds only the
    fp32 -> bf16 cast of the output (a GPU build stores bf16); the two-step path ran ~17 torch ops."""
    from triton.runtime.interpreter import InterpretedFunction

    x = _activations(1, 256, seed=5)
    b, b_scale = _weight(256, 256, seed=5)
    count, run = _LaunchCount(), InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        count.launches += 1
        count.in_launch = True  # the interpreter's own tensor handling is not the wrapper's
        try:
            return run(self, *args, **kwargs)
        finally:
            count.in_launch = False

    monkeypatch.setattr(InterpretedFunction, "run", counted_run)
    with count:
        fp8_linear(x, b, b_scale)
    assert count.launches == 1 and dict(count.ops) == {"_to_copy.default": 1}, (count.launches, count.ops)


def test_act_quant_ref_matches_model_numerics() -> None:
    """The reference's activation quantization is the model's FP8 simulation, bit for bit."""
    x = (torch.randn(3, 200) * 5).to(torch.bfloat16)
    q, s = act_quant_fp8_ref(x)
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
    a, a_scale = act_quant_fp8_ref(x)
    bound = _bound(a, a_scale, b, b_scale, model.float()) * 2  # both sides round to bf16
    assert bool(((ours.float() - model.float()).abs() <= bound).all())


@pytest.mark.parametrize("blocks", [(16, 64, True), (16, 64, False), (32, 128, False), (64, 128, True)])
def test_tile_forms_agree(blocks) -> None:
    """Both the swapped (decode) and the plain form, at several tiles, on one ragged shape, both forms."""
    x = _activations(5, 160, seed=3)
    b, b_scale = _weight(150, 160, seed=3)
    a, a_scale = act_quant_fp8_ref(x)
    ref = fp8_gemm_ref(a, a_scale, b, b_scale)
    out = _poisoned(5, 150, lambda o: fp8_gemm(a, a_scale, b, b_scale, blocks=blocks, out=o))
    assert bool(((out.float() - ref).abs() <= _bound(a, a_scale, b, b_scale, ref)).all())
    assert torch.equal(_poisoned(5, 150, lambda o: fp8_linear(x, b, b_scale, blocks=blocks, out=o)), out)


@pytest.mark.parametrize(("m", "n", "k", "split_k"), [(1, 300, 256, 1), (3, 130, 512, 2), (70, 200, 264, 1)])
def test_fp32_out_is_the_unrounded_accumulator(m: int, n: int, k: int, split_k: int) -> None:
    """out_dtype fp32 (a tensor-parallel rank's row-parallel partial, cast after the sum over ranks): the fp32
    accumulator, within the fp32 summation bound of the exact sum (no bf16 term), rounding to the bf16 form bit for
    bit (split-K too); and two ranks' halves of K, summed in fp32, stay within that bound of the whole (where two
    bf16-rounded halves would add up to an ulp each)."""
    x = _activations(m, k, seed=m + n)
    b, b_scale = _weight(n, k, seed=n + 2)
    out = into_poisoned((m, n), torch.float32, lambda o: fp8_linear(x, b, b_scale, out=o, out_dtype=torch.float32))
    a, a_scale = act_quant_fp8_ref(x)
    ref = fp8_gemm_ref(a, a_scale, b, b_scale)
    mag = dequant_act_fp8_ref(a, a_scale).abs() @ dequant_fp8_block(b, b_scale).abs().t()
    fp32_bound = 2 * k * 2.0**-24 * mag + 1e-30
    assert out.dtype == torch.float32 and bool(((out - ref).abs() <= fp32_bound).all())
    split = fp8_linear(x, b, b_scale, split_k=split_k, out_dtype=torch.float32)
    assert torch.equal(split.to(torch.bfloat16), fp8_linear(x, b, b_scale, split_k=split_k))
    half = 128 * (-(-k // 128) // 2)  # a 128-block boundary: where a row-parallel split cuts K
    halves = [fp8_linear(x[:, s], b[:, s], b_scale[:, c], out_dtype=torch.float32)
              for s, c in ((slice(0, half), slice(0, half // 128)), (slice(half, k), slice(half // 128, None)))]  # fmt: skip
    assert bool(((halves[0] + halves[1] - ref).abs() <= fp32_bound).all())
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_linear(x, b, b_scale, out_dtype=torch.float16)


def test_rejects_mismatched_operands() -> None:
    a, a_scale = act_quant_fp8_ref(_activations(2, 200, seed=1))
    b, b_scale = _weight(130, 200, seed=1)
    with pytest.raises(ValueError):
        fp8_gemm(a, a_scale[:, :1], b, b_scale)
    with pytest.raises(TypeError):  # e4m3 without its scales: only the pre-quantized form takes it
        fp8_linear(a, b, b_scale)
    with pytest.raises(ValueError):
        fp8_linear(_activations(2, 199, seed=1), b, b_scale)
