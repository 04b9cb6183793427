"""The routed experts' stacked path (model/moe_stacked.py) against the per-expert loop it replaces: the same
values (bit for bit with the FP8 / MXFP4 simulation, the server's CPU default; within fp32 rounding without
it), chosen only where it is worth it, no copy of the weights, never after the experts' weights changed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4serve.model import moe_cpu
from dsv4serve.model.args import args_from_dicts
from dsv4serve.model.moe import MoE
from dsv4serve.model.moe_stacked import StackedExperts
from dsv4serve.model.numerics import NUMERICS_OFF, NUMERICS_ON, act_quant
from dsv4serve.tiny.spec import TINY_CONFIG, inference_config

ARGS = args_from_dicts(TINY_CONFIG, inference_config(TINY_CONFIG))
LAYER = ARGS.n_hash_layers  # a scored (not hashed) layer: routes follow x


def _moe(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(LAYER, ARGS).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    return moe


def _routes(moe: MoE, n_tokens: int, num, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, ARGS.dim, generator=g).to(num.compute_dtype)
    with torch.inference_mode():
        weights, ids = moe.gate(x, torch.zeros(n_tokens, dtype=torch.long), num, None)
    return act_quant(x, num), weights, ids


@pytest.mark.parametrize("base", [NUMERICS_ON, NUMERICS_OFF], ids=["simulated", "fp32"])
@pytest.mark.parametrize("n_tokens", [16, 64])
def test_a_step_with_most_experts_busy_runs_the_stacks_to_the_loops_bits(base, n_tokens, monkeypatch):
    num = dataclasses.replace(base, batch_invariant=False)
    loop, stacked = _moe(), _moe()
    stacked.stack_experts()
    x, weights, ids = _routes(loop, n_tokens, num)
    counts = torch.bincount(ids.flatten(), minlength=ARGS.n_routed_experts).tolist()
    assert StackedExperts.worth(counts)  # this routing takes the stacked path
    monkeypatch.setattr(moe_cpu, "compiled", lambda: None)  # the stacks' torch ops, not the compiled call
    used = []
    real = StackedExperts.gate_up
    monkeypatch.setattr(StackedExperts, "gate_up", lambda self, *a: used.append(1) or real(self, *a))
    with torch.inference_mode():
        want = loop._routed_torch(x, weights, ids, num)
        got = stacked._routed_torch(x, weights, ids, num)
    assert used, "the stacked products did not run"
    if base.fp8_act:  # FP8 inputs x MXFP4-exact weights: few significant bits, sums exact in any order
        assert torch.equal(got, want)
    else:  # fp32 inputs: MKL's batched GEMM sums D in another order than its single one, ~1 ulp
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_stacks_hold_the_experts_weights_without_a_copy():
    moe = _moe()
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    moe.stack_experts()
    stacks = moe.stacked
    assert stacks is not None
    after = moe.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    for e, expert in enumerate(moe.experts):
        for w in (expert.w1.weight, expert.w3.weight):
            assert w.untyped_storage().data_ptr() == stacks.w13.untyped_storage().data_ptr()
        assert expert.w2.weight.untyped_storage().data_ptr() == stacks.w2.untyped_storage().data_ptr()
        assert torch.equal(
            stacks.w13[e], torch.cat((before[f"experts.{e}.w1.weight"], before[f"experts.{e}.w3.weight"])).t()
        )  # K-major: [D, 2I]
        assert stacks.w13.is_contiguous() and stacks.w2.is_contiguous()


def test_the_loop_runs_where_the_stacks_would_pad_too_much_or_no_longer_hold():
    assert not StackedExperts.worth([1, 0, 0, 0, 0, 0, 1, 0])  # one row: 2 of 8 experts, 8 padded rows for 2
    assert StackedExperts.worth([4, 3, 5, 4, 2, 6, 4, 4])
    num = dataclasses.replace(NUMERICS_ON, batch_invariant=False)
    moe = _moe()
    moe.stack_experts()
    x, weights, ids = _routes(moe, 16, num)
    counts = torch.bincount(ids.flatten(), minlength=ARGS.n_routed_experts).tolist()
    assert moe._stacks_for(counts, True, False, num) is moe.stacked
    assert moe._stacks_for(counts, True, True, num) is None  # a rank's partial (split experts)
    assert moe._stacks_for(counts, False, False, num) is None  # pairs skipped (hybrid, expert parallel)
    assert moe._stacks_for(counts, True, False, NUMERICS_ON) is None  # batch invariance: row by row
    with torch.no_grad():  # a cut or a reload replaces an expert's weight: the stacks no longer hold it
        moe.experts[3].w2.weight = torch.nn.Parameter(moe.experts[3].w2.weight.clone(), requires_grad=False)
    assert moe._stacks_for(counts, True, False, num) is None
    moe.stack_experts()  # made anew over the current weights (use_kernels after a cut or a reload)
    assert moe._stacks_for(counts, True, False, num) is moe.stacked
    assert moe.stacked is not None and torch.equal(moe.stacked.w2[3].t(), moe.experts[3].w2.weight)
