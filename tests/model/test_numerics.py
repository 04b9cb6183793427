"""The numerics simulations against the format definitions and independent implementations:
FP8 blocks against the checkpoint quantizer (dsv4_kernels.formats), FP4 rounding against the e2m1
grid with round-half-to-even, the Hadamard transform against Sylvester's matrix, RoPE against
transformers and the YaRN band of dsv4-model.md §2.2."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels import formats as quant
from dsv4_kernels.token_ops_ref import apply_rope_ref, hadamard_ref
from dsv4serve.model import hadamard_cpu
from dsv4serve.model.args import args_from_dicts
from dsv4serve.model.numerics import fp4_quant_dequant, fp8_quant_dequant, hadamard
from dsv4serve.model.rope import Rotation, apply_rope, inv_freq, rope_cos_sin


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("block", [128, 64])
def test_fp8_blocks_match_the_checkpoint_quantizer(block):
    x = _randn(6, 3 * block) * torch.logspace(-3, 2, 6)[:, None]
    q, s = quant.quant_fp8_block(x, block=(1, block))  # one row, `block` channels per scale
    want = quant.dequant_fp8_block(q, s, block=(1, block))
    assert torch.equal(fp8_quant_dequant(x, block), want)


def test_fp8_partial_last_block_is_its_own_block():
    x = _randn(4, 200)
    got = fp8_quant_dequant(x, 128)
    assert torch.equal(got[:, :128], fp8_quant_dequant(x[:, :128].contiguous(), 128))
    assert torch.equal(got[:, 128:], fp8_quant_dequant(x[:, 128:].contiguous(), 128))


def test_fp4_matches_the_checkpoint_quantizer_off_ties():
    x = _randn(8, 64)  # random normals never sit exactly on a rounding midpoint
    q, s = quant.quant_fp4(x)
    assert torch.equal(fp4_quant_dequant(x, 32), quant.dequant_fp4(q, s))


def test_fp4_rounds_midpoints_to_the_even_code():
    # block amax 6 -> scale 1; midpoints of the e2m1 grid go to the code with an even mantissa
    mids = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0])
    want = torch.tensor([6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0])
    x = torch.zeros(32)
    x[:10] = mids
    assert torch.equal(fp4_quant_dequant(x, 32)[:10], want)


@pytest.mark.parametrize("n", [1, 16, 128])
def test_hadamard_is_the_orthonormal_sylvester_transform(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    x = _randn(5, n, seed=n).double()
    assert torch.allclose(hadamard(x), x @ h.double() / n**0.5, atol=1e-12)
    assert torch.allclose(hadamard(hadamard(x)), x, atol=1e-12)


def test_rope_matches_transformers_and_inverts():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    x = _randn(7, 3, 32)  # [tokens, heads, head_dim]
    freqs = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    cos, sin = rope_cos_sin(freqs, torch.arange(5, 12))
    want = apply_rotary_pos_emb(x.transpose(0, 1)[None], cos[None], sin[None])[0].transpose(0, 1)
    got = apply_rope(x, cos, sin)
    assert torch.allclose(got, want, atol=1e-6) and torch.equal(got[..., :24], x[..., :24])
    assert torch.allclose(apply_rope(got, cos, sin, inverse=True), x, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4, 128), (16, 4, 128), (3, 64), (2, 2)])
def test_the_compiled_hadamard_equals_the_torch_butterflies(dtype, shape):
    """numerics.hadamard on the CPU (model/hadamard_cpu.py, numba) against the kernels' reference (the same
    fp32 butterflies as torch ops): bit for bit, x untouched, also from a non-contiguous x; the compiled call
    itself ran (not a fallback)."""
    g = torch.Generator().manual_seed(shape[0])
    for scale in (1e-3, 1.0, 3e4):
        x = (torch.randn(*shape, generator=g) * scale).to(dtype)
        before = x.clone()
        got = hadamard(x)
        assert got.dtype == dtype and torch.equal(got, hadamard_ref(x)) and torch.equal(x, before)
    strided = x.transpose(0, -1).contiguous().transpose(0, -1)
    assert torch.equal(hadamard(strided), hadamard_ref(x))
    rows = x.float().reshape(-1, shape[-1]).clone()
    assert hadamard_cpu.hadamard_cpu(rows.numpy()) and torch.equal(rows.view(shape).to(dtype), hadamard_ref(x))


def test_without_numba_the_hadamard_runs_its_torch_ops(monkeypatch):
    monkeypatch.setattr(hadamard_cpu, "compiled", lambda: None)
    x = _randn(3, 128, seed=3)
    rows = x.clone()
    assert not hadamard_cpu.hadamard_cpu(rows.numpy()) and torch.equal(rows, x)
    assert torch.equal(hadamard(x), hadamard_ref(x))
    with pytest.raises(ValueError, match="contiguous float32"):
        hadamard_cpu.hadamard_cpu(x.double().numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4, 128), (16, 4, 128), (3, 128), (7, 3, 32)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_per_channel_tables_equal_the_pairwise_rotation(dtype, shape, inverse):
    """`rotate` (x * cos2 + swap(x) * sin2, the torch path's form) against the pairwise formula of the kernels'
    reference (even c - odd s, even s + odd c): bit for bit, the un-rotated channels untouched, a contiguous
    result in x's dtype, also from a non-contiguous x."""
    g = torch.Generator().manual_seed(shape[0] * 7 + inverse)
    x = (torch.randn(*shape, generator=g) * 30).to(dtype)
    freqs = torch.rand(shape[-1] // 4, generator=g)  # rotates half of the channels
    cos, sin = rope_cos_sin(freqs, torch.randint(0, 1 << 20, (shape[0],), generator=g))
    want = apply_rope_ref(x, cos, sin, inverse)
    for got in (apply_rope(x, cos, sin, inverse), Rotation.from_tables(cos, sin).apply(x, inverse)):
        assert got.dtype == dtype and got.is_contiguous() and torch.equal(got, want)
    strided = x.transpose(0, -2).contiguous().transpose(0, -2) if x.dim() == 3 else x.t().contiguous().t()
    assert torch.equal(apply_rope(strided, cos, sin, inverse), want)


def test_yarn_band_of_the_real_config():
    """Base 160000, 64 rope dims, original length 65536: frequencies below index 15 kept, above 25
    divided by the factor 16 (dsv4-model.md §2.2); window-only layers are unscaled base 10000."""
    ref = dict(
        vocab_size=64,
        dim=64,
        moe_inter_dim=32,
        n_layers=2,
        n_hash_layers=0,
        n_heads=2,
        n_routed_experts=2,
        n_shared_experts=1,
        n_activated_experts=1,
        score_func="sqrtsoftplus",
        route_scale=1.5,
        swiglu_limit=10.0,
        q_lora_rank=32,
        head_dim=512,
        rope_head_dim=64,
        o_groups=1,
        o_lora_rank=16,
        window_size=128,
        compress_ratios=[0, 128],
        compress_rope_theta=160000.0,
        original_seq_len=65536,
        rope_theta=10000.0,
        rope_factor=16,
        beta_fast=32,
        beta_slow=1,
        index_n_heads=2,
        index_head_dim=128,
        index_topk=4,
        hc_mult=2,
        hc_sinkhorn_iters=2,
        dtype="bf16",
        expert_dtype="bf16",
    )
    args = args_from_dicts({}, ref)
    plain = 1.0 / (160000.0 ** (torch.arange(0, 64, 2).double() / 64))
    got = inv_freq(args, compressed_layer=True).double()
    assert torch.allclose(got[:16], plain[:16], rtol=1e-6)
    assert torch.allclose(got[25:], plain[25:] / 16, rtol=1e-6)
    assert bool(((got[16:25] < plain[16:25]) & (got[16:25] > plain[16:25] / 16)).all())
    window_only = inv_freq(args, compressed_layer=False).double()
    assert torch.allclose(window_only, 1.0 / (10000.0 ** (torch.arange(0, 64, 2).double() / 64)), rtol=1e-6)
