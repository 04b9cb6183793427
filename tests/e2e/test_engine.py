"""The engine as the API process sees it: a spawned worker, typed messages over ZeroMQ ipc."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from dsv4serve.checkpoint.loader import load_dense_state_dict
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.memory.chunk_planner import prefill_geometry
from dsv4serve.model.args import read_model_args
from dsv4serve.model.numerics import NUMERICS_ON
from dsv4serve.model.transformer import BatchRow, Transformer
from dsv4serve.supervisor import EngineUnavailable, RequestRejected, WorkerDied

from .conftest import launch_for, start_client

PROMPT = [128803] + list(range(1000, 1037)) + [128804]  # 39 tokens: windows fill, compressors close


async def collect(client, rid, prompt, params):
    tokens, outs = [], []
    async for out in client.generate(rid, prompt, params):
        outs.append(out)
        tokens += [t.token_id for t in out.tokens]
    return tokens, outs


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def model_alone(tiny_dir):
    """Greedy continuation computed in this process, by the model alone: no scheduler, no IPC."""
    args, state = load_dense_state_dict(tiny_dir)
    model = Transformer(args)
    model.load_state_dict(state)

    def continuation(prompt: list[int], n: int) -> list[int]:
        seq = model.new_state(NUMERICS_ON)
        logits = model.forward([BatchRow(torch.tensor(prompt), seq)], NUMERICS_ON).logits[0]
        out = []
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = model.forward([BatchRow(torch.tensor(out[-1:]), seq)], NUMERICS_ON).logits[0]
        return out

    return continuation


@pytest.fixture(scope="module")
def reference_tokens(model_alone):
    return model_alone(PROMPT, 8)


def test_ready_reports_what_was_allocated(engine):
    _, client = engine
    ready = client.ready_info
    assert ready.device == "cpu" and ready.kv_capacity_tokens > 0 and ready.max_running_requests == 8
    assert ready.max_model_len == 4096 and ready.chunk.effective_tokens > 0 and ready.chunk.binding
    assert client.healthy


def test_greedy_output_equals_the_model_run_alone(engine, reference_tokens):
    lt, client = engine
    tokens, outs = lt.run(collect(client, "g1", PROMPT, greedy(8)))
    assert tokens == reference_tokens
    assert outs[-1].finish_reason == "length" and outs[-1].num_prompt_tokens == len(PROMPT)


def test_concurrent_requests_equal_each_alone(engine):
    lt, client = engine
    prompts = [PROMPT, PROMPT[:17], PROMPT[:5] + PROMPT, PROMPT[3:30]]

    async def alone_then_together():
        alone = [(await collect(client, f"a{i}", p, greedy(6)))[0] for i, p in enumerate(prompts)]
        together = await asyncio.gather(*[collect(client, f"t{i}", p, greedy(6)) for i, p in enumerate(prompts)])
        return alone, [t for t, _ in together]

    alone, together = lt.run(alone_then_together())
    assert together == alone


def test_seeded_sampling_is_reproducible(engine):
    lt, client = engine
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=6, ignore_eos=True, logprobs=2)
    first, outs = lt.run(collect(client, "s1", PROMPT, params))
    second, _ = lt.run(collect(client, "s2", PROMPT, params))
    other, _ = lt.run(
        collect(client, "s3", PROMPT, SamplingParams(temperature=1.0, seed=99, max_tokens=6, ignore_eos=True))
    )
    assert first == second and first != other
    tok = outs[0].tokens[0]
    assert tok.logprob is not None and tok.logprob <= 0 and len(tok.top) == 2


def test_prefix_reuse_reports_cached_tokens_and_changes_nothing(engine, model_alone):
    lt, client = engine
    base = list(range(2000, 2045))  # 45 tokens: two whole 16-token pages can be shared
    longer = base + list(range(3000, 3020))
    cold, cold_outs = lt.run(collect(client, "p1", base, greedy(5)))
    warm, warm_outs = lt.run(collect(client, "p2", base, greedy(5)))
    ext, ext_outs = lt.run(collect(client, "p3", longer, greedy(5)))
    assert cold_outs[-1].num_cached_tokens == 0
    assert warm_outs[-1].num_cached_tokens == 32 and ext_outs[-1].num_cached_tokens == 32
    assert cold == warm == model_alone(base, 5)
    assert ext == model_alone(longer, 5)
    time.sleep(0.3)
    assert client.stats.prefix_cache_hits_total >= 64


def test_prompt_logprobs_equal_the_model_run_alone(engine, tiny_dir, model_alone):
    lt, client = engine
    prompt = list(range(4000, 4037))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    _, outs = lt.run(collect(client, "plp", prompt, params))
    got = outs[0].prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    args, state = load_dense_state_dict(tiny_dir)
    model = Transformer(args)
    model.load_state_dict(state)
    logits = model.forward(
        [BatchRow(torch.tensor(prompt), model.new_state(NUMERICS_ON))], NUMERICS_ON, all_logits=True
    ).logits[0]
    want = torch.log_softmax(logits.float(), dim=-1)
    for p in range(1, len(prompt)):
        assert got[p].token_id == prompt[p]
        assert got[p].logprob == pytest.approx(float(want[p - 1, prompt[p]]), abs=1e-5)
        best = want[p - 1].topk(2)
        assert [t.token_id for t in got[p].top] == best.indices.tolist()


def test_abort_on_disconnect_frees_the_request_within_a_second(engine):
    lt, client = engine

    async def start_and_leave():
        gen = client.generate("ab1", PROMPT, greedy(500))
        await gen.__anext__()
        await gen.aclose()  # what the API does when the client disconnects
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            s = client.stats
            if s is not None and s.num_running == 0 and s.kv_usage == 0:
                return True
        return False

    assert lt.run(start_and_leave())


def test_full_queue_answers_503(loop_thread, tiny_dir):
    client = start_client(loop_thread, launch_for(tiny_dir, max_num_seqs=1, max_queued_requests=1))
    try:

        async def flood():
            return await asyncio.gather(
                *[collect(client, f"q{i}", PROMPT, greedy(20)) for i in range(3)], return_exceptions=True
            )

        results = loop_thread.run(flood())
        rejected = [r for r in results if isinstance(r, RequestRejected)]
        assert len(rejected) == 1 and rejected[0].status == 503
        assert sum(isinstance(r, tuple) for r in results) == 2
    finally:
        loop_thread.run(client.shutdown())


def test_offloaded_experts_through_a_small_slot_cache_give_the_same_tokens(loop_thread, tiny_dir, reference_tokens):
    # 3 device slots for 8 routed experts per layer: most experts are read from the host bank
    client = start_client(loop_thread, launch_for(tiny_dir, moe_cache_size=3))
    try:
        tokens, _ = loop_thread.run(collect(client, "offload", PROMPT, greedy(8)))
        assert tokens == reference_tokens
        assert client.ready_info.expert_slots == 3 and client.ready_info.expert_bank
        time.sleep(1.5)  # the next Stats message carries the cache's counters
        stats = client.stats
        # 3 slots for 5 layers' experts: most uses read the bank; the hottest experts are promoted into
        # the slots between steps (experts/slot_cache.py), each promotion a counted copy
        assert stats.expert_cache_queries_total > stats.expert_cache_hits_total
        assert stats.expert_cache_prefetches_total > 0 and stats.expert_cache_h2d_bytes_total > 0
    finally:
        loop_thread.run(client.shutdown())


def test_oom_in_a_prefill_chunk_shrinks_the_chunk_and_the_request_completes(
    loop_thread, tiny_dir, reference_tokens, monkeypatch
):
    # fault injection (testing only, env.py): a step whose activations pass the budget of 24 tokens (at
    # the planner's own bytes per token) raises torch.OutOfMemoryError, as a real allocation would
    args = read_model_args(tiny_dir)
    per_token = prefill_geometry(args, context_tokens=4096, max_rows=8).activation_bytes_per_token
    monkeypatch.setenv("DSV4SERVE_TESTING_OOM_ABOVE_BYTES", str(24 * per_token + per_token // 2))
    client = start_client(loop_thread, launch_for(tiny_dir, max_prefill_length=32))
    try:
        tokens, _ = loop_thread.run(collect(client, "oom", PROMPT, greedy(8)))
        assert tokens == reference_tokens
        time.sleep(0.5)
        stats = client.stats
        assert stats.oom_recoveries_total >= 1 and stats.prefill_chunk_tokens <= 24
        assert client.ready_info.chunk.effective_tokens == 32 and client.ready_info.chunk.binding == "user-cap"
    finally:
        loop_thread.run(client.shutdown())


def test_killed_worker_fails_in_flight_requests_then_comes_back(loop_thread, tiny_dir, reference_tokens):
    client = start_client(loop_thread, launch_for(tiny_dir))
    try:

        async def kill_mid_stream():
            gen = client.generate("k1", PROMPT, greedy(400))
            await gen.__anext__()
            os.kill(client.worker_pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(WorkerDied):
                async for _ in gen:
                    pass
            return time.monotonic() - t0

        noticed_s = loop_thread.run(kill_mid_stream())
        assert noticed_s < 1.0 and not client.healthy
        with pytest.raises(EngineUnavailable):
            loop_thread.run(collect(client, "k2", PROMPT, greedy(2)))
        deadline = time.monotonic() + 120
        while not client.healthy and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.healthy and client.worker_restarts_total == 1
        tokens, _ = loop_thread.run(collect(client, "k3", PROMPT, greedy(8)))
        assert tokens == reference_tokens
    finally:
        loop_thread.run(client.shutdown())


def test_startup_failure_is_reported_not_hung(loop_thread, tmp_path):
    from dsv4serve.supervisor import EngineClient

    client = EngineClient(launch_for(tmp_path), ready_timeout_s=120)
    with pytest.raises(EngineUnavailable, match="failed to start: CheckpointError"):
        loop_thread.run(client.start(), timeout=150)
