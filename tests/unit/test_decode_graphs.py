"""The decode replay path (worker/graphs.py) on the CPU, with eager execution standing in for the CUDA
graph: static buffers, padding rows and bucket choice give the same tokens as the unpadded step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4serve.checkpoint.loader import load_dense_state_dict, open_checkpoint
from dsv4serve.experts.attach import attach_expert_cache, iter_resident_dense
from dsv4serve.experts.pinning import PinBudget
from dsv4serve.ipc.messages import AddRequest
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.model.kv_pool import KvPool
from dsv4serve.model.numerics import NUMERICS_OFF, NUMERICS_ON
from dsv4serve.model.transformer import Transformer
from dsv4serve.worker.graphs import DecodeGraphs, bucket_sizes
from dsv4serve.worker.runner import Runner
from dsv4serve.worker.scheduler import Scheduler, SchedulerLimits

MAX_LEN = 512


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    args, state = load_dense_state_dict(tiny_dir)
    model = Transformer(args, include_mtp=False).eval()
    model.load_state_dict({k: v for k, v in state.items() if not k.startswith("mtp.")}, strict=True)
    return model


def _engine(model, batch_invariant: bool, graphs: bool, base=NUMERICS_ON, expert_cache=None):
    num = dataclasses.replace(base, batch_invariant=batch_invariant)
    page = model.args.page_tokens
    limits = SchedulerLimits(8, 8, 64 * page, page, MAX_LEN, model.args.eos_token_id)
    pool = KvPool(model.args, num.compute_dtype, num_pages=64 + 1, num_slots=limits.num_slots + 1)
    pad = (pool.num_slots - 1, pool.num_pages - 1)
    g = DecodeGraphs(model, pool, num, 8, MAX_LEN, *pad, capture=False, expert_cache=expert_cache)
    runner = Runner(model, pool, num, model.args.eos_token_id, torch.device("cpu"), graphs=g if graphs else None)
    return Scheduler(limits), runner, g


def _generate(
    model, batch_invariant: bool, graphs: bool, n_requests: int, base=NUMERICS_ON, expert_cache=None
) -> tuple[list[list[int]], list[int]]:
    sched, runner, g = _engine(model, batch_invariant, graphs, base, expert_cache)
    for i in range(n_requests):
        prompt = list(range(100 + 7 * i, 100 + 7 * i + 20 + 9 * i))  # ragged: some windows close mid-decode
        sched.add(AddRequest(f"r{i}", prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10)))
    buckets, outs = [], {}
    while sched.has_work:
        plan = sched.schedule(4096)
        if plan.rows and all(len(r.token_ids) == 1 for r in plan.rows):
            buckets.append(g.bucket_for(len(plan.rows)))
        for msg in sched.complete(plan, runner.execute(plan)):
            outs.setdefault(msg.request_id, []).extend(t.token_id for t in msg.tokens)
    return [outs[f"r{i}"] for i in range(n_requests)], buckets


def test_buckets():
    assert bucket_sizes(1) == (1,) and bucket_sizes(8) == (1, 2, 4, 8) and bucket_sizes(12) == (1, 2, 4, 8, 12)


@pytest.mark.parametrize("n_requests", [1, 3])
def test_padded_replay_gives_the_unpadded_tokens(tiny, n_requests):
    """Bitwise with --batch-invariant: each row is independent of the padding beside it."""
    want, _ = _generate(tiny, batch_invariant=True, graphs=False, n_requests=n_requests)
    got, buckets = _generate(tiny, batch_invariant=True, graphs=True, n_requests=n_requests)
    assert got == want
    assert buckets and all(b >= 1 for b in buckets) and max(buckets) == {1: 1, 3: 4}[n_requests]


def test_padded_replay_on_the_vectorized_path(tiny):
    """Without batch invariance (the vectorized decode paths, whose GEMMs sum in an order that depends on the
    row count): in fp32 without the FP8 / bf16 simulations (where a one-ulp difference cannot flip a
    rounding), the same greedy tokens, padding or not."""
    fp32 = dataclasses.replace(NUMERICS_OFF, compute_dtype=torch.float32)
    want, _ = _generate(tiny, batch_invariant=False, graphs=False, n_requests=3, base=fp32)
    got, _ = _generate(tiny, batch_invariant=False, graphs=True, n_requests=3, base=fp32)
    agree = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g)) / sum(map(len, want))
    assert agree >= 0.95, agree


def _offloaded(tiny_dir, slots: int):
    """dsv4-tiny with its routed experts in a host bank behind `slots` slots (the torch slot-cache path)."""
    ckpt = open_checkpoint(tiny_dir)
    model = Transformer(ckpt.args, include_mtp=False).eval()
    cache = attach_expert_cache(model, ckpt, slots, torch.device("cpu"), PinBudget(0, "native", "test"), progress=False)
    model.load_state_dict(dict(iter_resident_dense(ckpt, progress=False)), strict=False)
    ckpt.source.close()
    assert cache is not None
    return model, cache


def test_padding_rows_route_as_requests_and_count_no_expert_use(tiny_dir):
    """Three requests decode in the 4-row bucket: the padding row takes request 0's routing, so the expert-slot
    cache records exactly the unpadded steps' uses and hits (the token-0 padding row's own experts would add
    uses every step, and the cache would spend slots on them)."""
    runs = []
    for graphs in (False, True):
        model, cache = _offloaded(tiny_dir, slots=12)
        tokens, buckets = _generate(model, True, graphs, n_requests=3, expert_cache=cache)
        cache.collect_usage()
        runs.append((tokens, buckets, cache.usage.clone(), cache.stats.queries, cache.stats.hits))
    (want, _, want_usage, *want_stats), (got, buckets, usage, *stats) = runs
    assert got == want and 4 in buckets
    assert torch.equal(usage, want_usage) and stats == want_stats
