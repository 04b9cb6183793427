"""Building the worker's engine from a WorkerLaunch: model, KV capacity, chunk plan, scheduler, runner."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv4serve.checkpoint.loader import open_checkpoint
from dsv4serve.config import Setting
from dsv4serve.env import read_environment
from dsv4serve.experts.attach import HYBRID_EAGER, cpu_experts_of, expert_bank_line
from dsv4serve.experts.slot_cache import ExpertSlotCache
from dsv4serve.ipc.messages import Ready, WorkerLaunch
from dsv4serve.memory.capacity import PROBE_TOKENS_MAX, CapacityError, kv_capacity, planner_snapshot
from dsv4serve.memory.chunk_planner import ChunkPlan, PlannerLimits, plan_chunk, prefill_geometry, shrink_after_oom
from dsv4serve.memory.graph_memory import decode_graph_bytes
from dsv4serve.memory.weights import include_mtp
from dsv4serve.model.kv_pool import KvPool, SequenceState
from dsv4serve.model.numerics import Numerics
from dsv4serve.model.transformer import BatchRow, Transformer
from dsv4serve.parallel.group import RankGroup, agree_min, backend_for, gather_lines, start_group
from dsv4serve.parallel.step_link import StepLink
from dsv4serve.worker.grammar import GrammarBook
from dsv4serve.worker.graphs import DecodeGraphs
from dsv4serve.worker.model_load import (
    StartupError,
    check_parallel,
    checked_numerics,
    load_model,
    rank_partition,
    worker_device,
    worker_numerics,
)
from dsv4serve.worker.runner import Runner
from dsv4serve.worker.scheduler import Scheduler, SchedulerLimits, sequence_slots
from dsv4serve.worker.spec_graphs import SpecGraphs
from dsv4serve.worker.speculative import Drafter

log = logging.getLogger("dsv4serve.worker")
__all__ = ["ChunkState", "EngineParts", "StartupError", "build_engine"]


class ChunkState:
    """The chunk plan in force, replaced (never patched) when an out-of-memory error teaches a lower
    ceiling; the Stats message always reports this one, so no stale copy exists."""

    def __init__(self, plan: ChunkPlan):
        self.plan = plan

    @property
    def chunk_tokens(self) -> int:
        return self.plan.effective_tokens

    @property
    def reason(self) -> str:
        return self.plan.reason

    def after_oom(self, failed_tokens: int) -> None:
        self.plan = shrink_after_oom(self.plan, failed_tokens)


@dataclass
class EngineParts:
    scheduler: Scheduler
    runner: Runner
    chunk: ChunkState
    ready: Ready
    expert_cache: ExpertSlotCache | None = None  # the routed experts' slot cache when they are offloaded
    group: RankGroup = RankGroup.single()  # the tensor-parallel group this worker is a rank of


def build_engine(launch: WorkerLaunch) -> EngineParts:
    """This worker's engine; with --tensor-parallel-size N, rank `launch.rank`'s: every rank builds the same one
    around its part of the model (rank 0's scheduler alone is used), sized by what every rank can hold."""
    ranks = launch.tensor_parallel_size.value
    device = worker_device(launch.device, launch.rank, ranks)
    check_parallel(launch, device)
    group = start_group(launch.rank, ranks, launch.rendezvous_port, device)
    ckpt = open_checkpoint(launch.model_path)
    args = ckpt.args
    if ranks > 1:
        rank_partition(args, launch)  # a split this model cannot take stops the start before any loading
    numerics = worker_numerics(args, launch.kernels.value, device, launch.batch_invariant.value)
    if device.type == "cuda":
        numerics = checked_numerics(numerics, launch.kernels.value, device)
    model, expert_cache, launch = load_model(ckpt, launch, numerics, device, group)
    hybrid = cpu_experts_of(model)
    # decode steps captured as CUDA graphs unless `eager_reason` says why not. In a tensor-parallel group every rank
    # captures the same buckets in the same order, the NCCL collectives inside (NCCL >= 2.9.6 records them in a
    # graph); the static buffers with collectives are checked over gloo on the CPU (tests/unit/test_tp_forward.py),
    # the capture over NCCL only by bench/gpu_cases/multi_gpu.py on a multi-GPU run
    n_spec = launch.speculative_tokens.value
    eager = eager_reason(device, launch.enforce_eager.value, hybrid is not None and n_spec > 0)
    if eager is None and hybrid is not None and hybrid.graph.layers:  # its stream forward, replayed, must be right
        from dsv4serve.experts.kt_stream_check import check_stream_graph

        why = check_stream_graph(hybrid.kt, hybrid.graph.layers[0], device)
        if why is not None:
            log.warning("hybrid decode steps stay eager: %s", why)
            eager = f"off (--moe-backend hybrid: {why})"
    if eager is None:  # layers the host stages mid-step cut the graphs: a cut graph, replayed, must be right
        eager = _cut_graph_reason(model, expert_cache, numerics, device)
    capture = eager is None
    graph_reserve = (
        decode_graph_bytes(args, launch.max_num_seqs.value, launch.max_model_len.value, n_spec) if capture else 0
    )
    page = args.page_tokens
    # the reference attention materializes [T, H, keys] scores: the chunk's cost grows with its square
    geometry = prefill_geometry(
        args,
        context_tokens=launch.max_model_len.value,
        max_rows=launch.max_num_seqs.value,
        dense_attention=numerics.backends.attention == "torch",
    )
    usable, max_len = agree_min(group, list(_kv_tokens(launch, args, device, numerics, geometry, graph_reserve)))
    capacity = usable + page  # the pool's last page and last slot: the padding rows' (worker/graphs.py)
    limits = SchedulerLimits(
        max_running=launch.max_num_seqs.value,
        max_waiting=launch.max_queued_requests.value,
        kv_capacity_tokens=usable,
        page_tokens=page,
        max_model_len=max_len,
        eos_token_id=args.eos_token_id,
        speculative_tokens=launch.speculative_tokens.value,
    )
    pool = KvPool(
        args,
        numerics.compute_dtype,
        num_pages=capacity // page,
        num_slots=limits.num_slots + 1,
        include_mtp=include_mtp(args, launch.speculative_tokens.value),
        device=device,
    )
    log.info(
        "KV pool on %s: %d pages of %d tokens, %d sequence slots (%d for prefix snapshots), %.1f MiB",
        device,
        pool.num_pages,
        page,
        pool.num_slots,
        limits.num_prefix_slots,
        pool.num_bytes / 2**20,
    )
    graphs, spec_graphs = None, None
    if capture:
        # before the chunk planner measures free memory, so that the chunk never counts on what the graphs hold
        graphs, spec_graphs = _capture_graphs(model, pool, numerics, limits.max_running, max_len, n_spec, expert_cache)
    planner_limits = PlannerLimits(Setting.from_wire(launch.max_prefill_length), usable, max_len)
    ratio = launch.memory_ratio.value
    probe_tokens = min(
        plan_chunk(planner_snapshot(device, ratio, None, 0), geometry, planner_limits).effective_tokens,
        PROBE_TOKENS_MAX,
        usable,
    )
    (probe_tokens,) = agree_min(group, [probe_tokens])  # the calibration prefill runs the collectives too
    snapshot = planner_snapshot(device, ratio, _probe(model, pool, numerics, device), probe_tokens)
    plan = plan_chunk(snapshot, geometry, planner_limits)
    if plan.warning:
        log.warning("%s", plan.warning)
    oom_above = read_environment().testing_oom_above_bytes
    grammars = GrammarBook(launch.tokenizer_path, args.vocab_size, args.eos_token_id)  # structured output
    runner = Runner(
        model,
        pool,
        numerics,
        args.eos_token_id,
        device,
        oom_above,
        geometry.activation_bytes_per_token,
        grammars,
        graphs=graphs,
        drafter=_drafter(model, pool, numerics, n_spec, spec_graphs),
        link=StepLink(group) if ranks > 1 else None,
    )
    rank_lines = gather_lines(group, _rank_line(launch, group, device, model, pool)) if ranks > 1 else []
    ready = Ready(
        device=device.type,
        kv_capacity_tokens=usable,
        max_running_requests=launch.max_num_seqs.value,
        max_model_len=max_len,
        chunk=plan.report(),
        expert_slots=None if expert_cache is None else expert_cache.n_slots,
        vocab_size=args.vocab_size,
        eos_token_id=args.eos_token_id,
        expert_bank=None if expert_cache is None else expert_bank_line(expert_cache, hybrid),
        kv_pages=pool.num_pages,
        page_tokens=page,
        sequence_slots=pool.num_slots,
        decode_graphs=(eager or _graphs_line(graphs, graph_reserve)) + _speculative_note(n_spec, graphs, spec_graphs),
        ranks=rank_lines,
    )
    return EngineParts(Scheduler(limits), runner, ChunkState(plan), ready, expert_cache, group)


def _capture_graphs(
    model: Transformer,
    pool: KvPool,
    numerics: Numerics,
    max_rows: int,
    max_len: int,
    n_spec: int,
    expert_cache: ExpertSlotCache | None,
) -> tuple[DecodeGraphs, SpecGraphs | None]:
    """The decode step captured per batch bucket (padding rows use the pool's last slot and page). With
    --speculative-tokens, the verify and draft-chain buckets first (the largest), in the same memory pool. A
    failed capture (e.g. a collective this NCCL cannot record in a graph) stops the start with the way out."""
    pad = (pool.num_slots - 1, pool.num_pages - 1)
    try:
        mempool = torch.cuda.graph_pool_handle()
        spec = None
        if n_spec > 0:
            spec = SpecGraphs(
                model, pool, numerics, max_rows, max_len, n_spec, *pad,
                capture=True, expert_cache=expert_cache, mempool=mempool,
            )  # fmt: skip
        decode = DecodeGraphs(
            model, pool, numerics, max_rows, max_len, *pad, capture=True, expert_cache=expert_cache, mempool=mempool
        )
        return decode, spec
    except torch.OutOfMemoryError:
        raise  # the start-up's own report of memory
    except RuntimeError as e:
        raise RuntimeError(
            f"capturing the decode steps as CUDA graphs failed ({e}); --enforce-eager runs them eagerly"
        ) from e


def _kv_tokens(
    launch: WorkerLaunch, args, device: torch.device, numerics: Numerics, geometry, graph_reserve: int
) -> tuple[int, int]:
    """(KV capacity in tokens for requests, max_model_len): an auto max_model_len is capped by the capacity,
    an explicit one that does not fit stops the start. The pool takes one page more (the padding page);
    `graph_reserve`: what the decode graphs captured after the pool will hold (memory/graph_memory.py)."""
    page = args.page_tokens
    entry_bytes = torch.empty(0, dtype=numerics.compute_dtype).element_size()
    max_len, seqs = launch.max_model_len.value, launch.max_num_seqs.value
    try:
        capacity = kv_capacity(
            args,
            device,
            entry_bytes,
            sequence_slots(seqs) + 1,  # + the padding slot
            max_len * seqs + page,  # + the padding page
            None if launch.num_tokens.value is None else launch.num_tokens.value + page,
            launch.memory_ratio.value,
            min(launch.max_prefill_length.value or PROBE_TOKENS_MAX, PROBE_TOKENS_MAX),
            geometry,
            graph_reserve,
            include_mtp=include_mtp(args, launch.speculative_tokens.value),
        )
    except CapacityError as exc:
        raise StartupError(str(exc)) from exc
    capacity -= page  # what requests may hold: the padding page is the pool's own
    if max_len > capacity:
        if launch.max_model_len.explicit:
            raise StartupError(
                f"--max-model-len {max_len} does not fit the KV capacity of {capacity} tokens "
                "(--num-tokens, or what the memory holds); raise --num-tokens or lower --max-model-len"
            )
        max_len = capacity
    return capacity, max_len


def _probe(model: Transformer, pool: KvPool, numerics: Numerics, device: torch.device) -> Callable[[int], object]:
    """The calibration prefill: n tokens through slot 0 and the first pages, before any request runs
    (what it leaves in the pool is never read: reads are bounded by each sequence's own length)."""

    def run(n: int) -> object:
        seq = SequenceState(pool, 0, pages=list(range(-(-n // pool.page_tokens))))
        return model.forward([BatchRow([0] * n, seq)], numerics)

    return run


def _drafter(
    model: Transformer, pool: KvPool, numerics: Numerics, n_tokens: int, spec_graphs: SpecGraphs | None
) -> Drafter | None:
    if n_tokens <= 0:
        return None
    how = "verify steps and the draft chain replay CUDA graphs" if spec_graphs is not None else "eager"
    log.info("speculative decoding: %d MTP draft token(s) per step (%s)", n_tokens, how)
    return Drafter(model, pool, numerics, n_tokens, spec_graphs)


def _speculative_note(n_tokens: int, graphs: DecodeGraphs | None, spec_graphs: SpecGraphs | None) -> str:
    """What runs of the steps of speculating requests: the verify steps whose rows all carry n drafts and the
    draft chain replay graphs per (bucket, n) and per bucket; mixed steps and the MTP catch-up run eager."""
    if n_tokens <= 0:
        return ""
    if spec_graphs is not None:
        how = f"; {spec_graphs.report.describe()} (mixed steps and the MTP catch-up eager)"
    else:
        how = "; those steps run eager (no graph)" if graphs is not None else ""
    return f"; --speculative-tokens {n_tokens}: MTP drafts verified per step{how}"


def eager_reason(device: torch.device, enforce_eager: bool, hybrid_speculating: bool) -> str | None:
    """Why decode steps run eager (the start-up report's decode-graphs line), or None: captured as CUDA graphs.
    A step that makes the host wait mid-way cannot be one graph: hybrid CPU experts in the speculative steps'
    graphs (decode graphs take hybrid_graph.py's split; the verify steps have no such split yet). Layers whose
    experts the host must stage (a bank beyond the pin budget: WSL2's pin cap, or a host RAM smaller than the
    bank, the rest on disk) cut the graphs instead (experts/graph_cuts.py), once `_cut_graph_reason` passes."""
    if device.type != "cuda":
        return "off (CPU: every step eager)"
    if enforce_eager:
        return "off (--enforce-eager)"
    if hybrid_speculating:
        return HYBRID_EAGER
    return None


def _cut_graph_reason(
    model: Transformer, expert_cache: ExpertSlotCache | None, numerics: Numerics, device: torch.device
) -> str | None:
    """With staged layers: None when a staged layer's cut graph replays as its eager forward (cut_check.py), else
    why the decode steps stay eager; None without staged layers (nothing cuts the graphs)."""
    staged = [layer for layer in (expert_cache.staged_layers if expert_cache else []) if layer < len(model.layers)]
    if expert_cache is None or not staged:
        return None
    from dsv4serve.experts.cut_check import check_cut_graph

    moe = model.layers[staged[0]].ffn
    why = check_cut_graph(moe, expert_cache, numerics, device, model.args.dim, model.args.vocab_size)  # type: ignore[arg-type]
    if why is None:
        return None
    log.warning("decode steps with staged expert layers stay eager: %s", why)
    return (
        f"off ({len(expert_cache.staged_layers)} of {len(expert_cache.layers)} MoE layers' experts are not pinned "
        f"and their cut graphs failed the start-up check: {why})"
    )


def _graphs_line(graphs: DecodeGraphs | None, planned: int) -> str:
    assert graphs is not None  # eager_reason said capture
    return f"{graphs.report.describe()} (planned {planned / 2**20:.0f} MiB)"


def _rank_line(launch: WorkerLaunch, group: RankGroup, device: torch.device, model: Transformer, pool: KvPool) -> str:
    """One rank's line of the start-up report: where it runs, what of the model it holds, its KV pool."""
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    split = "experts owned whole" if launch.expert_parallel.value else "every expert split"
    return (
        f"rank {group.rank}/{group.size} on {device} ({backend_for(device)}): {held / 2**20:.1f} MiB of weights "
        f"({split}), KV pool {pool.num_bytes / 2**20:.1f} MiB"
    )
