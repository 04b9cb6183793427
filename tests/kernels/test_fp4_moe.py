"""Grouped MXFP4 expert GEMMs (dsv4_kernels.fp4_moe) in the interpreter against the torch reference
(dsv4_kernels.fp4_moe_ref), which is itself checked against the model's own Expert module.

Tolerances, and why: every product is exact (dequantized e2m1 and e4m3 values are exact in bf16 and
fp32), so kernel and reference differ only by fp32 summation order (~K * 2^-24 relative to
sum |a b|) and silu (fp32 in the kernel, fp64 rounded to fp32 in the reference, ~1 ulp). Each stage
rounds its output to bf16, so such a difference flips at most one bf16 rounding: one stage output
may differ by one bf16 ulp (2^-8 relative to |ref|). We also require 95% of the elements to be
bit-identical, which a mis-scaled or mis-ordered tile could not meet. End to end, an act value one
bf16 ulp off can flip its FP8 rounding (2^-3 relative, rare) before w2; the end-to-end bound is
therefore 2^-6 relative to sum_j |y_j| (the token's k expert outputs) plus 2^-8 |ref|, and the
stage tests carry the strict checks. All outputs go into NaN-poisoned buffers.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.formats import dequant_fp4, quant_fp4
from dsv4_kernels.fp4_moe import fp4_moe, fp4_moe_gemm, moe_align, store_dtype
from dsv4_kernels.fp4_moe_ref import down_ref, fp4_moe_ref, gate_up_ref
from dsv4_kernels.fp8_gemm_ref import act_quant_fp8_ref
from dsv4serve.model.moe import Expert
from dsv4serve.model.numerics import NUMERICS_ON

LIMIT = 0.75  # small enough that the clamps bite with these magnitudes


def _experts(e: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    packed, scales = zip(*(quant_fp4(torch.randn(n, k, generator=gen) * 0.08 * (1 + i % 3)) for i in range(e)))
    return torch.stack(packed), torch.stack(scales)  # int8 [E, N, K/2], e8m0 [E, N, K/32]


def _problem(t: int, topk: int, e: int, d: int, i: int, seed: int, unused: int = 0):
    """Weights and routing; the last `unused` experts receive no token."""
    gen = torch.Generator().manual_seed(seed)
    w1, s1 = _experts(e, i, d, gen)
    w3, s3 = _experts(e, i, d, gen)
    w2, s2 = _experts(e, d, i, gen)
    x = (torch.randn(t, d, generator=gen) * 2).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e - unused, generator=gen)[:topk] for _ in range(t)])
    weights = torch.rand(t, topk, generator=gen) * 2.5  # already route-scaled
    return x, (w1, s1, w3, s3, w2, s2), weights, ids


def _poison(rows: int, cols: int) -> torch.Tensor:
    return torch.full((rows, cols), float("nan"), dtype=store_dtype())


def _assert_stage(out: torch.Tensor, ref: torch.Tensor) -> None:
    out, ref = out.float(), ref.float()
    assert not torch.isnan(out).any(), "unwritten output elements"
    assert bool(((out - ref).abs() <= 2.0**-8 * ref.abs()).all()), f"max err {(out - ref).abs().max()}"
    assert (out == ref).float().mean() >= 0.95
    assert torch.equal(out.to(torch.bfloat16).float(), out), "outputs must be bf16 values"


# (T, k, E, D, I, unused experts, block_m, block_k): decode (T=1), a decode batch, a prefill with
# experts that get no token; D=160 and I=96 are multiples of 32 but not of 128 or the 64-wide N tile
CASES = [
    (1, 2, 4, 160, 96, 0, 16, 128),
    (3, 3, 6, 128, 64, 2, 16, 64),
    (20, 2, 5, 160, 96, 1, 16, 128),
]


@pytest.mark.parametrize(("t", "topk", "e", "d", "i", "unused", "bm", "bk"), CASES)
def test_stages_match_reference(t, topk, e, d, i, unused, bm, bk) -> None:
    x, (w1, s1, w3, s3, w2, s2), weights, ids = _problem(t, topk, e, d, i, seed=t + e, unused=unused)
    slots = t * topk
    sorted_ids, expert_ids = moe_align(ids, e, bm, num_blocks=-(-slots // bm) + min(slots, e))  # + skipped blocks
    assert (expert_ids == -1).any()
    x_q, x_s = act_quant_fp8_ref(x)
    act = fp4_moe_gemm(
        x_q,
        x_s,
        w1,
        s1,
        sorted_ids,
        expert_ids,
        slots,
        topk,
        w3=w3,
        w3_scale=s3,
        topk_weights=weights,
        limit=LIMIT,
        block_m=bm,
        block_k=bk,
        out=_poison(slots, i),
    )
    act_ref = gate_up_ref(x_q, x_s, w1, s1, w3, s3, weights, ids, LIMIT)
    _assert_stage(act, act_ref)
    a_q, a_s = act_quant_fp8_ref(act_ref)  # the down stage is checked on the reference's own input
    y = fp4_moe_gemm(a_q, a_s, w2, s2, sorted_ids, expert_ids, slots, 1, block_m=bm, block_k=bk, out=_poison(slots, d))
    _assert_stage(y, down_ref(a_q, a_s, w2, s2, ids))


@pytest.mark.parametrize("limit", [LIMIT, 0.0])
@pytest.mark.parametrize(
    ("t", "topk", "e", "d", "i", "unused", "bm", "bk"), [CASES[0], CASES[2], (20, 2, 5, 160, 96, 1, 64, 128)]
)  # last: the prefill tile
def test_moe_end_to_end(t, topk, e, d, i, unused, bm, bk, limit) -> None:
    x, w, weights, ids = _problem(t, topk, e, d, i, seed=5 * t + e, unused=unused)
    outs = (_poison(t * topk, i), _poison(t * topk, d))
    out = fp4_moe(x, *w, weights, ids, limit, block_m=bm, block_k=bk, outs=outs)
    ref = fp4_moe_ref(x, *w, weights, ids, limit)
    assert out.shape == (t, d) and out.dtype == torch.float32 and not torch.isnan(out).any()
    per_slot = (
        down_ref(*act_quant_fp8_ref(gate_up_ref(*act_quant_fp8_ref(x), *w[:4], weights, ids, limit)), *w[4:], ids)
        .float()
        .abs()
        .view(t, topk, d)
        .sum(1)
    )
    assert bool(((out - ref).abs() <= 2.0**-6 * per_slot + 2.0**-8 * ref.abs()).all())


def test_reference_follows_model_expert() -> None:
    """Oracle for the reference: dsv4serve.model.moe.Expert with the dequantized weights, combined as
    MoE.forward does (index_add over experts in fp32). Both paths are exact up to fp32 order."""
    t, topk, e, d, i = 6, 2, 4, 160, 96
    x, (w1, s1, w3, s3, w2, s2), weights, ids = _problem(t, topk, e, d, i, seed=11, unused=1)
    ref = fp4_moe_ref(x, w1, s1, w3, s3, w2, s2, weights, ids, LIMIT)
    xq = act_quant_fp8_ref(x)
    x_deq = (xq[0].float() * xq[1].repeat_interleave(128, 1)[:, :d]).to(torch.bfloat16)
    model = torch.zeros(t, d)
    for ex in range(e):
        expert = Expert(d, i, LIMIT)
        for name, packed, scale in (("w1", w1, s1), ("w2", w2, s2), ("w3", w3, s3)):
            getattr(expert, name).weight.data = dequant_fp4(packed[ex], scale[ex])
        rows, slot = torch.where(ids == ex)
        if len(rows):
            model.index_add_(0, rows, expert(x_deq[rows], NUMERICS_ON, weights[rows, slot, None]).float())
    assert bool(((model - ref).abs() <= 2.0**-6 * model.abs().amax() + 2.0**-8 * model.abs()).all())
    assert (model == ref).float().mean() >= 0.9


def test_moe_align_layout() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # expert 1 has no token
    sorted_ids, expert_ids = moe_align(ids, num_experts=4, block_m=2, num_blocks=5)
    assert expert_ids.tolist() == [0, 2, 2, 3, -1]
    pad = ids.numel()
    assert sorted_ids.tolist() == [1, 4, 0, 2, 5, pad, 3, pad, pad, pad]  # slot = token * k + j
    with pytest.raises(ValueError):
        moe_align(ids, num_experts=4, block_m=2, num_blocks=3)
