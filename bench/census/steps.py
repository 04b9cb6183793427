"""Censuses of one step: a decode step of B rows in a steady state, and one prefill chunk.

    first, later = decode_census(engine, batch=8, prompt_tokens=192, sampling=CHAT)   # StepCensus x 2
    chunk = prefill_census(engine, context_tokens=256, chunk_tokens=256)         # StepCensus

Decode: B requests (distinct prompts, so that CSA and HCA layers hold compressed entries) are prefilled
on the warm path (engine.py) until every one of them decodes; `settle_steps` decode steps then run on
the real path uncounted (they import the kernel modules and fill per-process caches, and the expert-slot
cache makes its first promotions), and the next decode step is counted; with `compare_gap`, a second
one is counted a page of positions later (the steps between on the warm path), so that block tables
and compressed-entry counts have grown: CUDA graphs need the two steps' op sequences equal.
Prefill: one request's first `context_tokens` on the warm path, one page uncounted on the real path,
then one counted chunk of `chunk_tokens` with that context before it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from bench.census.attribution import Attributor
from bench.census.counter import Seen, StepCounter
from bench.census.engine import (
    CensusEngine,
    add_requests,
    all_decoding,
    check_decode,
    random_prompts,
    run_step,
    warm_path,
)
from bench.census.rank import CountedRank
from bench.census.stand_ins import stand_ins
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.parallel.collectives import CollectiveCall
from dsv4serve.worker.step import StepPlan

WARM_CHUNK_TOKENS = 512  # the warm path's step budget
CHAT = SamplingParams(temperature=0.6, top_p=0.95)  # a chat request's sampling (not greedy: the full sampler)
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class StepCensus:
    phase: str  # "decode" | "prefill"
    num_rows: int
    num_tokens: int
    start_positions: list[int]  # each row's first position
    seen: Seen
    wall_s: float  # the counted step on the CPU, in the interpreter (not a GPU time)
    collectives: list[CollectiveCall]  # a tensor-parallel rank's (census/rank.py); [] for one rank


def counted_step(engine: CensusEngine, chunk_tokens: int, phase: str) -> tuple[StepPlan, StepCensus]:
    t0 = time.perf_counter()
    with StepCounter(Attributor(engine.model)) as seen:
        plan = run_step(engine, chunk_tokens)
    wall = time.perf_counter() - t0
    starts = [r.start_position for r in plan.rows]
    tp = engine.model.tp
    calls = list(tp.calls) if isinstance(tp, CountedRank) else []  # reset by the runner as the step started
    return plan, StepCensus(phase, len(plan.rows), plan.num_tokens, starts, seen, wall, calls)


def decode_census(
    engine: CensusEngine,
    batch: int,
    prompt_tokens: int,
    sampling: SamplingParams = CHAT,
    settle_steps: int = 1,
    compare_gap: int | None = 0,
    seed: int = 0,
) -> list[StepCensus]:
    """The census of one decode step of `batch` rows; with `compare_gap` (0: one page), a second one that
    many positions later (the steps between on the warm path), for `summary.compare_steps`."""
    gap = (compare_gap or engine.args.page_tokens) if compare_gap is not None else 0
    limit = engine.scheduler.limits.max_model_len
    if prompt_tokens + settle_steps + gap + 2 > limit:
        raise ValueError(f"prompts of {prompt_tokens} tokens leave too few decode steps in max_model_len {limit}")
    add_requests(engine, random_prompts(batch, prompt_tokens, seed), sampling)
    with warm_path(engine):
        while not all_decoding(engine):
            run_step(engine, WARM_CHUNK_TOKENS)
    with stand_ins():
        for _ in range(settle_steps):
            check_decode(run_step(engine, batch), batch)
        plan, first = counted_step(engine, batch, "decode")
        check_decode(plan, batch)
        if compare_gap is None:
            return [first]
        with warm_path(engine):
            for _ in range(gap - 1):
                check_decode(run_step(engine, batch), batch)
        plan, second = counted_step(engine, batch, "decode")
        check_decode(plan, batch)
    return [first, second]


def prefill_census(
    engine: CensusEngine, context_tokens: int, chunk_tokens: int, sampling: SamplingParams = CHAT, seed: int = 0
) -> StepCensus:
    """One chunk of `chunk_tokens` of one request, after `context_tokens` of its prompt (multiples of a
    page; the chunk is not the prompt's last, so nothing is sampled)."""
    page = engine.args.page_tokens
    if context_tokens % page or chunk_tokens % page or context_tokens < 2 * page:
        raise ValueError(
            f"context ({context_tokens}) and chunk ({chunk_tokens}) tokens: multiples of {page}, context >= 2 pages"
        )
    add_requests(engine, random_prompts(1, context_tokens + chunk_tokens + page + 1, seed), sampling)
    with warm_path(engine):
        run_step(engine, context_tokens - page)
    with stand_ins():
        run_step(engine, page)  # settles the real path
        plan, census = counted_step(engine, chunk_tokens, "prefill")
    if len(plan.rows) != 1 or plan.rows[0].start_position != context_tokens or plan.num_tokens != chunk_tokens:
        rows = [(r.start_position, len(r.token_ids)) for r in plan.rows]
        raise RuntimeError(f"expected one row of {chunk_tokens} tokens at {context_tokens}, the plan ran {rows}")
    return census
