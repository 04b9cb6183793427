"""The MoE output kernel (dsv4_kernels.moe_combine) in the interpreter, against its torch reference
(moe_combine_ref: the model's torch form, a sum over the routes in fp32, each addend added in place, one cast).

The kernel adds the routes in order from zero and then the addends, in fp32: the reference's order on the CPU, so
the two agree bit for bit, with the routes stored as the interpreter stores them (fp32 holding bf16 values) or as
bf16, with 0 to 2 addends of any float dtype, out fp32 or bf16, a channel count no block divides, and into a
poisoned strided output. And the fp4_moe kernel's per-route outputs through it give what its own sum and the
layer's adds gave before (the step census's three launches, now one)."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.moe_combine import moe_combine, stored_dtype
from dsv4_kernels.moe_combine_ref import moe_combine_ref
from dsv4_kernels.testing import into_poisoned


def _pairs(t: int, k: int, d: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """bf16 values of mixed magnitudes (as an expert's rounded outputs), held in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-6, 7, (t, k, 1), generator=gen).float())
    return (torch.randn(t, k, d, generator=gen) * scale).bfloat16().to(dtype)


@pytest.mark.parametrize("t,k,d", [(1, 6, 4096), (5, 6, 700), (3, 1, 96), (2, 2, 513)])
@pytest.mark.parametrize("n_add", [0, 1, 2])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_equals_the_reference_bit_for_bit(t: int, k: int, d: int, n_add: int, out_dtype: torch.dtype) -> None:
    pairs = _pairs(t, k, d, seed=t * 100 + k * 10 + d)
    gen = torch.Generator().manual_seed(d)
    addends = (torch.randn(t, d, generator=gen).bfloat16(), (torch.randn(t, d, generator=gen) * 50).float())[:n_add]
    got = moe_combine(pairs, addends, out_dtype)
    want = moe_combine_ref(pairs, addends, out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, want)


def test_bf16_routes_and_a_poisoned_output() -> None:
    pairs = _pairs(4, 6, 1000, seed=1, dtype=torch.bfloat16)
    shared = _pairs(4, 1, 1000, seed=2)[:, 0].bfloat16()
    want = moe_combine_ref(pairs, (shared,), torch.bfloat16)
    got = into_poisoned(
        (4, 1000), stored_dtype(torch.bfloat16), lambda out: moe_combine(pairs, (shared,), torch.bfloat16, out=out)
    )
    assert torch.equal(got, want)


def test_a_token_alone_equals_it_in_a_batch() -> None:
    pairs, gen = _pairs(9, 6, 300, seed=3), torch.Generator().manual_seed(4)
    shared = torch.randn(9, 300, generator=gen).bfloat16()
    batch = moe_combine(pairs, (shared,), torch.bfloat16)
    for i in (0, 4, 8):
        assert torch.equal(moe_combine(pairs[i : i + 1], (shared[i : i + 1],), torch.bfloat16), batch[i : i + 1])


def test_bad_arguments_are_refused() -> None:
    pairs = _pairs(2, 6, 64, seed=5)
    with pytest.raises(ValueError, match="at most 2 addends"):
        moe_combine(pairs, (pairs[:, 0],) * 3)
    with pytest.raises(ValueError, match=r"an addend must be a float \[2, 64\]"):
        moe_combine(pairs, (pairs[:1, 0],))
    with pytest.raises(ValueError, match=r"pairs must be a float \[T, k, D\]"):
        moe_combine(pairs[:, 0])
    with pytest.raises(ValueError, match="out must be"):
        moe_combine(pairs, (), torch.float32, out=torch.empty(2, 63))


def test_the_fp4_moe_routes_through_it_give_the_layers_old_sum() -> None:
    """fp4_moe's per-route outputs (reduce=False) combined with a shared expert's output and cast equal the old
    form bit for bit: fp4_moe's fp32 sum, `y += shared`, `y.to(bf16)`."""
    from dsv4_kernels.fp4_moe_layer import fp4_moe
    from dsv4_kernels.testing import fp4_moe_problem

    x, weights, topk_w, topk_ids = fp4_moe_problem(t=3, topk=2, e=8, d=256, i=128, seed=6)
    routed = fp4_moe(x, *weights, topk_w, topk_ids, 10.0)
    pairs = fp4_moe(x, *weights, topk_w, topk_ids, 10.0, reduce=False)
    assert pairs.shape == (3, 2, 256) and routed.dtype == torch.float32
    shared = torch.randn(3, 256, generator=torch.Generator().manual_seed(7)).bfloat16()
    old = routed.clone()
    old += shared
    assert torch.equal(moe_combine(pairs, (shared,), torch.bfloat16), old.to(torch.bfloat16))
