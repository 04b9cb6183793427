"""--speculative-tokens at start-up and in the plan: the worker built by build_engine drafts (with the expert-slot
cache too) and gives the tokens of N = 0; a checkpoint without MTP layers, or an N whose verify row could close
two windows, is refused naming the flag; `plan` loads the MTP block only with N > 0."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4serve.ipc.messages import AddRequest, Sourced
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.model.args import read_model_args
from dsv4serve.worker.engine_setup import build_engine
from dsv4serve.worker.model_load import StartupError, check_speculative
from tests.worker_launch import launch_for

# smaller limits than the engine tests' launch, not given on the command line (default / model-rule sources)
SMALL_LIMITS = dict(max_num_seqs=Sourced(4), max_queued_requests=Sourced(8), max_model_len=Sourced(512, "model-rule"))


def _greedy(parts, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
    for i, prompt in enumerate(prompts):
        assert parts.scheduler.add(AddRequest(f"r{i}", prompt, params)) is None
    outs: dict[str, list[int]] = {}
    while parts.scheduler.has_work:
        plan = parts.scheduler.schedule(parts.chunk.chunk_tokens)
        for msg in parts.scheduler.complete(plan, parts.runner.execute(plan)):
            outs.setdefault(msg.request_id, []).extend(t.token_id for t in msg.tokens)
    return [outs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.slow  # two workers built (about 20 s on 2 cores)
def test_the_worker_drafts_through_a_small_expert_slot_cache_with_the_tokens_of_no_speculation(tiny_dir):
    torch.set_num_threads(1)
    prompts = [list(range(1000, 1021)), list(range(2000, 2009))]
    plain = build_engine(launch_for(tiny_dir, moe_cache_size=3, **SMALL_LIMITS))
    want = _greedy(plain, prompts, 8)
    spec = build_engine(launch_for(tiny_dir, moe_cache_size=3, speculative_tokens=1, **SMALL_LIMITS))
    assert spec.expert_cache is not None and spec.expert_cache.n_slots == 3
    assert len(spec.runner.model.mtp) == 1 and len(spec.runner.pool.layers) == spec.runner.model.args.n_all_layers
    assert len(plain.runner.model.mtp) == 0 and plain.runner.drafter is None  # N = 0: no MTP block, no MTP KV
    assert "--speculative-tokens 1" in spec.ready.decode_graphs and "speculative" not in plain.ready.decode_graphs
    assert _greedy(spec, prompts, 8) == want
    stats = spec.scheduler.spec_stats_fields()
    assert stats["spec_decode_num_drafts_total"] > 0
    assert stats["spec_decode_num_draft_tokens_total"] == stats["spec_decode_num_drafts_total"]  # N = 1


def test_speculation_without_mtp_layers_or_beyond_exact_rollback_is_refused(tiny_dir):
    args = read_model_args(tiny_dir)
    n = args.n_layers
    no_mtp = dataclasses.replace(
        args, n_mtp_layers=0, compress_ratios=args.compress_ratios[:n], layer_kinds=args.layer_kinds[:n]
    )
    check_speculative(args, 3)  # dsv4-tiny: smallest ratio 4, so a verify row of 4 tokens
    with pytest.raises(StartupError, match="--speculative-tokens 2: this checkpoint has no MTP layers"):
        check_speculative(no_mtp, 2)
    with pytest.raises(StartupError, match="--speculative-tokens 4: at most 3 for this model"):
        check_speculative(args, 4)
    check_speculative(no_mtp, 0)


def test_plan_loads_the_mtp_block_only_when_speculating(real_model_dir):
    from dsv4serve.cli import build_parser
    from dsv4serve.config import options
    from dsv4serve.env import read_environment
    from dsv4serve.plan_cli import build_plan

    def plan(*extra: str) -> dict:
        flags = ["--model", str(real_model_dir), "--gpu-memory", "32GiB", "--host-memory", "128GiB", *extra]
        return build_plan(build_parser("plan").parse_args(flags), read_environment({}, tuple(options())))

    off, on = plan(), plan("--speculative-tokens", "1")
    mtp_bytes = on["memory_plan"]["resident_weight_bytes"] - off["memory_plan"]["resident_weight_bytes"]
    assert mtp_bytes > 0 and on["memory_plan"]["mtp_resident"] and not off["memory_plan"]["mtp_resident"]
    assert "not loaded: --speculative-tokens 0" in off["memory_plan_text"]
    assert "included: it drafts for --speculative-tokens" in on["memory_plan_text"]
    row = next(r for r in on["settings_rows"] if r["flag"] == "--speculative-tokens")
    assert str(row["value"]) == "1"
