"""The sampler against independent references: Python-math softmax, hand-computed penalties,
analytic nucleus / min-p sets, and observed frequencies over many seeded draws.
Also: tests/unit/test_sampling_params.py (validation, the IPC trip), test_sampling_batch.py (a mixed batch
against a one-row reference, issue #16)."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.worker.sampling import SamplingRow, apply_penalties, make_generator, sample

NUM_DRAWS = 20_000  # rows per distribution check; one sample() call draws them all at once


def _softmax(logits: list[float], temperature: float = 1.0) -> list[float]:
    """Plain-Python softmax, the reference the sampler's frequencies are checked against."""
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    return [w / sum(weights) for w in weights]


def _rows(params: SamplingParams, n: int, eos: int | None = None, outputs=()) -> list[SamplingRow]:
    return [SamplingRow(params, (), tuple(outputs), eos)] * n


def _draw_many(logits: list[float], params: SamplingParams, n: int = NUM_DRAWS) -> torch.Tensor:
    batch = torch.tensor(logits).expand(n, len(logits))  # [n, V]
    return sample(batch, _rows(params, n), generator=make_generator(0, "cpu")).token_ids


def _assert_frequencies(tokens: torch.Tensor, expected: list[float]) -> None:
    """Observed frequency within 5 binomial standard deviations of the expected probability: a
    correct sampler fails this with probability < 1e-6 per token whatever the seed, while a wrong
    distribution (off by > ~0.02 at n = 20,000) fails it. Zero-probability tokens must never appear."""
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=len(expected)).tolist()
    for token, (count, p) in enumerate(zip(counts, expected)):
        if p == 0.0:
            assert count == 0, f"token {token} has probability 0 but was drawn {count} times"
            continue
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(count / n - p) <= 5 * sigma, f"token {token}: observed {count / n:.4f}, expected {p:.4f}"


# ------------------------------------------------------------------------------ greedy limits


def _random_logits(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def _python_argmax(row: list[float]) -> int:
    return max(range(len(row)), key=lambda i: row[i])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1e-4),  # above the greedy cut-off: sampled, but gaps are >> T
    ],
    ids=["greedy", "top_k=1", "top_p tiny", "temperature->0"],
)
def test_greedy_limits_pick_the_argmax(params: SamplingParams) -> None:
    logits = _random_logits(64, 50, seed=1)
    # the temperature limit needs a clear winner: a gap of 0.01 at T=1e-4 leaves odds of e^-100
    ordered = logits.sort(dim=-1, descending=True).values
    assert bool((ordered[:, 0] - ordered[:, 1] > 0.01).all())
    out = sample(logits, _rows(params, 64), generator=make_generator(7, "cpu"))
    assert out.token_ids.tolist() == [_python_argmax(r) for r in logits.tolist()]


def test_input_logits_are_not_modified() -> None:
    logits = _random_logits(4, 30, seed=2)
    before = logits.clone()
    params = SamplingParams(
        temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.5, logprobs=3
    )
    sample(logits, [SamplingRow(params, (1, 2), (3,), 0)] * 4, generator=make_generator(0, "cpu"))
    assert torch.equal(logits, before)


# ------------------------------------------------------------------------------ distributions


def test_top_k_two_emits_only_the_two_best_in_their_renormalised_ratio() -> None:
    logits = [0.3, 1.2, -0.4, 1.0, 0.1]  # the best two are tokens 1 and 3
    p = _softmax(logits)
    kept = p[1] + p[3]
    tokens = _draw_many(logits, SamplingParams(top_k=2))
    _assert_frequencies(tokens, [0.0, p[1] / kept, 0.0, p[3] / kept, 0.0])


def test_top_p_half_emits_exactly_the_nucleus() -> None:
    probs = [0.25, 0.4, 0.05, 0.2, 0.1]
    # sorted: 0.4, 0.25 | 0.2 ...: 0.4 < 0.5 so the nucleus needs the 0.25 too, then reaches 0.65
    tokens = _draw_many([math.log(q) for q in probs], SamplingParams(top_p=0.5))
    _assert_frequencies(tokens, [0.25 / 0.65, 0.4 / 0.65, 0.0, 0.0, 0.0])


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability() -> None:
    probs = [0.16, 0.5, 0.14, 0.12, 0.08]
    # min_p 0.3 * max 0.5 = 0.15: 0.16 just clears it, 0.14 just misses
    tokens = _draw_many([math.log(q) for q in probs], SamplingParams(min_p=0.3))
    _assert_frequencies(tokens, [0.16 / 0.66, 0.5 / 0.66, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_the_scaled_softmax(temperature: float) -> None:
    logits = [1.0, 0.0, -1.0, 0.5]
    tokens = _draw_many(logits, SamplingParams(temperature=temperature))
    _assert_frequencies(tokens, _softmax(logits, temperature))


def test_temperature_two_flattens_and_half_sharpens() -> None:
    logits = [1.0, 0.0, -1.0, 0.5]
    best_share = {
        t: (_draw_many(logits, SamplingParams(temperature=t)) == 0).float().mean().item() for t in (0.5, 1.0, 2.0)
    }
    assert best_share[2.0] < best_share[1.0] < best_share[0.5]


def test_top_p_applies_to_the_top_k_truncated_distribution() -> None:
    probs = [0.3, 0.28, 0.22, 0.2]
    # top_k=3 leaves 0.3, 0.28, 0.22, renormalised over 0.8: token 2 then has 0.725 above it, so
    # top_p=0.7 drops it; top_p on the full distribution (0.58 above it) would have kept it
    tokens = _draw_many([math.log(q) for q in probs], SamplingParams(top_k=3, top_p=0.7))
    _assert_frequencies(tokens, [0.3 / 0.58, 0.28 / 0.58, 0.0, 0.0])


# ------------------------------------------------------------------------------ penalties


def test_penalties_match_hand_computed_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    row = SamplingRow(params, prompt_token_ids=(0, 1), output_token_ids=(2, 2, 3), eos_token_id=None)
    apply_penalties(logits, [row])
    expected = [
        2.0 / 2,  # prompt only: repetition divides a positive logit, no presence/frequency
        -1.0 * 2,  # prompt only: repetition multiplies a negative logit
        0.5 / 2 - 0.5 * 2 - 0.25,  # output twice: repetition, frequency x2, presence once
        -0.5 * 2 - 0.5 * 1 - 0.25,  # output once
        3.0,  # never seen
        0.0,  # never seen
    ]
    assert logits[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_penalties_only_touch_rows_that_ask() -> None:
    logits = torch.tensor([[1.0, -1.0, 2.0], [1.0, -1.0, 2.0]])
    rows = [
        SamplingRow(SamplingParams(), (0, 1), (2,), None),
        SamplingRow(SamplingParams(presence_penalty=-1.0), (0, 1), (2,), None),
    ]
    apply_penalties(logits, rows)
    assert logits.tolist() == [[1.0, -1.0, 2.0], [1.0, -1.0, 3.0]]  # a negative penalty encourages


def test_presence_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    plain = SamplingRow(SamplingParams(temperature=0.0), (), (0,), None)
    penalised = SamplingRow(SamplingParams(temperature=0.0, presence_penalty=0.5), (), (0,), None)
    assert sample(logits, [plain]).token_ids.tolist() == [0]
    assert sample(logits, [penalised]).token_ids.tolist() == [1]


# ------------------------------------------------------------------------------ EOS and stops

EOS, STOP = 4, 2


def _eos_favoured_logits(n: int) -> torch.Tensor:
    return torch.tensor([0.0, 0.1, 6.0, 0.2, 8.0]).expand(n, 5)  # EOS (4) then STOP (2) dominate


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    params = SamplingParams(min_tokens=3, stop_token_ids=(STOP,))
    early = sample(
        _eos_favoured_logits(2000), _rows(params, 2000, EOS, outputs=(0, 1)), generator=make_generator(0, "cpu")
    ).token_ids
    assert not bool(((early == EOS) | (early == STOP)).any())
    done = sample(
        _eos_favoured_logits(1),
        _rows(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(STOP,)), 1, EOS, outputs=(0, 1, 3)),
    ).token_ids
    assert done.tolist() == [EOS]


def test_ignore_eos_never_emits_eos_but_keeps_stop_tokens() -> None:
    params = SamplingParams(ignore_eos=True, stop_token_ids=(STOP,))
    tokens = sample(_eos_favoured_logits(2000), _rows(params, 2000, EOS), generator=make_generator(0, "cpu")).token_ids
    assert not bool((tokens == EOS).any())
    assert bool((tokens == STOP).any())


def test_without_ignore_eos_eos_is_sampled() -> None:
    greedy = sample(_eos_favoured_logits(1), _rows(SamplingParams(temperature=0.0), 1, EOS))
    assert greedy.token_ids.tolist() == [EOS]


# ------------------------------------------------------------------------------ seeds


def _seeded_run(seed: int, num_companions: int, num_steps: int = 12) -> list[int]:
    """Tokens of one seeded row over several steps, batched after the first of `num_companions`
    other rows whose logits and randomness differ from run to run (one of them has its own seed)."""
    vocab_size = 500
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    generator = make_generator(seed, "cpu")
    shared = make_generator(1000 + num_companions, "cpu")
    companion = SamplingRow(SamplingParams(temperature=0.8, top_k=50), (), (), None)
    other_seeded = SamplingRow(SamplingParams(seed=7), (), (), None, make_generator(7, "cpu"))
    position = min(1, num_companions)
    outputs: list[int] = []
    for step in range(num_steps):
        batch = torch.randn(num_companions + 1, vocab_size, generator=shared) * 2  # [B, V]
        batch[position] = torch.randn(vocab_size, generator=torch.Generator().manual_seed(step))
        rows = [companion] * (num_companions + 1)
        rows[position] = SamplingRow(seeded, (), tuple(outputs), None, generator)
        if num_companions >= 2:
            rows[2] = other_seeded
        outputs.append(sample(batch, rows, generator=shared).token_ids[position].item())
    return outputs


def test_seeded_row_is_reproducible_across_batch_compositions() -> None:
    alone = _seeded_run(seed=42, num_companions=0)
    assert _seeded_run(seed=42, num_companions=3) == alone
    assert _seeded_run(seed=42, num_companions=7) == alone


def test_different_seeds_give_different_tokens() -> None:
    assert _seeded_run(seed=42, num_companions=0) != _seeded_run(seed=43, num_companions=0)


def test_seed_without_generator_is_an_error() -> None:
    with pytest.raises(ValueError, match="generator"):
        sample(torch.zeros(1, 3), [SamplingRow(SamplingParams(seed=1), (), (), None)])


# ------------------------------------------------------------------------------ logprobs


def _python_log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    log_norm = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - log_norm for x in row]


def test_logprobs_are_raw_model_logprobs_with_sorted_alternatives() -> None:
    logits = _random_logits(3, 40, seed=5)
    # penalties, temperature and truncation change the draw, never the reported logprobs
    asks = [
        SamplingParams(temperature=0.6, top_k=4, repetition_penalty=1.5, logprobs=5),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(temperature=1.3, min_p=0.05, logprobs=0),
    ]
    rows = [SamplingRow(p, (1, 2, 3), (4, 5), 0) for p in asks]
    out = sample(logits, rows, generator=make_generator(3, "cpu"))
    references = [_python_log_softmax(raw) for raw in logits.tolist()]
    for i in (0, 2):
        assert out.logprobs[i].item() == pytest.approx(references[i][out.token_ids[i].item()], abs=1e-5)
    assert math.isnan(out.logprobs[1].item())  # did not ask: the log-normalizer is not computed for it
    best_five = sorted(range(40), key=lambda t: -references[0][t])[:5]
    assert out.row_top(0) == [(t, pytest.approx(references[0][t], abs=1e-5)) for t in best_five]
    assert out.row_top(1) is None  # did not ask
    assert out.row_top(2) == []  # asked for the chosen token's logprob only


# ------------------------------------------------------------------------------ logit bias, allowed ids, masks, forcing


def test_logit_bias_shifts_the_distribution_by_exp_bias() -> None:
    """A bias b multiplies a token's probability weight by e^b (then renormalised), before temperature."""
    logits = [0.0, 1.0, -0.5, 0.2]
    bias = math.log(3.0)
    params = SamplingParams(temperature=1.0, logit_bias=((2, bias), (0, -100.0)))
    expected = _softmax([logits[0] - 100.0, logits[1], logits[2] + bias, logits[3]])
    _assert_frequencies(_draw_many(logits, params), expected)


def test_allowed_token_ids_restrict_sampling_and_greedy() -> None:
    logits = [3.0, 1.0, 0.5, 0.0, -1.0]
    allowed = SamplingParams(temperature=1.0, allowed_token_ids=(1, 3))
    p1, p3 = _softmax([logits[1], logits[3]])
    _assert_frequencies(_draw_many(logits, allowed), [0.0, p1, 0.0, p3, 0.0])
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=(2, 4))
    assert sample(torch.tensor([logits]), _rows(greedy, 1)).token_ids.tolist() == [2]


class _KeepOnly:
    """A token mask that keeps one token per listed row (stands in for worker/grammar.TokenMask): xgrammar's
    bitmask layout, token t is bit t % 32 of int32 word t // 32, 1 = allowed."""

    def __init__(self, keep: dict[int, int], num_rows: int = 2, vocab_size: int = 3):
        self.rows = sorted(keep)
        self.bitmask = torch.zeros(num_rows, -(-vocab_size // 32), dtype=torch.int32)
        self.bitmask[:, 0] = 0b10  # stale contents of the unconstrained rows (token 1 only): must not apply
        for row, token in keep.items():
            self.bitmask[row, token // 32] = 1 << (token % 32)


def test_token_mask_applies_to_its_rows_only_and_keeps_raw_logprobs() -> None:
    logits = torch.tensor([[4.0, 0.0, 1.0], [4.0, 0.0, 1.0]])
    params = SamplingParams(temperature=0.0, logprobs=0)
    out = sample(logits, _rows(params, 2), token_mask=_KeepOnly({1: 2}))
    assert out.token_ids.tolist() == [0, 2]
    assert math.isclose(float(out.logprobs[1]), float(torch.log_softmax(logits[1], -1)[2]), rel_tol=1e-6)


def test_forced_tokens_win_from_the_start_or_after_their_trigger() -> None:
    logits = torch.tensor([[5.0, 0.0, 0.0, -1.0, 0.0]]).repeat(3, 1)
    forced = SamplingParams(temperature=0.0, forced_tokens=(3, 2), logprobs=0)
    after = SamplingParams(temperature=0.7, seed=1, forced_tokens=(3, 2), forced_after=4)
    rows = [
        SamplingRow(forced, (), (), None),  # due: forced_tokens[0]
        SamplingRow(after, (), (0, 4, 3), None, make_generator(1, "cpu")),  # trigger seen, 1 forced so far
        SamplingRow(after, (), (0, 0), None, make_generator(1, "cpu")),
    ]  # no trigger yet: sampled freely
    out = sample(logits, rows)
    assert out.token_ids[:2].tolist() == [3, 2]
    done = sample(logits[:1], [SamplingRow(forced, (), (3, 2), None)])  # all forced tokens out: free again
    assert done.token_ids.tolist() == [0]
    # the logprob stays the model's own (raw logits), not the forced distribution's
    assert math.isclose(float(out.logprobs[0]), float(torch.log_softmax(logits[0], -1)[3]), rel_tol=1e-6)
