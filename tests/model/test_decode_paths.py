"""The decode step's vectorized torch paths (model/attention_decode.py, Compressor.update_decode) against the
per-row paths: several sequences at different positions decode together, without batch invariance, and each
row's logits equal the same sequence decoded alone on the per-row path (batch-invariant), step after step,
across window closes of every compressor, in fp32 (numerics OFF) within a float tolerance.

The two differ only in summation order (masked keys instead of cut ones, batched GEMMs), so the tolerance
is a few fp32 ulps of the logit scale; with the FP8 / bf16 simulations on, a one-ulp difference may flip a
rounding, so ON is checked by greedy agreement only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4serve.model.numerics import NUMERICS_OFF, NUMERICS_ON
from dsv4serve.model.transformer import BatchRow

PROMPTS = (5, 17, 30, 41)  # windows filled or not, entries before / after the indexer's top-k


def _decode_both(case, num):
    """(alone [steps, B, vocab], batched [steps, B, vocab]) over 2 x the largest ratio decode steps, fed the
    alone path's greedy tokens."""
    model, ids = case.model, case.token_ids
    per_row = dataclasses.replace(num, batch_invariant=True)
    vector = dataclasses.replace(num, batch_invariant=False)
    alone = [model.new_state(per_row) for _ in PROMPTS]
    together = [model.new_state(vector) for _ in PROMPTS]
    last = []
    for n, a, t in zip(PROMPTS, alone, together):
        last.append(model([BatchRow(ids[:n], a)], per_row).logits[0].argmax().item())
        model([BatchRow(ids[:n], t)], per_row)  # same prefill for both
    steps = 2 * max(case.args.compress_ratios) + 1
    got_alone, got_batched = [], []
    for _ in range(steps):
        rows = [model([BatchRow([tok], a)], per_row).logits[0] for tok, a in zip(last, alone)]
        out = model([BatchRow([tok], t) for tok, t in zip(last, together)], vector)
        got_alone.append(torch.stack(rows))
        got_batched.append(torch.stack(out.logits))
        last = [int(r.argmax()) for r in rows]
    return torch.stack(got_alone), torch.stack(got_batched)


def test_vectorized_decode_equals_the_per_row_path_in_fp32(tiny_case):
    alone, batched = _decode_both(tiny_case, NUMERICS_OFF)
    scale = alone.abs().max()
    assert (batched - alone).abs().max() <= 1e-5 * scale, f"max |dlogit| {(batched - alone).abs().max():.3g}"
    assert torch.equal(batched.argmax(-1), alone.argmax(-1))


@pytest.mark.parametrize("case_name", ["mixed4"])
def test_vectorized_decode_keeps_greedy_tokens_with_numerics_on(helpers, case_name):
    alone, batched = _decode_both(helpers.build_case(case_name), NUMERICS_ON)
    agree = (batched.argmax(-1) == alone.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"greedy agreement {agree:.2f}"
