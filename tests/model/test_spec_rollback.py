"""Exact rollback of a speculative verify forward (model/rollback.py): after a row of T tokens of which only
the first K are kept, the sequence's state and the next step's logits are bitwise those of a run that only
ever saw the K tokens. The oracle is that independent run (the model's own chunk exactness, test_incremental,
makes a K-token row and a T-token row agree on their shared positions).

Positions are chosen so that the verify row crosses window boundaries of every compression ratio of the
configs (4, 8, 16) at every offset, and wraps the window ring; every K from 1 to T is tried.
"""

from __future__ import annotations

import pytest
import torch

from dsv4serve.model import rollback
from dsv4serve.model.kv_pool import SequenceState
from dsv4serve.model.numerics import NUMERICS_ON
from dsv4serve.model.transformer import BatchRow

NUM = NUMERICS_ON
VERIFY_TOKENS = 4  # the smallest ratio of the configs: the most one verify may write


def _readable_state(seq: SequenceState) -> list[torch.Tensor]:
    """Everything of the sequence a later forward can read: the slot's whole ring and carry (restored rows
    included), the compressed entries and indexer keys below the sequence's count."""
    pool, out = seq.pool, []
    pages = torch.tensor(seq.pages)
    for layer in pool.layers[: pool.args.n_layers]:
        out.append(layer.swa[seq.slot].clone())
        for c in (layer.comp, layer.idx):
            if c is None:
                continue
            out += [
                t[seq.slot].clone() for t in (c.pending_kv, c.pending_score, c.prev_kv, c.prev_score) if t is not None
            ]
            out.append(c.read(pages, seq.num_tokens // c.ratio).clone())
    return out


def _fresh(model) -> SequenceState:
    """A sequence in a zeroed pool: rows neither run writes compare equal, so the whole ring and carry can."""
    seq = model.new_state(NUM)
    for layer in seq.pool.layers:
        for t in layer.tensors():
            t.zero_()
    return seq


def _spec_then_next(model, ids: torch.Tensor, prefix: int, keep: int, restore: bool) -> tuple[list, torch.Tensor]:
    """Prefix, a verify row of VERIFY_TOKENS tokens keeping `keep`, then the next token's logits."""
    seq = _fresh(model)
    model([BatchRow(ids[:prefix], seq)], NUM)
    layers = range(model.args.n_layers)
    saved = rollback.save(seq.pool, layers, [rollback.SpecRow(seq.slot, prefix, VERIFY_TOKENS)])
    # the rejected tokens differ from what the reference sees next (they are the drafts that were wrong)
    verify = torch.cat((ids[prefix : prefix + keep], (ids[prefix + keep : prefix + VERIFY_TOKENS] + 1) % 150))
    model([BatchRow(verify, seq)], NUM, all_logits=True)
    if restore:
        rollback.restore(saved, [keep])
    seq.num_tokens = prefix + keep
    state = _readable_state(seq)
    nxt = model([BatchRow(ids[prefix + keep : prefix + keep + 1], seq)], NUM).logits[0]
    seq.pool.release(seq)
    return state, nxt


def _reference(model, ids: torch.Tensor, prefix: int, keep: int) -> tuple[list, torch.Tensor]:
    seq = _fresh(model)
    model([BatchRow(ids[:prefix], seq)], NUM)
    model([BatchRow(ids[prefix : prefix + keep], seq)], NUM)
    state = _readable_state(seq)
    nxt = model([BatchRow(ids[prefix + keep : prefix + keep + 1], seq)], NUM).logits[0]
    seq.pool.release(seq)
    return state, nxt


# prefixes: every offset in a ratio-4 window, the approach to the ratio-8 / ratio-16 closings, ring wrap
PREFIXES = [5, 6, 7, 8, 12, 13, 14, 15, 21, 30]


def _check(helpers, config: str, prefixes: list[int], keeps: range) -> None:
    case = helpers.build_case(config)
    model, ids = case.model, case.token_ids
    assert max(prefixes) + VERIFY_TOKENS + 1 <= ids.shape[0]
    for prefix in prefixes:
        for keep in keeps:
            want_state, want_logits = _reference(model, ids, prefix, keep)
            got_state, got_logits = _spec_then_next(model, ids, prefix, keep, restore=True)
            for i, (g, w) in enumerate(zip(got_state, want_state)):
                assert torch.equal(g, w), f"{config} prefix {prefix} keep {keep}: state tensor {i} differs"
            assert torch.equal(got_logits, want_logits), f"{config} prefix {prefix} keep {keep}: next logits"


@pytest.mark.slow  # 80 runs of a tiny model (about 25 s on 2 cores)
@pytest.mark.parametrize("config", ["mixed4", "hca_first"])
def test_rollback_equals_a_run_that_never_saw_the_rejected_tokens(helpers, config):
    case = helpers.build_case(config)
    assert rollback.max_spec_tokens(case.model.new_state(NUM).pool, range(case.args.n_layers)) == VERIFY_TOKENS
    ratios = {r for r in case.args.compress_ratios if r}
    # the verify rows close a window of every ratio at every offset within the row
    closes = {(r, (r - 1 - p % r) % r) for p in PREFIXES for r in ratios if (r - 1 - p % r) % r < VERIFY_TOKENS}
    assert {(r, k) for r in ratios for k in range(VERIFY_TOKENS)} <= closes
    assert max(PREFIXES) > case.args.window_size  # the ring has wrapped
    _check(helpers, config, PREFIXES, range(1, VERIFY_TOKENS + 1))


def test_rollback_at_a_ratio_16_closing_and_the_ring_wrap(helpers):
    """The quick case: the verify row closes the ratio-16 window (prefix 13: at its 3rd token) with the ring
    (window 8) wrapped; a ratio-4 window closes inside it too; kept 1 and 2 tokens (rejected closings)."""
    _check(helpers, "mixed4", [13], range(1, 3))


def test_without_the_rollback_the_state_differs(helpers):
    """The oracle can fail: skipping the restore leaves the rejected tokens' traces."""
    case = helpers.build_case("mixed4")
    model, ids = case.model, case.token_ids
    differs = 0
    for prefix in (6, 13):
        want_state, want_logits = _reference(model, ids, prefix, 1)
        got_state, got_logits = _spec_then_next(model, ids, prefix, 1, restore=False)
        differs += any(not torch.equal(g, w) for g, w in zip(got_state, want_state))
        differs += not torch.equal(got_logits, want_logits)
    assert differs >= 3


def test_a_row_longer_than_the_smallest_ratio_is_refused(helpers):
    case = helpers.build_case("mixed4")
    seq = case.model.new_state(NUM)
    with pytest.raises(ValueError, match="rollback would not be exact"):
        rollback.save(seq.pool, range(case.args.n_layers), [rollback.SpecRow(seq.slot, 0, VERIFY_TOKENS + 1)])
