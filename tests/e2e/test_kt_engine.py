"""--moe-backend hybrid through a real worker process: the engine starts with kt-kernel computing the misses
of a 20-slot expert cache, says so in its ready report, and serves a greedy request whose prompt
log-probabilities follow those of --moe-backend offload (the same worker without the CPU experts) within the
FP8 rounding the CPU experts skip, as amplified by dsv4-tiny's random weights (tests/model/test_hybrid_moe.py:
bit-for-bit layer checks; here the bound is on what a client sees)."""

from __future__ import annotations

import time

import pytest

from dsv4serve.experts.kt_backend import kt_kernel_available
from dsv4serve.ipc.messages import Sourced
from dsv4serve.ipc.sampling import SamplingParams

from .conftest import launch_for, start_client

# found without importing it: kt-kernel's import turns on flush-to-zero for the process (kt_backend.load_kt
# turns it off again), which a module-level import here would leave on for every later test in the worker
pytestmark = pytest.mark.skipif(not kt_kernel_available()[0], reason=kt_kernel_available()[1])

PROMPT = [128803] + list(range(1000, 1037)) + [128804]


async def prompt_logprobs(client, rid: str) -> tuple[list[float], list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    logprobs, tokens = [], []
    async for out in client.generate(rid, PROMPT, params):
        if out.prompt_logprobs is not None:
            logprobs = [t.logprob for t in out.prompt_logprobs if t is not None]
        tokens += [t.token_id for t in out.tokens]
    return logprobs, tokens


def run(loop_thread, tiny_dir, backend: str):
    # not batch-invariant (the engine tests' default): hybrid refuses it, its split follows the batch
    launch = launch_for(tiny_dir, moe_cache_size=20, moe_backend=backend, batch_invariant=Sourced(False))
    client = start_client(loop_thread, launch)
    try:
        got = loop_thread.run(prompt_logprobs(client, backend))
        time.sleep(1.5)  # the next Stats message carries the expert cache's counters
        return got, client.ready_info, client.stats
    finally:
        loop_thread.run(client.shutdown())


def test_hybrid_serves_within_the_rounding_of_offload(loop_thread, tiny_dir):
    (hybrid, tokens), ready, stats = run(loop_thread, tiny_dir, "hybrid")
    assert "kt-kernel" in ready.expert_bank and ready.expert_slots == 20
    # /metrics' CPU share: uses the CPU computed, never counted as hits
    assert 0 < stats.expert_cache_cpu_uses_total <= stats.expert_cache_queries_total - stats.expert_cache_hits_total
    assert "decode graph steps: 100% of each layer's expected misses on the CPU" in ready.expert_bank  # CPU device
    (offload, offload_tokens), offload_ready, offload_stats = run(loop_thread, tiny_dir, "offload")
    assert "kt-kernel" not in offload_ready.expert_bank and offload_stats.expert_cache_cpu_uses_total == 0
    assert len(hybrid) == len(offload) == len(PROMPT) - 1 and len(tokens) == 4
    diffs = [abs(a - b) for a, b in zip(hybrid, offload, strict=True)]
    mean = sum(diffs) / len(diffs)
    print(
        f"prompt logprobs, hybrid vs offload: mean |diff| {mean:.4f}, max {max(diffs):.4f}; tokens {tokens} {offload_tokens}"
    )
    assert 0 < mean < 0.3  # measured 0.09; CPU experts returning zeros move them by 0.6
