"""Building the worker's engine from a WorkerLaunch: model, KV capacity, chunk plan, scheduler, runner."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from dsv4serve.checkpoint.loader import iter_dense, open_checkpoint
from dsv4serve.config import ConfigError, Setting, Source
from dsv4serve.experts.attach import attach_expert_cache, iter_resident_dense
from dsv4serve.experts.slot_cache import ExpertSlotCache
from dsv4serve.ipc.messages import Ready, WorkerLaunch
from dsv4serve.model.backends import TORCH, KernelBackends, default_backends, named_kernels, resolve_backends
from dsv4serve.model.kv_pool import KvPool
from dsv4serve.model.numerics import NUMERICS_OFF, NUMERICS_ON, Numerics
from dsv4serve.model.packed_load import device_bytes, load_packed
from dsv4serve.model.state import SequenceState
from dsv4serve.model.transformer import BatchRow, Transformer
from dsv4serve.worker.capacity import PROBE_TOKENS_MAX, CapacityError, kv_capacity, planner_snapshot
from dsv4serve.worker.chunk_planner import ChunkPlan, PlannerLimits, plan_chunk, prefill_geometry, shrink_after_oom
from dsv4serve.worker.expert_plan import planned_expert_slots
from dsv4serve.worker.kernel_check import KernelCheckError, check_kernels
from dsv4serve.worker.memory_probe import host_snapshot, take_snapshot
from dsv4serve.worker.runner import FaultInjection, Runner
from dsv4serve.worker.scheduler import Scheduler, SchedulerLimits, sequence_slots

log = logging.getLogger("dsv4serve.worker")


class StartupError(RuntimeError):
    """The worker cannot honour the settings; the message names the flag, the limit and why."""


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


def build_engine(launch: WorkerLaunch) -> EngineParts:
    device = _device(launch.device)
    ckpt = open_checkpoint(launch.model_path)
    args = ckpt.args
    include_mtp = ckpt.layout == "official"
    numerics = _numerics(args, launch.kernels, device)
    if device.type == "cuda":  # before any weight is placed: a fallback changes how the head loads
        numerics = _checked_kernels(numerics, launch.kernels, device)
    backends = numerics.backends
    if backends.fp8_gemm == "triton" and backends.fp4_moe == "triton":
        # the kernels read FP8 / MXFP4 as stored: load them packed, never dense
        if launch.moe_cache_size is None and device.type == "cuda":
            launch = _with_planned_expert_slots(ckpt, launch, backends)
        _check_weights_fit(ckpt, backends, True, include_mtp, launch, device)
        model, expert_cache = load_packed(ckpt, backends, device, include_mtp, launch.moe_cache_size)
    else:
        _check_weights_fit(ckpt, backends, False, include_mtp, launch, device)
        model = Transformer(args, include_mtp=include_mtp)
        expert_cache = attach_expert_cache(model, ckpt, launch.moe_cache_size, device)  # None: all resident
        weights = (
            iter_dense(ckpt, torch.float32, progress=True)
            if expert_cache is None
            else iter_resident_dense(ckpt, torch.float32)
        )
        model.load_state_dict(dict(weights), strict=True)
        model.to(device)
    model.eval()
    model.use_kernels(backends)  # packs what the Triton kernels read (nothing left to do after load_packed)
    log.info("kernels: %s", backends)
    page = args.page_tokens
    # the reference attention materializes [T, H, keys] scores: the chunk's cost grows with its square
    geometry = prefill_geometry(
        args,
        context_tokens=launch.max_model_len,
        max_rows=launch.max_num_seqs,
        dense_attention=numerics.backends.attention == "torch",
    )
    sched_slots = sequence_slots(launch.max_num_seqs)
    entry_bytes = torch.empty(0, dtype=numerics.compute_dtype).element_size()
    try:
        capacity = kv_capacity(
            args,
            device,
            entry_bytes,
            sched_slots,
            launch.max_model_len * launch.max_num_seqs,
            launch.num_tokens,
            launch.memory_ratio,
            min(launch.max_prefill_length or PROBE_TOKENS_MAX, PROBE_TOKENS_MAX),
            geometry,
        )
    except CapacityError as exc:
        raise StartupError(str(exc)) from exc
    max_len = launch.max_model_len
    if max_len > capacity:
        if launch.max_model_len_explicit:
            raise StartupError(
                f"--max-model-len {max_len} does not fit the KV capacity of {capacity} tokens "
                "(--num-tokens, or what the memory holds); raise --num-tokens or lower "
                "--max-model-len"
            )
        max_len = capacity
    limits = SchedulerLimits(
        max_running=launch.max_num_seqs,
        max_waiting=launch.max_queued_requests,
        kv_capacity_tokens=capacity,
        page_tokens=page,
        max_model_len=max_len,
        eos_token_id=args.eos_token_id,
    )
    pool = KvPool(args, numerics.compute_dtype, num_pages=capacity // page, num_slots=limits.num_slots, device=device)
    log.info(
        "KV pool on %s: %d pages of %d tokens, %d sequence slots (%d for prefix snapshots), %.1f MiB",
        device,
        pool.num_pages,
        page,
        pool.num_slots,
        limits.num_prefix_slots,
        pool.num_bytes / 2**20,
    )
    user_cap = Setting(launch.max_prefill_length, Source(launch.max_prefill_length_source))
    planner_limits = PlannerLimits(user_cap, capacity, max_len)
    probe_tokens = min(
        plan_chunk(planner_snapshot(device, launch.memory_ratio, None, 0), geometry, planner_limits).effective_tokens,
        PROBE_TOKENS_MAX,
        capacity,
    )
    snapshot = planner_snapshot(device, launch.memory_ratio, _probe(model, pool, numerics, device), probe_tokens)
    plan = plan_chunk(snapshot, geometry, planner_limits)
    if plan.warning:
        log.warning("%s", plan.warning)
    fault = FaultInjection(launch.fault_oom_above_bytes, geometry.activation_bytes_per_token)
    runner = Runner(model, pool, numerics, args.eos_token_id, device, fault)
    ready = Ready(
        device=device.type,
        kv_capacity_tokens=capacity,
        max_running_requests=launch.max_num_seqs,
        max_model_len=max_len,
        chunk=plan,
        expert_slots=None if expert_cache is None else expert_cache.n_slots,
        vocab_size=args.vocab_size,
        eos_token_id=args.eos_token_id,
        expert_bank=None if expert_cache is None else expert_cache.bank.report.describe(),
        kv_pages=pool.num_pages,
        page_tokens=page,
        sequence_slots=pool.num_slots,
    )
    return EngineParts(Scheduler(limits), runner, ChunkState(plan), ready, expert_cache)


def _numerics(args, kernels: str, device: torch.device) -> Numerics:
    """The checkpoint's numerics with the kernel backends of --kernels (auto: Triton on CUDA; the FP8
    GEMM and FP4 MoE only for an FP8 checkpoint, whose numerics they need). On CUDA batch invariance
    is off: the Triton paths are not batch-invariant anyway, and one launch per token would leave the
    GPU waiting on launches."""
    fp8 = args.dtype == "fp8"
    base = default_backends(device)
    if not fp8:
        base = dataclasses.replace(base, fp8_gemm="torch", fp4_moe="torch")
    try:
        backends = resolve_backends(kernels, base)
    except ValueError as exc:
        raise StartupError(f"--kernels: {exc}") from exc
    if backends.uses_triton() and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise StartupError(
            f"--kernels {kernels}: the Triton kernels need a CUDA device (or TRITON_INTERPRET=1, "
            "for tests); this worker runs on the CPU"
        )
    fixed = [k for k in ("fp8_gemm", "fp4_moe") if getattr(backends, k) == "triton"]
    if fixed and not fp8:
        raise StartupError(
            f"--kernels {kernels}: {', '.join(fixed)}=triton reads FP8 / MXFP4 weights as an FP8 "
            f"checkpoint stores them; this checkpoint is {args.dtype}: choose torch for them"
        )
    num: Numerics = NUMERICS_ON if fp8 else NUMERICS_OFF
    return dataclasses.replace(num, backends=backends, batch_invariant=device.type != "cuda")


def _checked_kernels(numerics: Numerics, kernels: str, device: torch.device) -> Numerics:
    """The start-up kernel check (worker/kernel_check.py): the backends that passed it."""
    try:
        backends = check_kernels(numerics.backends, device, named_kernels(kernels))
    except KernelCheckError as exc:
        raise StartupError(f"--kernels {kernels}: {exc}") from exc
    return dataclasses.replace(numerics, backends=backends)


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise StartupError("--device cuda: no CUDA device is visible to torch; run `dsv4serve doctor`")
    return torch.device(name)


def _with_planned_expert_slots(ckpt, launch: WorkerLaunch, backends: KernelBackends) -> WorkerLaunch:
    """--moe-cache-size auto on CUDA: the whole-card memory plan's expert slots for this card."""
    try:
        slots, why = planned_expert_slots(list(ckpt.specs), ckpt.args, launch, backends)
    except ConfigError as exc:
        raise StartupError(str(exc)) from exc
    if slots is not None:
        log.info("expert slots from the memory plan: %d (%s)", slots, why)
    return msgspec.structs.replace(launch, moe_cache_size=slots)


def _check_weights_fit(
    ckpt, backends: KernelBackends, packed: bool, include_mtp: bool, launch: WorkerLaunch, device: torch.device
) -> None:
    """Refuse, by name and before allocating, weights that cannot fit where they will live: packed as
    stored for the Triton kernels, else dense in fp32 (FP8 / FP4 dequantized); from the checkpoint's
    headers (model/packed_load.device_bytes); expert slots are not counted."""
    args = ckpt.args
    n_experts = args.n_routed_experts * (args.n_all_layers if include_mtp else args.n_layers)
    resident = launch.moe_cache_size is None or launch.moe_cache_size >= n_experts
    need = device_bytes(
        ckpt.specs, args, backends if packed else TORCH, include_mtp, experts_resident=resident
    ).total_bytes
    where, have = (
        ("GPU", take_snapshot("cuda").total_bytes) if device.type == "cuda" else ("host", host_snapshot().free_bytes)
    )
    if need > have:
        held = "packed as stored" if packed else "dense in fp32"
        fixes = [] if packed else ["on CUDA the FP8 GEMM and FP4 MoE kernels load them packed (--kernels auto)"]
        if resident:
            fixes.append(
                "--moe-cache-size N keeps the routed experts in host memory (`dsv4serve plan --model M "
                "--gpu-memory <this card>` proposes N)"
            )
        raise StartupError(
            f"the weights need {need / 2**30:.1f} GiB {held}, more than the {have / 2**30:.1f} GiB of "
            f"{where} memory" + (": " + "; ".join(fixes) if fixes else "")
        )


def _probe(model: Transformer, pool: KvPool, numerics: Numerics, device: torch.device) -> Callable[[int], object]:
    """The calibration prefill: n tokens through slot 0 and the first pages, before any request runs
    (what it leaves in the pool is never read: reads are bounded by each sequence's own length)."""

    def run(n: int) -> object:
        seq = SequenceState(pool, 0, pages=list(range(-(-n // pool.page_tokens))))
        ids = torch.zeros(n, dtype=torch.long, device=device)
        return model.forward([BatchRow(ids, seq)], numerics)

    return run
