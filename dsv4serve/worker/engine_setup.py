"""Building the worker's engine from a WorkerLaunch: model, KV capacity, chunk plan, scheduler, runner."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dsv4serve.checkpoint.loader import iter_dense, open_checkpoint
from dsv4serve.config import Setting, Source
from dsv4serve.experts.attach import attach_expert_cache, iter_resident_dense
from dsv4serve.experts.slot_cache import ExpertSlotCache
from dsv4serve.ipc.messages import Ready, WorkerLaunch
from dsv4serve.model.kv_pool import KvPool
from dsv4serve.model.numerics import NUMERICS_OFF, NUMERICS_ON, Numerics
from dsv4serve.model.transformer import Transformer
from dsv4serve.worker.chunk_planner import ChunkPlan, PlannerLimits, plan_chunk, prefill_geometry, shrink_after_oom
from dsv4serve.worker.memory_probe import host_snapshot
from dsv4serve.worker.runner import FaultInjection, Runner
from dsv4serve.worker.scheduler import Scheduler, SchedulerLimits

log = logging.getLogger("dsv4serve.worker")
CPU_KV_CAPACITY_TOKENS = 131072  # the CPU reference path holds states in host memory; a modest default


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
    if launch.device != "cpu":
        raise StartupError("the CUDA path is not part of this build yet: run with --device cpu")
    device = torch.device("cpu")
    ckpt = open_checkpoint(launch.model_path)
    args = ckpt.args
    model = Transformer(args, include_mtp=ckpt.layout == "official")
    expert_cache = attach_expert_cache(model, ckpt, launch.moe_cache_size, device)  # None: all resident
    weights = iter_dense(ckpt, torch.float32, progress=True) if expert_cache is None else \
        iter_resident_dense(ckpt, torch.float32)
    state = dict(weights)
    model.load_state_dict(state, strict=True)
    del state
    model.eval()
    numerics: Numerics = NUMERICS_ON if args.dtype == "fp8" else NUMERICS_OFF
    capacity = launch.num_tokens or CPU_KV_CAPACITY_TOKENS
    page = args.page_tokens
    capacity = (capacity // page) * page
    max_len = launch.max_model_len
    if max_len > capacity:
        if launch.max_model_len_explicit:
            raise StartupError(f"--max-model-len {max_len} does not fit the KV capacity of {capacity} tokens "
                               f"(--num-tokens or the CPU default {CPU_KV_CAPACITY_TOKENS}); raise --num-tokens or "
                               "lower --max-model-len")
        max_len = capacity
    # the CPU path runs the reference attention, whose scores grow with the square of the chunk
    geometry = prefill_geometry(args, context_tokens=max_len, max_rows=launch.max_num_seqs, dense_attention=True)
    user_cap = Setting(launch.max_prefill_length, Source(launch.max_prefill_length_source))
    plan = plan_chunk(host_snapshot(launch.memory_ratio), geometry, PlannerLimits(user_cap, capacity, max_len))
    if plan.warning:
        log.warning("%s", plan.warning)
    chunk = ChunkState(plan)
    limits = SchedulerLimits(max_running=launch.max_num_seqs, max_waiting=launch.max_queued_requests,
                             kv_capacity_tokens=capacity, page_tokens=page, max_model_len=max_len,
                             eos_token_id=args.eos_token_id)
    fault = FaultInjection(launch.fault_oom_above_bytes, geometry.activation_bytes_per_token)
    pool = KvPool(args, numerics.compute_dtype, num_pages=capacity // page, num_slots=limits.num_slots,
                  device=device)
    log.info("KV pool: %d pages of %d tokens, %d sequence slots (%d for prefix snapshots), %.1f MiB",
             pool.num_pages, page, pool.num_slots, limits.num_prefix_slots, pool.num_bytes / 2**20)
    runner = Runner(model, pool, numerics, args.eos_token_id, device, fault)
    ready = Ready(device="cpu", kv_capacity_tokens=capacity, max_running_requests=launch.max_num_seqs,
                  max_model_len=max_len, chunk=plan,
                  expert_slots=None if expert_cache is None else expert_cache.n_slots,
                  vocab_size=args.vocab_size, eos_token_id=args.eos_token_id,
                  expert_bank=None if expert_cache is None else expert_cache.bank.report.describe(),
                  kv_pages=pool.num_pages, page_tokens=page, sequence_slots=pool.num_slots)
    return EngineParts(Scheduler(limits), runner, chunk, ready, expert_cache)
