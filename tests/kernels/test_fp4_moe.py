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

The fused quantizations are checked bitwise against the reference quantizer on the kernel's own
unfused output (same tiles, same sums): x quantized in the K loop (a raw bf16 input gives the very
bytes of the pre-quantized form) and act quantized in the gate/up epilogue (== act_quant_fp8_ref of
the bf16 act). The route layout (moe_align, one device launch) must equal moe_align_ref exactly and
make no host sync. Experts read from slots (the expert-slot cache's second source) must give the
bits of the same experts read from the stacked weights, whatever the mix.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.formats import dequant_fp4
from dsv4_kernels.fp4_moe import fp4_moe_gemm, store_dtype
from dsv4_kernels.fp4_moe_layer import ExpertSlots, fp4_moe
from dsv4_kernels.fp4_moe_ref import down_ref, fp4_moe_ref, gate_up_ref, moe_align_ref
from dsv4_kernels.fp8_gemm_ref import act_quant_fp8_ref
from dsv4_kernels.launch_guard import HostSync, launch_guard
from dsv4_kernels.moe_align import align_blocks, moe_align
from dsv4_kernels.testing import assert_fp4_stage as _assert_stage
from dsv4_kernels.testing import fp4_moe_problem as _problem
from dsv4serve.model.moe import Expert
from dsv4serve.model.numerics import NUMERICS_ON

LIMIT = 0.75  # small enough that the clamps bite with these magnitudes


def _poison(rows: int, cols: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.full((rows, cols), float("nan"), dtype=dtype or store_dtype())


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
    sorted_ids, expert_ids = moe_align(ids, e, bm)
    assert (expert_ids == -1).any()  # the fixed block count leaves blocks the kernel skips
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


@pytest.mark.parametrize(("t", "topk", "e", "d", "i", "bm"), [(1, 2, 4, 160, 96, 16), (5, 3, 6, 128, 256, 64)])
def test_fused_quantizations_are_the_reference_quantizer(t, topk, e, d, i, bm) -> None:
    """x quantized in the K loop and act quantized in the epilogue, bitwise as act_quant_fp8_ref would
    on the same values (block_n 128 in both runs: the same tiles, so the same sums)."""
    x, (w1, s1, w3, s3, _, _), weights, ids = _problem(t, topk, e, d, i, seed=3 * t + i)
    routes = t * topk
    sorted_ids, expert_ids = moe_align(ids, e, bm)
    common = dict(w3=w3, w3_scale=s3, topk_weights=weights, limit=LIMIT, block_m=bm, block_n=128, block_k=64)
    args = (w1, s1, sorted_ids, expert_ids, routes, topk)
    act = fp4_moe_gemm(*act_quant_fp8_ref(x), *args, **common, out=_poison(routes, i))
    act_raw_x = fp4_moe_gemm(x, None, *args, **common, out=_poison(routes, i))
    assert torch.equal(act_raw_x, act)
    ref_q, ref_s = act_quant_fp8_ref(act)
    q, s = fp4_moe_gemm(
        x,
        None,
        *args,
        **common,
        quant_out=True,
        out=_poison(routes, i, torch.float8_e4m3fn),
        out_scale=_poison(routes, -(-i // 128), torch.float32),
    )
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)


def _outs(t: int, topk: int, d: int, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    routes = t * topk
    return (_poison(routes, i, torch.float8_e4m3fn), _poison(routes, -(-i // 128), torch.float32), _poison(routes, d))


@pytest.mark.parametrize("limit", [LIMIT, 0.0])
@pytest.mark.parametrize(
    ("t", "topk", "e", "d", "i", "unused", "bm", "bk"), [CASES[0], CASES[2], (20, 2, 5, 160, 96, 1, 64, 128)]
)  # last: the prefill tile
def test_moe_end_to_end(t, topk, e, d, i, unused, bm, bk, limit) -> None:
    x, w, weights, ids = _problem(t, topk, e, d, i, seed=5 * t + e, unused=unused)
    out = fp4_moe(x, *w, weights, ids, limit, block_m=bm, block_k=bk, outs=_outs(t, topk, d, i))
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


def _slotted(w: tuple[torch.Tensor, ...], in_slots: list[int], n_slots: int, e: int, gen: torch.Generator):
    """(bank, slots): the experts `in_slots` copied into random slots of n_slots, their bank copies
    overwritten with other random bytes (a read of the wrong source shows); unused slots random too."""
    slot_of = torch.full((e,), -1, dtype=torch.int32)
    where = torch.randperm(n_slots, generator=gen)[: len(in_slots)].tolist()
    parts, bank = [], []
    for t in w:
        raw = t.view(torch.uint8)
        slots = torch.randint(0, 256, (n_slots, *t.shape[1:]), generator=gen, dtype=torch.uint8)
        b = raw.clone()
        for ex, s in zip(in_slots, where):
            slots[s] = raw[ex]
            b[ex] = torch.randint(0, 256, raw[ex].shape, generator=gen, dtype=torch.uint8)
        parts.append(slots.view(t.dtype))
        bank.append(b.view(t.dtype))
    for ex, s in zip(in_slots, where):
        slot_of[ex] = s
    return tuple(bank), ExpertSlots(slot_of, tuple(parts))


@pytest.mark.parametrize(
    ("t", "topk", "e", "in_slots", "bm"),
    [(1, 2, 4, [1], 16), (1, 2, 4, [0, 1, 2, 3], 16), (7, 3, 6, [], 16), (7, 3, 6, [0, 2, 5], 16), (20, 2, 5, [4], 64)],
    ids=["decode-mixed", "every-slot", "every-bank", "ragged-mixed", "prefill-tile"],
)
def test_slots_and_bank_give_the_bits_of_resident_experts(t, topk, e, in_slots, bm) -> None:
    d, i = 128, 96
    x, w, weights, ids = _problem(t, topk, e, d, i, seed=7 * t + len(in_slots))
    resident = fp4_moe(x, *w, weights, ids, LIMIT, block_m=bm)
    bank, slots = _slotted(w, in_slots, len(in_slots) + 2, e, torch.Generator().manual_seed(t))
    usage = torch.zeros(e + 1, dtype=torch.int64) if in_slots else None  # the record is optional
    mixed = fp4_moe(x, *bank, weights, ids, LIMIT, block_m=bm, outs=_outs(t, topk, d, i), slots=slots, usage=usage)
    assert torch.equal(mixed, resident)
    if usage is None:
        return
    used = torch.zeros(e, dtype=torch.int64)
    used[ids.unique()] = 1
    assert usage[:e].tolist() == used.tolist()  # one use per expert per call, however many tokens
    assert int(usage[e]) == int((used.bool() & (slots.slot_of_expert >= 0)).sum())  # the hits
    fp4_moe(x, *bank, weights, ids, LIMIT, block_m=bm, slots=slots, usage=usage)
    assert usage[:e].tolist() == (2 * used).tolist()  # cumulative


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
    sorted_ids, expert_ids = moe_align(ids, num_experts=4, block_m=2)
    assert expert_ids.tolist() == [0, 2, 2, 3, -1, -1, -1]  # cdiv(6, 2) + min(6, 4) = 7 blocks
    pad = ids.numel()
    assert sorted_ids.tolist()[:8] == [1, 4, 0, 2, 5, pad, 3, pad]  # route = token * k + j
    assert sorted_ids.tolist()[8:] == [pad] * 6


def _routing(t: int, topk: int, e: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "one-expert":  # every token's first choice is expert e - 1
        rest = torch.stack([torch.randperm(e - 1, generator=gen)[: topk - 1] for _ in range(t)])
        return torch.cat([torch.full((t, 1), e - 1), rest], dim=1)
    if kind == "every-expert":
        return torch.arange(t * topk).remainder(e).view(t, topk)[:, torch.randperm(topk, generator=gen)]
    return torch.stack([torch.randperm(e, generator=gen)[:topk] for _ in range(t)])


@pytest.mark.parametrize(
    ("t", "topk", "e", "bm", "kind"),
    [
        (1, 6, 256, 16, "random"),  # DeepSeek-V4-Flash decode
        (64, 6, 256, 16, "random"),  # a decode batch
        (64, 6, 256, 64, "random"),
        (48, 6, 256, 16, "every-expert"),  # 288 routes cover all 256 experts
        (40, 4, 8, 16, "one-expert"),  # expert 7 takes every token: 40 routes, 3 blocks
        (3, 2, 4, 2, "random"),
        (1, 1, 1, 16, "random"),
    ],
)
def test_moe_align_is_the_reference_without_host_syncs(t, topk, e, bm, kind) -> None:
    ids = _routing(t, topk, e, kind, torch.Generator().manual_seed(t * e + bm))
    if kind == "every-expert":
        assert ids.unique().numel() == e
    with launch_guard(forbid_syncs=True) as seen:
        sorted_ids, expert_ids = moe_align(ids, e, bm)
    assert seen.triton_launches == 1 and seen.aten_launches == 0
    with pytest.raises(HostSync), launch_guard(forbid_syncs=True):  # the guard sees the reference's reads
        moe_align_ref(ids, e, bm)
    ref_sorted, ref_experts = moe_align_ref(ids, e, bm)
    assert len(expert_ids) == align_blocks(t * topk, e, bm)
    assert torch.equal(expert_ids, ref_experts) and torch.equal(sorted_ids, ref_sorted)


def test_moe_and_its_cache_record_make_no_host_sync() -> None:
    """The whole routed MoE with slots and the usage record: no sync, four launches (align, gate/up,
    down, and the sum over k: moe_combine), no torch op."""
    t, topk, e, d, i = 3, 2, 4, 128, 128
    x, w, weights, ids = _problem(t, topk, e, d, i, seed=2)
    bank, slots = _slotted(w, [1, 2], 3, e, torch.Generator().manual_seed(0))
    usage = torch.zeros(e + 1, dtype=torch.int64)
    with launch_guard(forbid_syncs=True) as seen:
        fp4_moe(x, *bank, weights, ids, LIMIT, slots=slots, usage=usage)
    assert dict(seen.triton) == {"moe_align_kernel": 1, "fp4_moe_gemm_kernel": 2, "moe_combine_kernel": 1}
    assert not dict(seen.aten)
