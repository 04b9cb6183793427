"""The shared expert's fused FP8 kernels (dsv4_kernels.fp8_swiglu) in the interpreter, against the torch
reference (fp8_swiglu_ref) and the model's Expert.

Exact where it can be: with integer-valued activations (|x| <= 8: exact in e4m3 at their block's scale)
and weights on a 2^-5 grid of small integers, every product and every partial sum of the w1 / w3 GEMMs
is exact in fp32, so the summation order is moot, gate and up are the reference's to the bit, and so
must be the kernel's e4m3 act bytes and scales (the epilogue's arithmetic is the reference's: bf16
gate / up, clamp, silu in fp64 rounded to fp32, times up, bf16, per-128 quantization). With random
values the sums differ by fp32 order; a one-ulp change of gate or up can move one act value by a bf16
ulp and so by one e4m3 step (2^-3 relative) at most: checked as such.

The whole expert (fp8_swiglu then the w2 FP8 GEMM) against the reference and against the model's
torch Expert path: on the exact inputs its act is the reference's, and the w2 GEMM differs only by
fp32 summation order and the bf16 rounding: the FP8 GEMM's stated bound (test_fp8_gemm.py),
2^-8 |ref| + 2 K 2^-24 sum_k |a_k w_k|.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4_kernels.formats import dequant_fp8_block, quant_fp8_block
from dsv4_kernels.fp8_gemm_ref import dequant_act_fp8_ref
from dsv4_kernels.fp8_swiglu import fp8_swiglu, pick_split_k, shared_expert
from dsv4_kernels.fp8_swiglu_ref import fp8_swiglu_ref, shared_expert_ref
from dsv4_kernels.split_k import split_counters, split_to_fill
from dsv4_kernels.testing import into_poisoned
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.moe import Expert
from dsv4serve.model.numerics import NUMERICS_ON, act_quant

LIMIT = 10.0  # DeepSeek-V4's swiglu_limit


def _exact_inputs(m: int, inter: int, d: int, seed: int):
    """x bf16 [m, d] integers in [-8, 8] (row 1 zero), W1 / W3 [inter, d] and W2 [d, inter] e4m3 with e8m0
    block scales: integers in [-8, 8] times 2^-5, the second half of W1 / W3's channels times 8 (their
    gate / up pass the clamp)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, (m, d), generator=gen).float()
    if m > 1:
        x[1] = 0.0

    def weight(rows: int, cols: int, big_half: bool):
        w = torch.randint(-8, 9, (rows, cols), generator=gen).float() * 2.0**-5
        if big_half:
            w[rows // 2 :] *= 8.0
        w8, scale = quant_fp8_block(w)
        assert torch.equal(dequant_fp8_block(w8, scale), w)  # exact on the e4m3 grid
        return w8, scale

    return x.bfloat16(), (*weight(inter, d, True), *weight(inter, d, True)), weight(d, inter, False)


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


# (M, I, D): decode (one token, the swapped 16-row tile), a ragged second channel tile (200), a ragged K
# (200, not a multiple of 128) with the 32-row swapped tile (17 rows), the 64-row prefill tile (40)
@pytest.mark.parametrize(("m", "inter", "d"), [(1, 128, 128), (3, 200, 256), (17, 128, 200), (40, 256, 128)])
def test_act_is_the_references_on_exact_sums(m: int, inter: int, d: int) -> None:
    x, (w1, s1, w3, s3), _ = _exact_inputs(m, inter, d, seed=m + inter)
    got = {}

    def run(q_out: torch.Tensor) -> torch.Tensor:  # both outputs NaN-poisoned strided views
        got["scale"] = into_poisoned(
            (m, -(-inter // 128)), torch.float32, lambda s_out: fp8_swiglu(x, w1, s1, w3, s3, LIMIT, (q_out, s_out))[1]
        )
        return q_out

    q, scale = into_poisoned((m, inter), torch.float8_e4m3fn, run), got["scale"]
    want_q, want_scale = fp8_swiglu_ref(x, w1, s1, w3, s3, LIMIT)
    assert q.dtype == torch.float8_e4m3fn and torch.equal(_bytes(q), _bytes(want_q))
    assert torch.equal(scale, want_scale)


@pytest.mark.parametrize(("m", "inter", "split"), [(1, 128, 2), (3, 200, 4), (16, 256, 4)])
def test_a_split_k_launch_is_the_references_on_exact_sums(m: int, inter: int, split: int) -> None:
    """Decode tiles split over K (4 blocks of 128): each split's gate / up sums stored, the last to arrive adds
    them in split order and runs the epilogue; on exact sums the act bytes and scales are the reference's, and
    the arrival counters are back at 0 for the next launch (and graph replays)."""
    x, (w1, s1, w3, s3), _ = _exact_inputs(m, inter, 512, seed=3 * m + inter)
    q, scale = fp8_swiglu(x, w1, s1, w3, s3, LIMIT, split_k=split)
    want_q, want_scale = fp8_swiglu_ref(x, w1, s1, w3, s3, LIMIT)
    assert torch.equal(_bytes(q), _bytes(want_q)) and torch.equal(scale, want_scale)
    assert int(split_counters(1, x.device).abs().sum()) == 0
    with pytest.raises(ValueError, match="split_k"):
        fp8_swiglu(x, w1, s1, w3, s3, LIMIT, split_k=3)  # 3 does not divide the 4 K blocks


def test_the_built_in_split_fills_the_gpu_for_the_shared_expert_only() -> None:
    assert split_to_fill(16, 32) == 8  # V4-Flash's shared expert: 2,048 channels (16 tiles), K 4,096
    assert split_to_fill(64, 32) == 2  # 8,192 channels: 128 programs at split 2
    assert split_to_fill(128, 32) == 1 and split_to_fill(16, 3) == 1  # enough tiles; an odd K
    assert pick_split_k(1, 2048, 4096, torch.device("cpu")) == 1  # off CUDA: unsplit (the interpreter)
    assert pick_split_k(64, 2048, 4096, torch.device("cpu")) == 1  # the prefill tile never splits


def test_act_without_a_limit() -> None:
    """swiglu_limit 0: no clamp (the big channels' gate and up pass through)."""
    x, (w1, s1, w3, s3), _ = _exact_inputs(3, 128, 128, seed=5)
    q, scale = fp8_swiglu(x, w1, s1, w3, s3, 0.0)
    want_q, want_scale = fp8_swiglu_ref(x, w1, s1, w3, s3, 0.0)
    assert torch.equal(_bytes(q), _bytes(want_q)) and torch.equal(scale, want_scale)
    clamped, _ = fp8_swiglu_ref(x, w1, s1, w3, s3, LIMIT)
    assert not torch.equal(_bytes(clamped), _bytes(want_q))  # the case differs from the clamped one


def test_act_on_random_values_within_one_e4m3_step() -> None:
    gen = torch.Generator().manual_seed(7)
    m, inter, d = 3, 256, 256
    x = (torch.randn(m, d, generator=gen) * 2).bfloat16()
    w1, s1 = quant_fp8_block(torch.randn(inter, d, generator=gen) * 0.3)
    w3, s3 = quant_fp8_block(torch.randn(inter, d, generator=gen) * 0.3)
    q, scale = fp8_swiglu(x, w1, s1, w3, s3, LIMIT)
    want_q, want_scale = fp8_swiglu_ref(x, w1, s1, w3, s3, LIMIT)
    assert torch.equal(scale, want_scale)  # a block's amax would have to cross a power of two
    got, want = dequant_act_fp8_ref(q, scale), dequant_act_fp8_ref(want_q, want_scale)
    step = 2.0**-3 * want.abs() + 2.0**-9 * scale.repeat_interleave(128, 1)  # one e4m3 step (subnormals: 2^-9 s)
    assert ((got - want).abs() <= step).all()
    assert (_bytes(q) == _bytes(want_q)).float().mean() >= 0.95


def _w2_bound(q: torch.Tensor, scale: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, ref: torch.Tensor):
    mag = dequant_act_fp8_ref(q, scale).abs() @ dequant_fp8_block(w2, s2).abs().t()
    return 2.0**-8 * ref.abs() + 2 * q.shape[1] * 2.0**-24 * mag + 1e-30


def _expert(d: int, inter: int, weights) -> Expert:
    """The model's shared expert holding these FP8 weights, dense and packed (use_kernels' state)."""
    expert = Expert(d, inter, LIMIT)
    for linear, (w8, scale) in zip((expert.w1, expert.w3, expert.w2), weights):
        with torch.no_grad():
            linear.weight.copy_(dequant_fp8_block(w8, scale))
        linear.pack_fp8()
    return expert


@pytest.mark.parametrize(("m", "inter", "d"), [(1, 128, 128), (3, 256, 128)])
def test_shared_expert_matches_the_reference_and_the_torch_expert(m: int, inter: int, d: int) -> None:
    x, (w1, s1, w3, s3), (w2, s2) = _exact_inputs(m, inter, d, seed=11 * m)
    out = shared_expert(x, w1, s1, w3, s3, w2, s2, LIMIT)
    want = shared_expert_ref(x, w1, s1, w3, s3, w2, s2, LIMIT)
    q, scale = fp8_swiglu_ref(x, w1, s1, w3, s3, LIMIT)
    bound = _w2_bound(q, scale, w2, s2, want.float())
    assert out.dtype == torch.bfloat16 and ((out.float() - want.float()).abs() <= bound).all()

    expert = _expert(d, inter, ((w1, s1), (w3, s3), (w2, s2)))
    num = dataclasses.replace(NUMERICS_ON, batch_invariant=False)
    torch_path = expert(act_quant(x, num), num)  # the torch Expert, fed as MoE.forward feeds it
    kernels = expert(x, dataclasses.replace(num, backends=KernelBackends(fp8_gemm="triton")))
    assert ((kernels.float() - torch_path.float()).abs() <= bound).all()
    assert ((torch_path.float() - want.float()).abs() <= bound).all()


def test_expert_without_packed_weights_says_so() -> None:
    expert = Expert(128, 128, LIMIT)
    num = dataclasses.replace(NUMERICS_ON, backends=KernelBackends(fp8_gemm="triton"))
    with pytest.raises(RuntimeError, match="use_kernels"):
        expert(torch.zeros(1, 128, dtype=torch.bfloat16), num)


def test_fp8_swiglu_rejects_mismatched_weights() -> None:
    x, (w1, s1, w3, s3), _ = _exact_inputs(1, 256, 128, seed=1)
    with pytest.raises(ValueError, match="share one shape"):
        fp8_swiglu(x, w1, s1, w3[:128], s3[:1], LIMIT)
    with pytest.raises(ValueError, match="scale shape"):
        fp8_swiglu(x, w1, s1[:1], w3, s3, LIMIT)
