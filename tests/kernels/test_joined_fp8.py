"""model/joined_fp8.py: wq_a and wkv held as one packed FP8 weight, one launch for both (issue 16)."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.formats import quant_fp8_block
from dsv4serve.model.joined_fp8 import JoinedFp8
from dsv4serve.model.layers import Linear


def _packed(n: int, k: int, seed: int) -> Linear:
    linear = Linear(k, n, fp8_act=True)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[: n // 3] *= 16.0  # scale blocks of different exponents
    linear.load_fp8(*quant_fp8_block(w))
    return linear


def _x(m: int, k: int) -> torch.Tensor:
    return (torch.randn(m, k, generator=torch.Generator().manual_seed(7)) * torch.logspace(-2, 1, k)).bfloat16()


@pytest.mark.parametrize("m", [1, 3, 40])  # the decode (swapped) tile and the prefill tile
def test_one_launch_gives_each_projections_own_launch_bit_for_bit(m: int) -> None:
    from dsv4_kernels.fp8_gemm import fp8_linear

    first, second = _packed(256, 384, seed=1), _packed(128, 384, seed=2)
    x = _x(m, 384)
    alone = [fp8_linear(x, lin.weight_fp8, lin.weight_fp8_scale) for lin in (first, second)]
    joint = JoinedFp8(first, second)
    a, b = joint(x)
    assert a.shape == (m, 256) and b.shape == (m, 128) and a.stride(0) == b.stride(0) == 384
    assert torch.equal(a, alone[0]) and torch.equal(b, alone[1])
    # each Linear now reads views of the joined tensors, and alone gives the same bits as before
    assert first.weight_fp8 is not None and first.weight_fp8.data_ptr() == joint.weight.data_ptr()
    assert torch.equal(fp8_linear(x, second.weight_fp8, second.weight_fp8_scale), alone[1])


def test_holds_until_a_weight_is_replaced_and_refuses_what_cannot_stack() -> None:
    first, second = _packed(128, 256, seed=3), _packed(128, 256, seed=4)
    joint = JoinedFp8(first, second)
    assert joint.holds()
    second.weight_fp8 = second.weight_fp8.clone()  # a reload or a move: new tensors
    assert not joint.holds()
    ragged = _packed(96, 256, seed=5)  # 96 rows: its scales do not stack as whole blocks
    assert not JoinedFp8.fits(ragged, first)
    with pytest.raises(ValueError, match="scale blocks"):
        JoinedFp8(ragged, first)
    assert not JoinedFp8.fits(first, _packed(128, 384, seed=6))  # another input width
    assert not JoinedFp8.fits(first, Linear(256, 128, fp8_act=True))  # not packed


def test_the_model_joins_each_attention_and_its_logits_keep_their_bits() -> None:
    """Transformer.use_kernels joins every layer's wq_a and wkv; a prefill and decode steps with the FP8 GEMM on
    Triton give the same logits, bit for bit, as the same weights run as two launches a layer."""
    import dataclasses

    from dsv4serve.model.attention import Attention
    from dsv4serve.model.backends import KernelBackends
    from dsv4serve.model.random_init import random_model
    from dsv4serve.worker.kernel_check import CHECK_NUMERICS, _scenario, tiny_args

    model = random_model(tiny_args(), torch.device("cpu"), seed=0, include_mtp=False)
    model.use_kernels(KernelBackends(fp8_gemm="triton"))
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    assert attentions and all(a._joint is not None and a._joint.holds() for a in attentions)
    num = dataclasses.replace(CHECK_NUMERICS, backends=KernelBackends(fp8_gemm="triton"))
    joined = _scenario(model, num)
    for attention in attentions:
        attention._joint = None  # the two launches a layer, on the same (now view) weights
    assert torch.equal(_scenario(model, num), joined)
