"""dsv4-tiny on the code path the CUDA worker runs, on the CPU, and the one function that drives a step.

    engine = build_census_engine(tiny_dir, max_running=8, max_model_len=512, moe_cache_size=None)
    plan = run_step(engine, chunk_tokens)          # the only code that knows the step interface

As `worker/engine_setup.build_engine` builds it for `--device cuda --kernels auto` (every kernel on
Triton, here through TRITON_INTERPRET=1, which must be set before any dsv4_kernels import): the
worker's numerics (`worker_numerics`: the FP8 checkpoint's arithmetic, batch_invariant=False), the
weights loaded packed (`load_packed`, the routed experts behind an expert-slot cache when
`moe_cache_size` is given), a KvPool with the padding page and slot, the Scheduler, and the Runner with
the decode buckets (`worker/graphs.DecodeGraphs`): a decode step runs its forward on a bucket's static
buffers, which a CUDA worker captures once into a CUDA graph and replays; here, uncaptured, the same
forward runs eagerly, so the census counts what the graph holds (`decode_graphs=False`: the path of
--enforce-eager). Not built: the calibration probe and the start-up kernel check (not part of a step).

`warm_path`: the interpreter needs minutes for a prefill of a few hundred tokens, so the steps that
only bring the engine to the state a census wants run on a dense twin of the same weights on the
torch reference path (the same Runner, scheduler, pool and sequences; the kernels are tested against
that path). Every step that is counted, and the step before it, run on the real path.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.census.rank import CountedRank
from dsv4serve.checkpoint.loader import Checkpoint, iter_dense, open_checkpoint
from dsv4serve.experts.slot_cache import ExpertSlotCache
from dsv4serve.ipc.messages import AddRequest
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.memory.weights import include_mtp, model_specs
from dsv4serve.model.args import ModelArgs
from dsv4serve.model.backends import TORCH, KernelBackends
from dsv4serve.model.kv_pool import KvPool
from dsv4serve.model.numerics import Numerics
from dsv4serve.model.packed_load import load_packed
from dsv4serve.model.transformer import Transformer
from dsv4serve.parallel.partition import make_partition
from dsv4serve.parallel.rank_load import load_rank_dense, load_rank_packed
from dsv4serve.worker.graphs import DecodeGraphs
from dsv4serve.worker.model_load import worker_numerics
from dsv4serve.worker.runner import Runner
from dsv4serve.worker.scheduler import Scheduler, SchedulerLimits
from dsv4serve.worker.step import StepPlan

CPU = torch.device("cpu")


@dataclass
class WarmTwin:
    """The same weights dense, for the torch reference path (warm-up steps only)."""

    model: Transformer
    numerics: Numerics


@dataclass
class CensusEngine:
    ckpt: Checkpoint  # kept open: an expert bank may read its shards
    model: Transformer
    numerics: Numerics
    pool: KvPool
    scheduler: Scheduler
    runner: Runner
    expert_cache: ExpertSlotCache | None
    twin: WarmTwin
    graphs: DecodeGraphs | None

    @property
    def args(self) -> ModelArgs:
        return self.model.args


def run_step(engine: CensusEngine, chunk_tokens: int) -> StepPlan:
    """One engine step, driven as the worker's EngineLoop.step drives it (worker/main.py): the scheduler
    plans, the runner executes the plan, the scheduler takes the output. Returns the plan."""
    plan = engine.scheduler.schedule(chunk_tokens)
    out = engine.runner.execute(plan)
    engine.scheduler.complete(plan, out)
    return plan


@contextmanager
def warm_path(engine: CensusEngine) -> Iterator[None]:
    """Steps inside run the dense twin on the torch path (module doc)."""
    runner = engine.runner
    saved = runner.model, runner.numerics, runner.graphs
    runner.model, runner.numerics, runner.graphs = engine.twin.model, engine.twin.numerics, None
    try:
        yield
    finally:
        runner.model, runner.numerics, runner.graphs = saved


def cuda_worker_numerics(args: ModelArgs) -> Numerics:
    """What `worker_numerics` gives a CUDA worker with --kernels auto (every kernel on Triton)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the census runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1 first")
    numerics = worker_numerics(args, "all=triton", CPU, batch_invariant=False)
    assert numerics.backends == KernelBackends.every("triton") and not numerics.batch_invariant
    return numerics


def load_twin(ckpt: Checkpoint, numerics: Numerics) -> WarmTwin:
    args = ckpt.args
    specs = tuple(model_specs(ckpt.specs, args, include_mtp(args)))
    model = Transformer(args, include_mtp=include_mtp(args))
    model.load_state_dict(dict(iter_dense(dataclasses.replace(ckpt, specs=specs), progress=False)), strict=True)
    return WarmTwin(model.eval(), dataclasses.replace(numerics, backends=TORCH))


def build_census_engine(
    tiny_dir: Path,
    max_running: int,
    max_model_len: int,
    moe_cache_size: int | None = None,
    twin: WarmTwin | None = None,
    decode_graphs: bool = True,
    graph_sizes: tuple[int, ...] | None = None,
    ranks: int = 1,
    expert_parallel: bool = False,
) -> CensusEngine:
    """The engine (module doc); KV for `max_running` sequences of `max_model_len` tokens. `twin` may be
    shared between engines of the same checkpoint (it holds no state). `graph_sizes`: the decode buckets
    (default: the worker's, 1, 2, 4, ... up to max_running). `ranks` > 1: rank 0 of a tensor-parallel group,
    loaded as the worker loads it (parallel/rank_load.py), its collectives counted and not run (census/rank.py)."""
    ckpt = open_checkpoint(tiny_dir)
    args = ckpt.args
    numerics = cuda_worker_numerics(args)
    mtp = include_mtp(args)
    if ranks > 1:
        if moe_cache_size is not None:
            raise ValueError("a tensor-parallel rank holds its experts resident: no slot cache")
        partition = make_partition(args, ranks, expert_parallel)
        tp = CountedRank(0, ranks)
        model, cache = load_rank_packed(ckpt, partition, tp, numerics.backends, CPU, mtp, progress=False), None
        dense = load_rank_dense(ckpt, partition, tp, CPU, mtp, progress=False)
        twin = WarmTwin(dense, dataclasses.replace(numerics, backends=TORCH))
    else:
        model, cache = load_packed(ckpt, numerics.backends, CPU, mtp, moe_cache_size, progress=False)
    model.use_kernels(numerics.backends)
    page = args.page_tokens
    limits = SchedulerLimits(
        max_running=max_running,
        max_waiting=max_running,
        kv_capacity_tokens=max_running * -(-max_model_len // page) * page,
        page_tokens=page,
        max_model_len=max_model_len,
        eos_token_id=args.eos_token_id,
    )
    pool = KvPool(  # + the padding rows' page and slot, the last ones (as build_engine)
        args,
        numerics.compute_dtype,
        num_pages=limits.kv_capacity_tokens // page + 1,
        num_slots=limits.num_slots + 1,
        include_mtp=mtp,
        device=CPU,
    )
    graphs = None
    if decode_graphs:
        graphs = DecodeGraphs(
            model,
            pool,
            numerics,
            max_running,
            max_model_len,
            pool.num_slots - 1,
            pool.num_pages - 1,
            capture=False,
            expert_cache=cache,
            sizes=graph_sizes,
        )
    runner = Runner(model, pool, numerics, args.eos_token_id, CPU, graphs=graphs)
    twin = twin or load_twin(ckpt, numerics)
    return CensusEngine(ckpt, model, numerics, pool, Scheduler(limits), runner, cache, twin, graphs)


def add_requests(engine: CensusEngine, prompts: list[list[int]], sampling: SamplingParams) -> None:
    for i, prompt in enumerate(prompts):
        rejected = engine.scheduler.add(AddRequest(f"census-{i}", prompt, sampling))
        if rejected is not None:
            raise RuntimeError(f"the scheduler rejected a census request: {rejected.message}")


def random_prompts(n: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """n distinct prompts of ordinary token ids (no BOS / EOS / special tokens)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, 100_000, (tokens,), generator=gen).tolist() for _ in range(n)]


def all_decoding(engine: CensusEngine) -> bool:
    s = engine.scheduler
    return not s.waiting and all(r.num_computed_tokens == r.num_tokens - 1 for r in s.running)


def check_decode(plan: StepPlan, num_rows: int) -> None:
    if len(plan.rows) != num_rows or any(len(r.token_ids) != 1 for r in plan.rows):
        shape = [len(r.token_ids) for r in plan.rows]
        raise RuntimeError(f"expected a decode step of {num_rows} rows, the plan ran rows of {shape} tokens")
