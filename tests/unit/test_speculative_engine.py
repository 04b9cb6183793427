"""Speculative decoding end to end in one process (scheduler + runner + MTP drafter on dsv4-tiny): with
--batch-invariant, greedy outputs with N = 1, 2, 3 drafts are token for token those with N = 0, alone and
batched, across chunked prefill, prefix reuse and preemption.

dsv4-tiny's random weights make the MTP block's drafts nearly always wrong, which exercises rejection but
hardly acceptance. So the same runs also go through a drafter that proposes the target's own greedy tokens
(read from an N = 0 run: an independent oracle), with some drafts spoiled on purpose: every row then accepts
0..N drafts, and partially accepted rows roll back. The real MTP path still runs underneath (its state is
advanced and its chain rolled back every step); only the proposed tokens are replaced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch

from dsv4serve.ipc.messages import AddRequest
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.model.kv_pool import KvPool
from dsv4serve.model.numerics import NUMERICS_ON
from dsv4serve.worker.runner import Runner
from dsv4serve.worker.scheduler import Scheduler, SchedulerLimits
from dsv4serve.worker.speculative import Drafter, DraftRow, Drafts

NUM = dataclasses.replace(NUMERICS_ON, batch_invariant=True)
MAX_LEN = 256


class OracleDrafter(Drafter):
    """Proposes the target's own greedy continuation (from an N = 0 run), spoiling the drafts whose position
    hits `spoil_every`, so that acceptance is partial; the MTP block still runs (the real drafter's work)."""

    def __init__(self, *args, sequences: dict[str, list[int]], spoil_every: int):
        super().__init__(*args)
        self.sequences, self.spoil_every = sequences, spoil_every

    def draft(self, rows: Sequence[DraftRow], device) -> Drafts:
        real = super().draft(rows, device)
        vocab = self.model.args.vocab_size
        out = Drafts()
        for rid in real.tokens:
            seq = self.sequences[rid]
            at = next(r.state.num_tokens for r in rows if r.request_id == rid) + 1  # the first draft's position
            drafts = []
            for pos in range(at, at + self.num_tokens):
                tok = seq[pos] if pos < len(seq) else 0
                drafts.append((tok + 1) % vocab if pos % self.spoil_every == 0 else tok)
            out.tokens[rid] = tuple(drafts)
            if rid in real.probs:  # a sampled row: its drafts are drawn from q, here one-hot at them
                out.probs[rid] = torch.nn.functional.one_hot(torch.tensor(drafts), vocab).float()
        return out


def _engine(model, n_spec: int, capacity_pages: int = 64, oracle: dict | None = None, spoil_every: int = 3):
    page = model.args.page_tokens
    limits = SchedulerLimits(8, 16, capacity_pages * page, page, MAX_LEN, model.args.eos_token_id, 0, n_spec)
    pool = KvPool(model.args, NUM.compute_dtype, capacity_pages + 1, limits.num_slots + 1, include_mtp=n_spec > 0)
    drafter: Drafter | None = None
    if n_spec and oracle is not None:
        drafter = OracleDrafter(model, pool, NUM, n_spec, sequences=oracle, spoil_every=spoil_every)
    elif n_spec:
        drafter = Drafter(model, pool, NUM, n_spec)
    runner = Runner(model, pool, NUM, model.args.eos_token_id, torch.device("cpu"), drafter=drafter)
    return Scheduler(limits), runner


def _prompts(n: int) -> dict[str, list[int]]:
    # ragged lengths: windows and compressor ratios (4, 16) close at different offsets in each request
    return {f"r{i}": list(range(100 + 7 * i, 100 + 7 * i + 9 + 13 * i)) for i in range(n)}


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
# sampled (temperature > 0: the rejection sampler's path), but top-k 1 leaves one token: greedy's output
TOP1 = SamplingParams(temperature=0.8, top_k=1, seed=5, ignore_eos=True)


def _run(sched, runner, prompts, max_tokens=12, chunk=4096, staggered=False, params=GREEDY) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {rid: [] for rid in prompts}
    pending = list(prompts.items())
    params = dataclasses.replace(params, max_tokens=max_tokens)
    while pending or sched.has_work:
        # staggered: the next request arrives once the previous one is done (prefix reuse needs a ready snapshot)
        if pending and (not staggered or not sched.has_work):
            rid, prompt = pending.pop(0)
            assert sched.add(AddRequest(rid, prompt, params)) is None
            if staggered:
                continue
        plan = sched.schedule(chunk)
        for msg in sched.complete(plan, runner.execute(plan)):
            outs[msg.request_id].extend(t.token_id for t in msg.tokens)
    return outs


def _oracle(prompts, outs) -> dict[str, list[int]]:
    return {rid: prompts[rid] + outs[rid] for rid in prompts}


@pytest.mark.parametrize("n_spec", [1, 2, 3])
def test_one_request_with_the_real_drafter_equals_no_speculation(tiny_mtp, n_spec):
    prompts = _prompts(1)
    want = _run(*_engine(tiny_mtp, 0), prompts)
    sched, runner = _engine(tiny_mtp, n_spec)
    assert _run(sched, runner, prompts) == want
    assert sched.spec_drafts_total > 0 and sched.spec_draft_tokens_total >= sched.spec_drafts_total


@pytest.mark.parametrize("n_spec", [1, 3])
def test_batched_chunked_prefill_with_accepted_drafts_equals_no_speculation(tiny_mtp, n_spec):
    prompts = _prompts(3)
    want = _run(*_engine(tiny_mtp, 0), prompts, chunk=24)
    sched, runner = _engine(tiny_mtp, n_spec, oracle=_oracle(prompts, want))
    assert _run(sched, runner, prompts, chunk=24) == want
    # the oracle drafts are accepted in part: multi-token acceptance and partial rollbacks both happened
    assert 0 < sched.spec_accepted_tokens_total < sched.spec_draft_tokens_total
    if n_spec > 1:
        assert sched.spec_accepted_tokens_total > sched.spec_drafts_total / 2


@pytest.mark.slow  # (about 8 s on 2 cores; the oracle drafter's batched test covers the same paths)
def test_batched_with_the_real_drafter_equals_no_speculation(tiny_mtp):
    prompts = _prompts(3)
    want = _run(*_engine(tiny_mtp, 0), prompts, chunk=24)
    assert _run(*_engine(tiny_mtp, 2), prompts, chunk=24) == want


def test_prefix_reuse_equals_no_speculation(tiny_mtp):
    page = tiny_mtp.args.page_tokens
    shared = list(range(300, 300 + 2 * page + 3))
    prompts = {"a": shared + [5, 6, 7], "b": shared + [9, 10], "c": shared[: 2 * page] + [11]}
    want = _run(*_engine(tiny_mtp, 0), prompts, staggered=True)
    sched, runner = _engine(tiny_mtp, 2, oracle=_oracle(prompts, want))
    assert _run(sched, runner, prompts, staggered=True) == want
    assert sched.prefix_hits_tokens >= 2 * page  # the later prompts started from a snapshot
    assert 0 < sched.spec_accepted_tokens_total < sched.spec_draft_tokens_total


def test_preemption_equals_no_speculation(tiny_mtp):
    """A pool too small for every request at once: requests are preempted and recomputed."""
    prompts = _prompts(3)
    want = _run(*_engine(tiny_mtp, 0), prompts, max_tokens=20)
    sched, runner = _engine(tiny_mtp, 3, capacity_pages=6, oracle=_oracle(prompts, want))
    preempted = []
    original = sched._preempt

    def spy(req):
        preempted.append(req.request_id)
        original(req)

    sched._preempt = spy
    assert _run(sched, runner, prompts, max_tokens=20) == want
    assert preempted
    assert 0 < sched.spec_accepted_tokens_total < sched.spec_draft_tokens_total


@pytest.mark.parametrize("oracle", [False, True])
def test_sampled_requests_go_through_rejection_sampling_with_greedys_tokens_at_top_k_1(tiny_mtp, oracle):
    """temperature 0.8, top-k 1: the target's distribution is one-hot at its argmax, so rejection sampling (the
    sampled path: drafts with their q, acceptance tests, the residual's draw) must give greedy's tokens."""
    prompts = _prompts(2)
    want = _run(*_engine(tiny_mtp, 0), prompts, chunk=24)
    sched, runner = _engine(tiny_mtp, 2, oracle=_oracle(prompts, want) if oracle else None)
    assert _run(sched, runner, prompts, chunk=24, params=TOP1) == want
    assert sched.spec_drafts_total > 0 and not runner.draft_probs  # the finished requests' q were freed
    if oracle:
        assert 0 < sched.spec_accepted_tokens_total < sched.spec_draft_tokens_total


def _run_messages(sched, runner, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Every output message's tokens and prompt logprobs, by request (all admitted at once)."""
    for rid, prompt, params in requests:
        assert sched.add(AddRequest(rid, prompt, params)) is None
    tokens: dict = {rid: [] for rid, _, _ in requests}
    prompt_lps: dict = {}
    while sched.has_work:
        plan = sched.schedule(24)
        for msg in sched.complete(plan, runner.execute(plan)):
            tokens[msg.request_id].extend(msg.tokens)
            if msg.prompt_logprobs is not None:
                prompt_lps[msg.request_id] = msg.prompt_logprobs
    return {"tokens": tokens, "prompt_logprobs": prompt_lps}


def test_logprobs_and_prompt_logprobs_beside_verify_rows_equal_no_speculation(tiny_mtp):
    """Greedy with logprobs (each verified position's logprobs are the decode step's) next to a request asking
    for prompt logprobs (a step with every position's logits, the verify rows' among them)."""
    prompts = _prompts(2)
    requests = [
        ("r0", prompts["r0"], dataclasses.replace(GREEDY, max_tokens=10, logprobs=2)),
        ("r1", prompts["r1"], dataclasses.replace(GREEDY, max_tokens=6, prompt_logprobs=1)),
    ]
    want = _run_messages(*_engine(tiny_mtp, 0), requests)
    oracle = {rid: prompt + [t.token_id for t in want["tokens"][rid]] for rid, prompt, _ in requests}
    sched, runner = _engine(tiny_mtp, 3, oracle=oracle)
    assert _run_messages(sched, runner, requests) == want
    assert want["tokens"]["r0"][0].top and len(want["prompt_logprobs"]["r1"]) == len(prompts["r1"])
    assert 0 < sched.spec_accepted_tokens_total < sched.spec_draft_tokens_total
