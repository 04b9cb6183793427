"""Exactness of the incremental state: any chunking, token-by-token decode and batched rows of
different lengths give bitwise the logits of one full forward, numerics ON (bf16, all simulations)
and OFF (fp32).

Bitwise, not a tolerance, because it is achievable and because anything less is not stable: with
`Numerics.batch_invariant` (the default) projections run per token, each query attends over exactly
its own keys in a canonical order, top-k ties go to the earlier entry and transcendental functions
are rounded from fp64, so no result depends on the chunk's size. Without that, a one-ulp
reassociation difference flips an FP8 or bf16 rounding and then, through the routers, whole expert
choices (measured: up to 40% of the logit scale with numerics ON).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from dsv4serve.model.numerics import NUMERICS_OFF, NUMERICS_ON
from dsv4serve.model.transformer import BatchRow

NUMERICS = {
    "off": NUMERICS_OFF,
    "on": NUMERICS_ON,
    "on_fp32": dataclasses.replace(NUMERICS_ON, compute_dtype=torch.float32),
}


def _random_mix(n_tokens: int, seed: int) -> list[int]:
    rng, sizes = random.Random(seed), []
    while sum(sizes) < n_tokens:
        sizes.append(min(rng.choice([1, 2, 3, 4, 5, 7, 9, 13]), n_tokens - sum(sizes)))
    return sizes


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, what
    assert torch.equal(got, want), f"{what}: max |dlogit| {(got - want).abs().max().item():.3g} (want bitwise)"


@pytest.mark.parametrize("numerics", ["off", "on"])
def test_any_chunking_equals_one_pass(tiny_case, helpers, numerics):
    num, ids, model = NUMERICS[numerics], tiny_case.token_ids, tiny_case.model
    n = ids.shape[0]
    full = helpers.run_chunks(model, ids, [n], num)
    w, r = tiny_case.args.window_size, max(tiny_case.args.compress_ratios)
    patterns = {
        "decode": [1] * n,
        "fours": [4] * (n // 4) + [n % 4] * (n % 4 > 0),
        "window_edges": [w - 1, 1, w + 1, r - 1, r + 1],  # one short of / past each boundary
        "mix": _random_mix(n, seed=7),
    }
    patterns["window_edges"].append(n - sum(patterns["window_edges"]))
    assert patterns["window_edges"][-1] > 0
    for name, sizes in patterns.items():
        _assert_same(helpers.run_chunks(model, ids, sizes, num), full, f"{tiny_case.name}/{numerics}/{name}")


@pytest.mark.parametrize("numerics", sorted(NUMERICS))
def test_prefill_then_greedy_decode_equals_full_forward(mixed_case, numerics):
    """Decode feeds back its own greedy tokens; a full forward over the result must agree."""
    num, model = NUMERICS[numerics], mixed_case.model
    prompt = mixed_case.token_ids[:41]
    state = model.new_state(num)
    logits = model([BatchRow(prompt, state)], num).logits[0]
    tokens, step_logits = prompt.tolist(), []
    for _ in range(24):
        step_logits.append(logits)
        tokens.append(int(logits.argmax()))
        logits = model([BatchRow(torch.tensor(tokens[-1:]), state)], num).logits[0]
    full_state = model.new_state(num)
    full = model([BatchRow(torch.tensor(tokens), full_state)], num, all_logits=True).logits[0]
    _assert_same(torch.stack(step_logits), full[prompt.shape[0] - 1 : -1], f"decode/{numerics}")
    assert state.num_tokens == full_state.num_tokens == len(tokens)


@pytest.mark.parametrize("numerics", sorted(NUMERICS))
def test_batched_rows_equal_rows_run_alone(mixed_case, numerics):
    """Rows at different positions and chunk sizes in one batch: each equals its own run."""
    num, model, ids = NUMERICS[numerics], mixed_case.model, mixed_case.token_ids
    histories, chunks = [0, 17, 40, 33], [29, 1, 7, 5]  # tokens already run, tokens in this step
    offsets = [0, 3, 11, 20]  # each row reads its own slice of the token ids

    def fresh_states():
        states = []
        for hist, off in zip(histories, offsets):
            st = model.new_state(num)
            if hist:
                model([BatchRow(ids[off : off + hist], st)], num)
            states.append(st)
        return states

    alone = [
        model([BatchRow(ids[off + h : off + h + c], st)], num, all_logits=True).logits[0]
        for h, c, off, st in zip(histories, chunks, offsets, fresh_states())
    ]
    rows = [
        BatchRow(ids[off + h : off + h + c], st) for h, c, off, st in zip(histories, chunks, offsets, fresh_states())
    ]
    batched = model(rows, num, all_logits=True).logits
    for i, (got, want) in enumerate(zip(batched, alone)):
        _assert_same(got, want, f"row {i}/{numerics}")
    assert [r.state.num_tokens for r in rows] == [h + c for h, c in zip(histories, chunks)]


def test_mtp_block_is_chunk_exact(mixed_case):
    """The MTP block keeps its own window state: drafting over a prefill in chunks equals one pass."""
    from dsv4serve.model.random_init import random_dense_state
    from dsv4serve.model.transformer import Transformer

    a = mixed_case.args
    args = dataclasses.replace(
        a, n_mtp_layers=1, compress_ratios=a.compress_ratios + (0,), layer_kinds=a.layer_kinds + ("swa",)
    )
    model = Transformer(args).eval()
    model.load_state_dict(random_dense_state(args, seed=3), strict=True)
    num, ids = NUMERICS_ON, mixed_case.token_ids
    n = ids.shape[0] - 1

    def drafts(sizes):
        state, outs, begin = model.new_state(num), [], 0
        for size in sizes:
            main = model([BatchRow(ids[begin : begin + size], state)], num, return_hidden=True)
            outs.append(
                model.forward_mtp(
                    [BatchRow(ids[begin + 1 : begin + size + 1], state)], main.hidden, num, all_logits=True
                ).logits[0]
            )
            begin += size
        return torch.cat(outs)

    full = drafts([n])
    _assert_same(drafts(_random_mix(n, seed=11)), full, "mtp")
