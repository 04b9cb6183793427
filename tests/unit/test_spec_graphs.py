"""Speculative steps on static buffers (worker/spec_graphs.py) on the CPU, eager execution standing in for the
CUDA graphs: verify steps padded to a bucket of rows x (n + 1) tokens and the MTP draft chain fed on the device
give the tokens of the eager path and of no speculation (N = 0), alone and batched with padding rows (3
requests in a bucket of 4), with sampled seeded requests too, and through the expert-slot cache.

The oracle drafter (the target's own greedy continuation, some drafts spoiled) makes rows accept 0..n drafts,
so partial rollbacks happen next to padding rows; the real MTP block runs underneath every step."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
import torch

from dsv4serve.ipc.messages import AddRequest
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.model.kv_pool import KvPool
from dsv4serve.model.numerics import NUMERICS_OFF, NUMERICS_ON, Numerics
from dsv4serve.worker.runner import Runner
from dsv4serve.worker.scheduler import Scheduler, SchedulerLimits
from dsv4serve.worker.spec_graphs import SpecGraphs
from dsv4serve.worker.speculative import Drafter, DraftRow, Drafts

MAX_LEN = 256
INVARIANT = dataclasses.replace(NUMERICS_ON, batch_invariant=True)
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)


class OracleDrafter(Drafter):
    """The target's own continuation (from an N = 0 run) with the positions 0 and 3 mod 5 spoiled (a full
    acceptance advances 2..4 positions, so every residue comes round); the real drafter (catch-up, chain,
    rollback) runs first and its own drafts are replaced."""

    def __init__(self, *args, sequences: dict[str, list[int]], **kwargs):
        super().__init__(*args, **kwargs)
        self.sequences = sequences

    def draft(self, rows: Sequence[DraftRow], device) -> Drafts:
        real = super().draft(rows, device)
        vocab = self.model.args.vocab_size
        out = Drafts()
        for rid in real.tokens:
            seq = self.sequences[rid]
            at = next(r.state.num_tokens for r in rows if r.request_id == rid) + 1
            ids = [seq[p] if p < len(seq) else 0 for p in range(at, at + len(real.tokens[rid]))]
            ids = [(t + 1) % vocab if (at + j) % 5 in (0, 3) else t for j, t in enumerate(ids)]
            out.tokens[rid] = tuple(ids)
            if rid in real.probs:
                out.probs[rid] = torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()
        return out


def _engine(model, num: Numerics, n_spec: int, static: bool, oracle: dict | None = None):
    page = model.args.page_tokens
    limits = SchedulerLimits(8, 16, 64 * page, page, MAX_LEN, model.args.eos_token_id, 0, n_spec)
    pool = KvPool(model.args, num.compute_dtype, 64 + 1, limits.num_slots + 1, include_mtp=n_spec > 0)
    graphs = None
    if static and n_spec:
        graphs = SpecGraphs(model, pool, num, 8, MAX_LEN, n_spec, pool.num_slots - 1, pool.num_pages - 1, False)
    drafter = None
    if n_spec:
        extra = {"sequences": oracle} if oracle is not None else {}
        cls = OracleDrafter if oracle is not None else Drafter
        drafter = cls(model, pool, num, n_spec, graphs=graphs, **extra)
    runner = Runner(model, pool, num, model.args.eos_token_id, torch.device("cpu"), drafter=drafter)
    return Scheduler(limits), runner


def _prompts(n: int) -> dict[str, list[int]]:
    # ragged: windows and compressor ratios (4, 16) close at different offsets in each request
    return {f"r{i}": list(range(100 + 7 * i, 100 + 7 * i + 9 + 13 * i)) for i in range(n)}


def _run(sched, runner, prompts, params=GREEDY, max_tokens=12) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        assert sched.add(AddRequest(rid, prompt, dataclasses.replace(params, max_tokens=max_tokens))) is None
    while sched.has_work:
        plan = sched.schedule(4096)
        for msg in sched.complete(plan, runner.execute(plan)):
            outs[msg.request_id].extend(t.token_id for t in msg.tokens)
    return outs


def _oracle(prompts, outs) -> dict[str, list[int]]:
    return {rid: prompts[rid] + outs[rid] for rid in prompts}


@pytest.mark.parametrize(
    ("n_spec", "n_requests"),
    [(1, 1), (2, 1), (3, 1), (1, 3), (2, 3), pytest.param(3, 3, marks=pytest.mark.slow)],  # (3, 3): about 15 s
)
def test_static_speculative_steps_give_the_eager_and_unspeculated_tokens(tiny_mtp, n_spec, n_requests):
    """Bitwise with --batch-invariant: the padded verify rows and the device-fed chain change no real row."""
    prompts = _prompts(n_requests)
    want = _run(*_engine(tiny_mtp, INVARIANT, 0, False), prompts)
    oracle = _oracle(prompts, want)
    eager_sched, eager = _engine(tiny_mtp, INVARIANT, n_spec, False, oracle)
    assert _run(eager_sched, eager, prompts) == want
    sched, runner = _engine(tiny_mtp, INVARIANT, n_spec, True, oracle)
    assert _run(sched, runner, prompts) == want
    assert sched.spec_accepted_tokens_total == eager_sched.spec_accepted_tokens_total  # the same acceptances
    assert 0 < sched.spec_accepted_tokens_total < sched.spec_draft_tokens_total  # partial: rollbacks happened
    counts = runner.drafter.graphs.counts
    # the steady verify steps on static buffers; prefill steps and mixed ones (drafts cut at max_tokens) eager
    assert counts["verify_static"] >= 3 and runner.eager_drafting_steps >= 1
    assert (counts["chain_static"] > 0) == (n_spec > 1)


@pytest.mark.slow  # (about 20 s on 2 cores)
def test_sampled_seeded_requests_give_the_eager_paths_tokens(tiny_mtp):
    """Seeded sampling (the rejection sampler, drafts drawn from q on the device): the static path's logits are
    the eager path's bit for bit, so each request's random stream picks the same tokens."""
    prompts = _prompts(3)
    eager = _run(*_engine(tiny_mtp, INVARIANT, 3, False), prompts, SAMPLED)
    sched, runner = _engine(tiny_mtp, INVARIANT, 3, True)
    assert _run(sched, runner, prompts, SAMPLED) == eager
    assert runner.drafter.graphs.counts["verify_static"] > 0 and runner.drafter.graphs.counts["chain_static"] > 0
    assert runner.drafter.host_chains == 0  # no penalties: the chain never read a draft back before the next


def test_history_dependent_rows_draft_through_the_host_chain(tiny_mtp):
    """A presence penalty makes each draft's processing look at the drafts before it: those chains read each
    draft back (the eager chain of before), with the same tokens as without static buffers."""
    prompts = _prompts(2)
    params = dataclasses.replace(GREEDY, presence_penalty=0.5)
    want = _run(*_engine(tiny_mtp, INVARIANT, 0, False), prompts, params)
    sched, runner = _engine(tiny_mtp, INVARIANT, 2, True)
    assert _run(sched, runner, prompts, params) == want
    assert runner.drafter.host_chains > 0


@pytest.mark.slow  # (about 15 s on 2 cores)
def test_static_verify_on_the_vectorized_path(tiny_mtp):
    """Without batch invariance (GEMMs whose sums depend on the row count), in fp32 without the FP8 / bf16
    simulations: the padded static steps give the same greedy tokens as the eager ones, nearly always."""
    fp32 = dataclasses.replace(NUMERICS_OFF, compute_dtype=torch.float32)
    prompts = _prompts(3)
    want = _run(*_engine(tiny_mtp, fp32, 2, False), prompts)
    sched, runner = _engine(tiny_mtp, fp32, 2, True)
    got = _run(sched, runner, prompts)
    agree = sum(a == b for rid in want for a, b in zip(want[rid], got[rid])) / sum(map(len, want.values()))
    assert agree >= 0.95, agree
    assert runner.drafter.graphs.counts["verify_static"] > 0


@pytest.mark.slow  # two workers built (about 25 s on 2 cores)
def test_static_speculative_steps_through_the_expert_slot_cache(tiny_dir):
    """The worker as build_engine makes it, its routed experts behind a 3-slot cache (promotions between steps),
    with the speculative buckets attached as a CUDA worker captures them: the tokens of no speculation."""
    from dsv4serve.ipc.messages import Sourced, WorkerLaunch
    from dsv4serve.worker.engine_setup import build_engine

    def launch(**given) -> WorkerLaunch:
        base = dict(to_worker="", from_worker="", model_path=str(tiny_dir), device="cpu")
        sourced = dict(max_num_seqs=4, max_queued_requests=8, max_model_len=512, max_prefill_length=None)
        sourced |= dict(num_tokens=None, batch_invariant=True, moe_cache_size=3) | given
        return WorkerLaunch(**base, **{k: Sourced(v, "cli") for k, v in sourced.items()})

    def greedy(parts) -> dict[str, list[int]]:
        prompts = {"a": list(range(1000, 1021)), "b": list(range(2000, 2009)), "c": list(range(3000, 3013))}
        return _run(parts.scheduler, parts.runner, prompts, max_tokens=8)

    torch.set_num_threads(1)
    want = greedy(build_engine(launch()))
    spec = build_engine(launch(speculative_tokens=2))
    runner, cache = spec.runner, spec.expert_cache
    assert cache is not None and runner.drafter is not None
    pool = runner.pool
    graphs = SpecGraphs(runner.model, pool, runner.numerics, 4, 512, 2, pool.num_slots - 1, pool.num_pages - 1, False,
                        expert_cache=cache)  # fmt: skip
    runner.drafter.graphs = runner.spec_graphs = graphs
    assert greedy(spec) == want
    assert graphs.counts["verify_static"] > 0 and graphs.counts["chain_static"] > 0
