"""The step census of one tensor-parallel rank (issue #21): rank 0 of 2 on dsv4-tiny-split, loaded packed as the
worker loads it, its experts owned (--expert-parallel) or split, its collectives counted and not run
(bench/census/rank.py). A rank's decode step must keep what CUDA graphs need of every step (one host-device
sync, the read of the sampled tokens; one forward op sequence at every position) and run the collectives the
architecture asks: an all-reduce after each attention output and each MoE, one for the vocabulary-parallel
embedding and one gather of the logits, as many as parallel/comm_volume.py projects. Its own file, so that the
test runner can run it beside tests/unit/test_step_census.py (each census is ~1 min of Triton interpreter)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates: before any kernel module

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `bench.census`, as the script does
sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_step_census: its sampling and sync site

from test_step_census import PROMPT_TOKENS, RATCHET_SAMPLING, READ_SITE

from bench.census.summary import compare_steps, project, summarize
from dsv4serve.model.args import read_model_args
from dsv4serve.parallel.comm_volume import decode_collectives

# launches per layer of a rank's batch-1 decode step (the most of any layer of the kind), measured 2026-12-05:
# experts split 39 / 52 / 41, owned (EP) 43 / 56 / 45; since 2026-12-07 (the indexer's head weights ride in its
# compressor's launch, the mHC launch that writes x applies the sub-layer norm, the compressors take bf16 input,
# a decode step's keys go into their rings in the kv launch) split 28 / 37 / 31, EP 32 / 41 / 35;
# plus a slack of 4: a RATCHET, as test_step_census's.
# Above one rank's (36 / 48 / 38): the MoE's routed and shared partials stacked in fp32 for one all-reduce, then
# summed and cast (3 launches where one rank adds once) and, with EP, the routes mapped to this rank's experts (4
# launches). The collectives themselves are not launches here (one NCCL kernel each on GPUs).
LAUNCHES_PER_LAYER = {False: {"swa": 30, "csa": 39, "hca": 33}, True: {"swa": 34, "csa": 43, "hca": 37}}


@pytest.fixture(scope="module", params=[True, False], ids=["EP", "split-experts"])
def rank_steps(request, tiny_split_dir):
    """Two counted batch-1 decode steps of rank 0 of 2, a page of positions apart, and the engine."""
    from bench.census.engine import build_census_engine
    from bench.census.steps import decode_census

    ep = request.param
    engine = build_census_engine(tiny_split_dir, 1, 128, None, None, True, (1,), ranks=2, expert_parallel=ep)
    first, later = decode_census(engine, 1, PROMPT_TOKENS, RATCHET_SAMPLING, settle_steps=0, compare_gap=0)
    return engine, ep, first, later


@pytest.mark.slow  # ~1 min a variant: prefill on the warm path, then two decode steps in the interpreter
def test_a_ranks_decode_step_syncs_once_and_is_static_across_positions(rank_steps) -> None:
    engine, _, first, later = rank_steps
    for step in (first, later):
        assert [(s.what, s.site) for s in step.seen.syncs] == [("tolist", READ_SITE)]
    assert later.start_positions[0] >= first.start_positions[0] + engine.args.page_tokens
    diff = compare_steps(first.seen, later.seen)
    assert diff["forward_static"], diff["first_differences"]
    assert diff["triton_scalar_changes"] == {}


@pytest.mark.slow
def test_a_ranks_collectives_are_the_architectures_and_comm_volumes(rank_steps, real_model_dir) -> None:
    engine, _, first, later = rank_steps
    args = engine.args
    for step in (first, later):
        assert Counter(c.what for c in step.collectives) == {
            "attention output (after wo_b)": args.n_layers,
            "MoE output (routed + shared)": args.n_layers,
            "embedding (vocab-parallel)": 1,
            "logits (vocab-parallel)": 1,
        }
    projected = sum(c.per_step for c in decode_collectives(args, 1, 2, "tp"))
    assert len(first.collectives) == projected
    # projected to DeepSeek-V4-Flash's 43 layers: what comm_volume projects for its decode step
    real = read_model_args(real_model_dir)
    want = sum(c.per_step for c in decode_collectives(real, 1, 2, "tp"))
    assert project(summarize(first, args), real)["collectives"] == want == 2 * real.n_layers + 2


@pytest.mark.slow
def test_a_ranks_launches_per_layer_stay_under_the_ratchet(rank_steps) -> None:
    engine, ep, first, _ = rank_steps
    worst: dict[str, int] = {}
    for row in summarize(first, engine.args)["layers"]:
        worst[row["kind"]] = max(worst.get(row["kind"], 0), row["launches"])
    bound = LAUNCHES_PER_LAYER[ep]
    over = {kind: (n, bound[kind]) for kind, n in worst.items() if n > bound[kind]}
    assert not over, f"a rank's launches per layer (measured, bound) went up: {over}; the bound is a ratchet"
    lowered = {kind: n for kind, n in worst.items() if n + 8 < bound[kind]}
    assert not lowered, f"a rank's launches per layer fell to {lowered}: lower LAUNCHES_PER_LAYER to hold the gain"
