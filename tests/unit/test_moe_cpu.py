"""The routed experts as one compiled call on the CPU (model/moe_cpu.py) against the torch path it stands in for
(MoE._routed_torch's per-expert loop): the same values, bit for bit with the FP8 / MXFP4 simulation on the
checkpoint's kind of weights (MXFP4 values), within fp32 rounding without it; its roundings (bf16, the FP8
simulation) bit for bit torch's on chosen edge values; used only where its arithmetic is the step's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dsv4serve.model import moe_cpu
from dsv4serve.model.args import args_from_dicts
from dsv4serve.model.moe import MoE
from dsv4serve.model.numerics import (
    NUMERICS_OFF,
    NUMERICS_ON,
    fp4_quant_dequant,
)
from dsv4serve.tiny.spec import TINY_CONFIG, inference_config
from tests.unit.test_moe_stacked import _routes  # the same routing of random inputs

ARGS = args_from_dicts(TINY_CONFIG, inference_config(TINY_CONFIG))
LAYER = ARGS.n_hash_layers  # a scored layer: routes follow x

SIMULATED = dataclasses.replace(NUMERICS_ON, batch_invariant=False)
BF16_NO_FP8 = dataclasses.replace(SIMULATED, fp8_act=False, kv_fp8=False, indexer_fp4=False)
FP32 = dataclasses.replace(NUMERICS_OFF, batch_invariant=False)


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    if moe_cpu.compiled() is None:  # numba is a dependency: this is a broken install, not a skip
        pytest.fail(f"numba did not compile the routed experts: {moe_cpu.__name__}")


def _moe(seed: int = 0, mxfp4: bool = True) -> MoE:
    """A scored MoE layer with random weights; `mxfp4`: each routed weight rounded to MXFP4 values (what the
    checkpoint's experts dequantize to)."""
    torch.manual_seed(seed)
    moe = MoE(LAYER, ARGS).eval()
    with torch.no_grad():
        for name, p in moe.named_parameters():
            value = torch.randn_like(p) * 0.05
            p.copy_(fp4_quant_dequant(value) if mxfp4 and name.startswith("experts.") else value)
    return moe


def _both(moe: MoE, x, weights, ids, num, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(the compiled call's sum, the torch loop's sum) through MoE._routed_torch."""
    served: list[bool] = []  # per call of routed_experts: whether the compiled loop gave the sum
    real = moe_cpu.routed_experts
    monkeypatch.setattr(moe_cpu, "routed_experts", lambda *a: served.append((y := real(*a)) is not None) or y)
    with torch.inference_mode():
        got = moe._routed_torch(x, weights, ids, num)
        with monkeypatch.context() as m:
            m.setattr(moe_cpu, "compiled", lambda: None)  # where numba cannot compile: the torch path
            m.setattr(MoE, "_stacks_for", lambda *a: None)  # the per-expert loop
            want = moe._routed_torch(x, weights, ids, num)
    assert served == [True, False]
    return got, want


@pytest.mark.parametrize("num", [SIMULATED, BF16_NO_FP8], ids=["simulated", "bf16"])
@pytest.mark.parametrize("n_tokens", [1, 2, 3, 16, 64])
def test_the_compiled_call_gives_the_torch_paths_bits_on_mxfp4_experts(num, n_tokens, monkeypatch):
    moe = _moe(seed=n_tokens)
    moe.stack_experts()
    x, weights, ids = _routes(moe, n_tokens, num, seed=n_tokens)
    got, want = _both(moe, x, weights, ids, num, monkeypatch)
    assert got.dtype == torch.float32 and got.shape == (n_tokens, ARGS.dim)
    assert torch.equal(got, want)


@pytest.mark.parametrize("mxfp4", [True, False])
@pytest.mark.parametrize("n_tokens", [1, 16, 64])
def test_in_fp32_the_compiled_call_is_the_torch_path_within_rounding(mxfp4, n_tokens, monkeypatch):
    moe = _moe(mxfp4=mxfp4)
    moe.stack_experts()
    x, weights, ids = _routes(moe, n_tokens, FP32)
    got, want = _both(moe, x, weights, ids, FP32, monkeypatch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # MKL sums over K in its own order


def test_a_token_routed_twice_to_one_expert_sums_its_pairs_in_row_order(monkeypatch):
    moe = _moe()
    moe.stack_experts()
    x, weights, _ = _routes(moe, 4, SIMULATED)
    ids = torch.tensor([[3, 3], [7, 0], [0, 7], [5, 5]])  # not from a gate, but the sum must not break
    got, want = _both(moe, x, weights, ids, SIMULATED, monkeypatch)
    assert torch.equal(got, want)


def test_an_expert_id_out_of_range_raises_instead_of_reading_past_the_stacks():
    moe = _moe()
    moe.stack_experts()
    assert moe.stacked is not None
    x, weights, _ = _routes(moe, 2, SIMULATED)
    for bad in (ARGS.n_routed_experts, -1):
        ids = torch.tensor([[0, 1], [2, bad]])
        with pytest.raises(ValueError, match="out of range"):
            moe_cpu.routed_experts(x, ids, weights, moe.stacked.w13, moe.stacked.w2, 10.0, torch.bfloat16, True)


def test_only_resident_fp32_stacks_without_batch_invariance_take_the_compiled_call():
    moe = _moe()
    assert moe._compiled_for(SIMULATED) is None  # not stacked yet
    moe.stack_experts()
    assert moe._compiled_for(SIMULATED) is moe.stacked
    assert moe._compiled_for(FP32) is moe.stacked
    assert moe._compiled_for(NUMERICS_ON) is None  # batch invariance: one-row GEMMs, another sum order
    assert moe._compiled_for(dataclasses.replace(SIMULATED, compute_dtype=torch.float16)) is None
    with torch.no_grad():  # a cut or a reload replaces a weight: the stacks no longer hold it
        moe.experts[2].w1.weight = torch.nn.Parameter(moe.experts[2].w1.weight.clone(), requires_grad=False)
    assert moe._compiled_for(SIMULATED) is None


def test_pairs_left_to_others_or_a_ranks_partial_stay_on_the_torch_path(monkeypatch):
    moe = _moe()
    moe.stack_experts()
    x, weights, ids = _routes(moe, 16, SIMULATED)
    calls = []
    monkeypatch.setattr(moe_cpu, "routed_experts", lambda *a: calls.append(1))
    with torch.inference_mode():
        moe._routed_torch(x, weights, ids, SIMULATED, skip=frozenset({int(ids[0, 0])}))  # hybrid's CPU experts
        moe._routed_torch(x, weights, ids, SIMULATED, partial=True)  # experts split over ranks
    assert not calls


def _bits(v: np.ndarray) -> np.ndarray:
    return v.view(np.uint32)


def test_the_bf16_rounding_is_torchs_to_the_bit():
    rng = np.random.default_rng(0)
    edge = np.array(
        [0.0, -0.0, 1.0, 1.00390625, 1.01171875, 1.0 + 2**-8 + 2**-20, 3.4e38, -3.4e38, np.inf, -np.inf, 1e-40, -1e-45],
        np.float32,
    )  # ties to even both ways, just above a tie, overflow to inf, subnormals
    halves = (rng.integers(0, 2**16, 4096, dtype=np.uint32) << 16) | 0x8000  # exact ties
    v = np.concatenate([edge, rng.standard_normal(4096).astype(np.float32) * 100, halves.view(np.float32)])
    v = v[np.isfinite(v) | np.isinf(v)]  # no NaN payloads in the comparison
    want = torch.from_numpy(v.copy()).to(torch.bfloat16).float().numpy()
    got = v.copy()
    moe_cpu._to_bf16(got)
    assert np.array_equal(_bits(got), _bits(want))
    nan = np.array([np.nan], np.float32)
    moe_cpu._to_bf16(nan)
    assert np.isnan(nan[0])


@pytest.mark.parametrize("limit", [0.0, 10.0])
def test_the_swiglu_with_its_own_exp_is_torchs_to_the_bit_on_a_million_values(limit):
    rng = np.random.default_rng(7)
    edge = [0.0, -0.0, 1e-30, -1e-30, 1e-8, -1e-8, 20.0, -20.0, 37.0, -37.0, 40.0, -40.0, 100.0, -100.0]
    edge += [700.0, -700.0, 708.5, -708.5, 709.9, -709.9, 745.5, -745.5, 800.0, -800.0, 3e38, -3e38, np.inf, -np.inf]
    gate = np.concatenate(
        [
            np.array(edge, np.float32),
            rng.standard_normal(2**19).astype(np.float32) * 4,  # the SwiGLU's usual range
            (rng.standard_normal(2**19) * 10.0 ** rng.uniform(-6, 3, 2**19)).astype(np.float32),  # magnitudes
        ]
    )
    gate = torch.from_numpy(gate).to(torch.bfloat16).float().numpy()  # gate and up are bf16 values here
    up = torch.from_numpy(rng.standard_normal(gate.shape[0]).astype(np.float32)).to(torch.bfloat16).float().numpy()
    weight = np.float32(0.37)
    g, u = torch.from_numpy(gate), torch.from_numpy(up)
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    want = (weight * (torch.nn.functional.silu(g.double()).float() * u)).numpy()
    got = np.empty_like(gate)
    scratch = [np.empty(gate.shape[0]) for _ in range(3)]
    moe_cpu._swiglu(np.concatenate([gate, up]), np.float32(limit), weight, got, *scratch)
    assert np.array_equal(_bits(got), _bits(want))
