"""hc_post_combine: the MoE output's combine inside the mHC post launch, against the two launches it replaces
(moe_combine, then hc_mix.hc_post: bit for bit) and their torch references."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.hc_mix import hc_post
from dsv4_kernels.hc_mix_ref import hc_post_ref
from dsv4_kernels.hc_post_combine import hc_post_combine
from dsv4_kernels.moe_combine import moe_combine
from dsv4_kernels.moe_combine_ref import moe_combine_ref


def _case(n: int, k: int, d: int, n_add: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    pairs = (torch.randn(n, k, d, generator=gen) * 3).to(dtype)
    addends = tuple((torch.randn(n, d, generator=gen) * 2).bfloat16() for _ in range(n_add))
    h = torch.randn(n, 4, d, generator=gen).to(dtype)
    post = torch.rand(n, 4, generator=gen) * 2
    comb = torch.rand(n, 4, 4, generator=gen)
    return pairs, addends, h, post, comb


@pytest.mark.parametrize("n, k, d", [(1, 6, 4096), (3, 6, 256), (17, 2, 96)])
@pytest.mark.parametrize("n_add", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_launch_gives_the_two_launches_bits(n: int, k: int, d: int, n_add: int, dtype: torch.dtype) -> None:
    pairs, addends, h, post, comb = _case(n, k, d, n_add, dtype)
    out_dtype = dtype  # the compute dtype: the MoE output's and the streams'
    two = hc_post(moe_combine(pairs, addends, out_dtype), h, post, comb)
    one = hc_post_combine(pairs, addends, out_dtype, h, post, comb)
    assert one.dtype == h.dtype and torch.equal(one, two)
    # and the references' composition, within the post form's own rounding (its sums in another order)
    want = hc_post_ref(moe_combine_ref(pairs, addends, out_dtype), h, post, comb)
    tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(one.float(), want.float(), rtol=tol, atol=tol * want.float().abs().max().item())


def test_a_token_alone_and_in_a_batch_get_the_same_bits() -> None:
    pairs, addends, h, post, comb = _case(9, 6, 512, 1, torch.bfloat16, seed=3)
    batch = hc_post_combine(pairs, addends, torch.bfloat16, h, post, comb)
    alone = hc_post_combine(pairs[4:5], tuple(a[4:5] for a in addends), torch.bfloat16, h[4:5], post[4:5], comb[4:5])
    assert torch.equal(batch[4:5], alone)


def test_what_does_not_fit_is_refused() -> None:
    pairs, addends, h, post, comb = _case(2, 6, 128, 1, torch.bfloat16)
    with pytest.raises(ValueError, match="pairs"):
        hc_post_combine(pairs[:, :, :64], addends, torch.bfloat16, h, post, comb)
    with pytest.raises(ValueError, match="addend"):
        hc_post_combine(pairs, (addends[0][:, :64],), torch.bfloat16, h, post, comb)
    with pytest.raises(ValueError, match="at most"):
        hc_post_combine(pairs, addends * 3, torch.bfloat16, h, post, comb)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        hc_post_combine(pairs, addends, torch.float16, h, post, comb)


def test_the_model_defers_each_moe_combine_to_its_post_launch_with_the_same_logits(monkeypatch) -> None:
    """With the MXFP4 MoE and the mHC on Triton, each block's MoE output is summed in its post launch (one launch a
    layer fewer: tests/unit/test_step_census.py); a prefill and decode steps give the same logits, bit for bit,
    as the same model with the combine as its own launch."""
    import dataclasses

    from dsv4serve.model import moe as moe_module
    from dsv4serve.model.backends import KernelBackends
    from dsv4serve.model.random_init import random_model
    from dsv4serve.worker.kernel_check import CHECK_NUMERICS, _scenario, tiny_args

    model = random_model(tiny_args(), torch.device("cpu"), seed=0, include_mtp=False)
    model.use_kernels(KernelBackends(fp4_moe="triton"))
    backends = KernelBackends(fp4_moe="triton", hc="triton")
    num = dataclasses.replace(CHECK_NUMERICS, backends=backends)
    calls = []
    real = moe_module.MoE.forward

    def seen(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls.append(type(out).__name__)
        return out

    monkeypatch.setattr(moe_module.MoE, "forward", seen)
    deferred = _scenario(model, num)
    assert calls and set(calls) == {"Combined"}
    monkeypatch.setattr(moe_module.MoE, "forward", lambda self, *a, defer_combine=False, **kw: real(self, *a, **kw))
    assert torch.equal(_scenario(model, num), deferred)
