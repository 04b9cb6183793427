"""Speculative rejection sampling (worker/spec_sampling.py) against its specification: greedy verification by
hand and against step-by-step greedy decoding with `sampling.sample`; sampled verification by the distribution of
its outputs, which must be the target's whatever the drafter proposes.

Statistics: a chi-square goodness-of-fit test of the observed counts against the exact target probabilities. The
seeds are fixed, so each test is deterministic; were they not, a correct sampler would fail a check with
probability ALPHA (the p-value threshold), and each test also shows the check has the power to see a wrong
distribution (the draft's, or the target's with a draft token always accepted)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dsv4serve.api.metrics import Metrics
from dsv4serve.ipc.messages import Codec, FromWorker, Stats
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.worker.sampling import SamplingRow, make_generator, sample
from dsv4serve.worker.spec_sampling import (
    SpecDecodeStats,
    SpecOutput,
    SpecRandomness,
    draft_tokens,
    draw_randomness,
    rejection_sample,
    verify,
)

ALPHA = 1e-6  # false-failure probability of one chi-square check
ROWS = 20_000
V = 8
CPU = torch.device("cpu")


def chi_square_p_value(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi2 >= statistic) for counts `observed` [K] against probabilities `probs` [K] (cells with p = 0 must be
    empty: any count there fails outright)."""
    observed, probs = observed.double().flatten(), probs.double().flatten()
    if (observed[probs == 0] > 0).any():
        return 0.0
    live = probs > 0
    expected = probs[live] * observed.sum()
    statistic = ((observed[live] - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(live.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))  # the chi-square survival function


def random_dist(gen: torch.Generator, *shape: int, zeros: int = 0) -> torch.Tensor:
    """Random distributions over the last dim; `zeros` of the tokens (the last ones) get no mass."""
    w = torch.rand(*shape, generator=gen).pow(3) + 1e-3
    if zeros:
        w[..., -zeros:] = 0
    return w / w.sum(-1, keepdim=True)


def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[..., V] -> one independent draw per leading index (torch.multinomial: an independent sampler)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=gen).view(probs.shape[:-1])


def shared_randomness(rows: int, num_drafts: int, gen: torch.Generator) -> SpecRandomness:
    return SpecRandomness(torch.rand(rows, num_drafts, generator=gen), torch.empty(rows, V).exponential_(generator=gen))


# --------------------------------------------------------------------------- greedy


def test_greedy_accepts_while_the_draft_is_the_target_argmax():
    gen = torch.Generator().manual_seed(1)
    p = random_dist(gen, 3, 4, V)  # [R=3, N+1=4, V]; not one-hot: greedy must use the argmax only
    best = p.argmax(-1)  # [3, 4]
    wrong = (best + 1) % V
    drafts = torch.stack(
        [
            best[0, :3],  # all three right: bonus = argmax p_3
            torch.stack([best[1, 0], wrong[1, 1], best[1, 2]]),  # second wrong: stop there
            torch.stack([wrong[2, 0], best[2, 1], best[2, 2]]),  # first wrong: nothing accepted
        ]
    )
    q = random_dist(gen, 3, 3, V)  # ignored by greedy rows
    noise = SpecRandomness(torch.zeros(3, 3), torch.ones(3, V))
    out = rejection_sample(p, q, drafts, noise, greedy=torch.ones(3, dtype=torch.bool))
    assert out.num_accepted.tolist() == [3, 1, 0]
    assert out.token_ids.tolist() == [
        [*best[0, :3].tolist(), int(best[0, 3])],
        [int(best[1, 0]), int(best[1, 1]), -1, -1],
        [int(best[2, 0]), -1, -1, -1],
    ]
    assert SpecOutput.tokens_from_host(out.packed().tolist(), 3) == [
        out.token_ids[0].tolist(),
        out.token_ids[1, :2].tolist(),
        out.token_ids[2, :1].tolist(),
    ]


def test_greedy_verify_equals_decoding_one_token_at_a_time_with_penalties():
    """The oracle: N = 0, i.e. `sample` called once per position with the output so far (a repetition penalty
    and min_tokens make each position's processing depend on the drafts before it)."""
    gen = torch.Generator().manual_seed(2)
    vocab, num_drafts = 16, 3
    params = SamplingParams(temperature=0.0, repetition_penalty=1.8, min_tokens=3, seed=7)
    row = SamplingRow(params, (3, 4), (5,), eos_token_id=0, generator=make_generator(7, "cpu"))
    state = row.generator.get_state()
    logits = torch.randn(1, num_drafts + 1, vocab, generator=gen) * 3
    logits[0, :, 0] += 10  # EOS would win but for min_tokens
    expected, history = [], list(row.output_token_ids)
    for j in range(num_drafts + 1):
        at_j = SamplingRow(params, row.prompt_token_ids, history, 0, row.generator)
        expected.append(int(sample(logits[:, j], [at_j]).token_ids[0]))
        history.append(expected[-1])
    for bad in (None, 0, 1, 2):  # all drafts right, or the first wrong one at `bad`
        drafts = list(expected[:num_drafts])
        if bad is not None:
            drafts[bad] = (drafts[bad] + 1) % vocab
        q = torch.full((1, num_drafts, vocab), 1.0 / vocab)
        out = verify(logits, q, torch.tensor([drafts]), [row], draft_token_ids_host=[drafts])
        kept = num_drafts if bad is None else bad
        assert int(out.num_accepted[0]) == kept
        assert out.token_ids[0, : kept + 1].tolist() == expected[: kept + 1]
    assert torch.equal(row.generator.get_state(), state)  # greedy takes no randomness


# --------------------------------------------------------------------------- sampled: the distribution


def first_tokens(p: torch.Tensor, q: torch.Tensor, gen: torch.Generator) -> SpecOutput:
    """ROWS verify steps of the same (p, q): p [N+1, V], q [N, V]; drafts drawn from q."""
    num_drafts = q.shape[0]
    drafts = draw(q.expand(ROWS, -1, -1), gen)  # [ROWS, N]
    randomness = shared_randomness(ROWS, num_drafts, gen)
    return rejection_sample(p.expand(ROWS, -1, -1), q.expand(ROWS, -1, -1), drafts, randomness)


def test_first_token_follows_the_target_for_any_draft():
    gen = torch.Generator().manual_seed(3)
    p0 = random_dist(gen, V, zeros=2)  # the target gives two tokens no mass (as top-k would)
    far = torch.zeros(V)
    far[-3:] = 1 / 3  # the draft proposes mostly tokens the target never emits
    pairs = {
        "random q": random_dist(gen, V),
        "q far from p": 0.98 * far + 0.02 / V,
        "q = p": p0,
    }
    for num_drafts in (1, 3):
        later = random_dist(gen, num_drafts, V)  # p_1..p_N: do not affect the first token
        for name, q1 in pairs.items():
            p = torch.cat([p0[None], later])
            q = torch.cat([q1[None], random_dist(gen, num_drafts - 1, V)])
            out = first_tokens(p, q, gen)
            counts = torch.bincount(out.token_ids[:, 0], minlength=V)
            assert chi_square_p_value(counts, p0) > ALPHA, (name, num_drafts, counts.tolist())
            if name == "q = p":
                assert int(out.num_accepted.min()) >= 1  # p_0(d) / q_1(d) = 1: d_1 always accepted
            else:  # the check sees a wrong answer: the drafts' own distribution is far from p_0
                drafted = torch.bincount(draw(q1.expand(ROWS, -1), gen), minlength=V)
                assert chi_square_p_value(drafted, p0) < ALPHA, name


def test_all_drafts_accepted_when_draft_equals_target():
    gen = torch.Generator().manual_seed(4)
    p = random_dist(gen, 3, V)
    out = first_tokens(p, p[:2].clone(), gen)  # N = 2, q_i = p_{i-1}
    assert bool((out.num_accepted == 2).all())
    counts = torch.bincount(out.token_ids[:, 2], minlength=V)  # the bonus token: from p_2
    assert chi_square_p_value(counts, p[2]) > ALPHA


def test_first_two_tokens_follow_the_target_chain_with_two_drafts():
    """A Markov target P(x' | x) and a Markov drafter Q(x' | x), N = 2: the first two output tokens after a
    context token c must be distributed as P(x1 | c) P(x2 | x1), whether x2 came from this verify step or from
    the next one (rows that accepted nothing take their second token from a second step)."""
    gen = torch.Generator().manual_seed(5)
    target = random_dist(gen, V, V)  # [V, V]: row x is P(. | x)
    drafter = 0.5 * random_dist(gen, V, V) + 0.5 * target  # a fair drafter: some acceptance, some rejection
    context = 2

    def step(last: torch.Tensor) -> SpecOutput:
        d1 = draw(drafter[last], gen)
        d2 = draw(drafter[d1], gen)
        p = torch.stack([target[last], target[d1], target[d2]], dim=1)  # [R, 3, V]
        q = torch.stack([drafter[last], drafter[d1]], dim=1)  # [R, 2, V]
        return rejection_sample(p, q, torch.stack([d1, d2], 1), shared_randomness(len(last), 2, gen))

    first = step(torch.full((ROWS,), context))
    x1 = first.token_ids[:, 0]
    again = step(x1)  # only used where the first step produced one token
    x2 = torch.where(first.num_accepted >= 1, first.token_ids[:, 1], again.token_ids[:, 0])
    joint = torch.bincount(x1 * V + x2, minlength=V * V)
    expected = target[context][:, None] * target  # [V, V]: P(x1 | c) P(x2 | x1)
    assert 0.1 < float((first.num_accepted >= 1).float().mean()) < 0.9  # both branches are exercised
    assert chi_square_p_value(joint, expected) > ALPHA
    # power: accepting d_1 always (no rejection test) would give the drafter's x1, which the check refuses
    always = draw(drafter[context].expand(ROWS, -1), gen)
    assert chi_square_p_value(torch.bincount(always, minlength=V), target[context]) < ALPHA


# --------------------------------------------------------------------------- the sampler's own processing


def test_verify_draws_from_the_requests_processed_distribution():
    """Temperature and top-k applied by hand are the oracle for the first token's distribution; the drafts come
    from `draft_tokens` on other logits, as the MTP block's would."""
    gen = torch.Generator().manual_seed(6)
    params = SamplingParams(temperature=0.7, top_k=5)
    rows = [SamplingRow(params, (), (), None)] * ROWS
    target_logits = torch.randn(2, V, generator=gen) * 2  # p_0, p_1 (the same for every row)
    draft_logits = target_logits[0] + torch.randn(V, generator=gen)
    d, q = draft_tokens(draft_logits.expand(ROWS, -1), rows, generator=gen)
    out = verify(target_logits.expand(ROWS, -1, -1), q[:, None], d[:, None], rows, generator=gen)
    scaled = target_logits[0] / 0.7
    kept = scaled >= scaled.topk(5).values[-1]
    expected = torch.where(kept, scaled, float("-inf")).softmax(-1)
    assert chi_square_p_value(torch.bincount(out.token_ids[:, 0], minlength=V), expected) > ALPHA
    drafted = torch.bincount(d, minlength=V)
    q_expected = (draft_logits / 0.7).masked_fill(draft_logits < draft_logits.topk(5).values[-1], float("-inf"))
    assert chi_square_p_value(drafted, q_expected.softmax(-1)) > ALPHA  # d ~ q: the drafter's own processing


def test_a_seeded_row_is_reproducible_and_independent_of_its_batch():
    gen = torch.Generator().manual_seed(8)
    vocab, num_drafts = 32, 2
    logits = torch.randn(3, num_drafts + 1, vocab, generator=gen)
    q = random_dist(gen, 3, num_drafts, vocab)
    d = draw(q, gen)
    seeded = SamplingParams(temperature=1.0, seed=11)
    other = SamplingParams(temperature=0.9)

    def run(batch: list[int]) -> torch.Tensor:
        rows = [SamplingRow(seeded if i == 0 else other, (), (), None, make_generator(11, "cpu") if i == 0 else None)
                for i in batch]  # fmt: skip
        results = []
        for _ in range(5):  # five verify steps on one generator, as a request's life
            out = verify(logits[batch], q[batch], d[batch], rows, generator=gen)
            results.append(out.token_ids[0])
        return torch.stack(results)

    alone = run([0])
    assert torch.equal(alone, run([0, 1, 2]))
    assert torch.equal(alone, run([0, 2]))
    assert len({tuple(r.tolist()) for r in alone}) > 1  # the generator advanced between steps


def test_randomness_leaves_greedy_generators_alone():
    greedy = SamplingRow(SamplingParams(temperature=0.0, seed=3), (), (), None, make_generator(3, "cpu"))
    sampled = SamplingRow(SamplingParams(temperature=1.0, seed=4), (), (), None, make_generator(4, "cpu"))
    before = greedy.generator.get_state(), sampled.generator.get_state()
    draw_randomness([greedy, sampled], 2, V, CPU)
    assert torch.equal(greedy.generator.get_state(), before[0])
    assert not torch.equal(sampled.generator.get_state(), before[1])


# --------------------------------------------------------------------------- metrics


def test_spec_decode_counters_reach_prometheus():
    counted = SpecDecodeStats()
    counted.record(num_drafts=4, draft_tokens=8, accepted=5)
    counted.record(num_drafts=2, draft_tokens=4, accepted=4)
    assert counted.acceptance_rate == 9 / 12
    base = dict(num_running=1, num_waiting=0, kv_usage=0.5, prefill_chunk_tokens=256, oom_recoveries_total=0)
    codec = Codec(FromWorker)
    stats = codec.decode(
        codec.encode(Stats(**base, prefix_cache_queries_total=0, prefix_cache_hits_total=0, **counted.stats_fields()))
    )
    text = Metrics(SimpleNamespace(stats=stats, ready_info=None, worker_restarts_total=0)).render().decode()
    lines = text.splitlines()
    assert "dsv4serve:spec_decode_num_drafts_total 6.0" in lines
    assert "dsv4serve:spec_decode_num_draft_tokens_total 12.0" in lines
    assert "dsv4serve:spec_decode_num_accepted_tokens_total 9.0" in lines
