"""The compressors' decode update as one compiled call on the CPU (model/compressor_cpu.py) against its torch ops
(Compressor._carry_pool_torch): several sequences at different positions decode together across the window closes
of every compressor (CSA's overlapping ratio 4, HCA's 16), and the logits and every compressor's carry and entries
are the same bits, with the QAT simulation on and off; batch invariance keeps the torch ops."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4serve.model import compressor_cpu
from dsv4serve.model.compressor import Compressor
from dsv4serve.model.numerics import NUMERICS_OFF, NUMERICS_ON
from dsv4serve.model.transformer import BatchRow

PROMPTS = (3, 4, 17, 30, 41)  # before the first window, on a window's close, windows filled or not


def _decode(case, num, monkeypatch, compiled: bool):
    """(logits [steps, B, vocab], the rows' states, calls of the compiled update that served) over 2 x the largest
    ratio + 1 decode steps, greedy."""
    served: list[bool] = []
    real = compressor_cpu.carry_and_pool
    with monkeypatch.context() as m:
        if not compiled:
            m.setattr(compressor_cpu, "compiled", lambda: None)  # where numba cannot compile: torch's ops
        m.setattr(compressor_cpu, "carry_and_pool", lambda *a: served.append((y := real(*a)) is not None) or y)
        model, ids = case.model, case.token_ids
        states = [model.new_state(num) for _ in PROMPTS]
        last = [int(model([BatchRow(ids[:n], s)], num).logits[0].argmax()) for n, s in zip(PROMPTS, states)]
        steps = []
        for _ in range(2 * max(case.args.compress_ratios) + 1):
            logits = torch.stack(model([BatchRow([t], s) for t, s in zip(last, states)], num).logits)
            steps.append(logits)
            last = logits.argmax(-1).tolist()
    return torch.stack(steps), states, served


def _carries(states) -> list[torch.Tensor]:
    """Every compressor cache tensor of the rows' pool (entries and carry), layer by layer."""
    return [t for layer in states[0].pool.layers for c in (layer.comp, layer.idx) if c is not None for t in c.tensors()]


@pytest.mark.parametrize("base", [NUMERICS_ON, NUMERICS_OFF], ids=["simulated", "fp32"])
def test_the_compiled_decode_update_gives_the_torch_ops_bits(mixed_case, base, monkeypatch):
    num = dataclasses.replace(base, batch_invariant=False)
    got, got_states, served = _decode(mixed_case, num, monkeypatch, compiled=True)
    want, want_states, fell_back = _decode(mixed_case, num, monkeypatch, compiled=False)
    assert served and all(served), "the compiled update did not serve every decode call"
    assert fell_back and not any(fell_back)
    assert torch.equal(got, want)
    got_carries, want_carries = _carries(got_states), _carries(want_states)
    assert got_carries and len(got_carries) == len(want_carries)
    assert all(torch.equal(a, b) for a, b in zip(got_carries, want_carries))


def test_batch_invariance_keeps_the_torch_ops(mixed_case, monkeypatch):
    calls = []
    monkeypatch.setattr(compressor_cpu, "carry_and_pool", lambda *a: calls.append(1))
    model, ids = mixed_case.model, mixed_case.token_ids
    state = model.new_state(NUMERICS_ON)
    model([BatchRow(ids[:9], state)], NUMERICS_ON)
    model([BatchRow([1], state)], NUMERICS_ON)
    assert not calls


def test_a_carry_it_cannot_take_is_left_untouched():
    comp = next(m for m in _any_model_modules() if isinstance(m, Compressor))
    d = comp.head_dim
    kv = torch.ones(1, 2 * d)
    carry = tuple(torch.zeros(4, 4, w, dtype=torch.float64) for w in (2 * d, 2 * d, d, d))
    assert compressor_cpu.carry_and_pool(kv, kv, comp.ape, torch.tensor([5]), torch.tensor([0]), carry, d) is None
    assert all(not t.any() for t in carry)


def _any_model_modules():
    from dsv4serve.model.args import args_from_dicts
    from dsv4serve.model.transformer import Transformer
    from dsv4serve.tiny.spec import TINY_CONFIG, inference_config

    return Transformer(args_from_dicts(TINY_CONFIG, inference_config(TINY_CONFIG))).modules()
