"""The prefill chunk planner: a pure function of (memory snapshot, model geometry, limits).

    plan_chunk(snapshot, geometry, limits) -> ChunkPlan(requested, effective_tokens, binding, reason, warning)

No torch, no CUDA, no clock, no globals: the same inputs always give the same plan, so `dsv4serve plan`
(a GPU that is not here), the worker (a snapshot measured after start-up, see memory_probe.py) and the
tests all run the same code. Only `memory_probe.py` asks the device how much memory is free.

Rules, in order:
1. Bytes per prefill token: the probe's calibrated measurement when one ran, else the geometry
   estimate below times GEOMETRY_SAFETY_FACTOR (the estimate models tensors, not the allocator).
2. safe = (free - platform margin - fixed per-step bytes) // bytes per token, aligned DOWN to the
   alignment unit (a window page), and never below one unit. The chunk never comes from KV-pool
   geometry: the pool and max_model_len can only lower it (the seed bug was a chunk cap derived from
   the KV pool that grew with --num-tokens until a 13K-token chunk no longer fit).
3. auto (no --max-prefill-length): effective = min(safe, KV pool tokens, max_model_len); `binding`
   names the smallest. The pool and model-len ceilings are exact limits and are used as they are.
4. an explicit --max-prefill-length (source cli/env) is ALWAYS the effective value, exactly as given
   (it need not be aligned: chunking is exact at any boundary, dsv4-model.md §2.12):
   - at or below safe: binding "user-cap";
   - above safe: still honoured, binding "user-cap", with a loud `warning` that names the flag, the
     safe size and the bytes (the OOM recovery may later run smaller chunks, which a cap allows);
   - when one chunk of that size needs more activation memory than the whole card minus the platform
     margin, it can never run on this GPU: ConfigError naming the flag, the limit and why. (The
     whole-card plan, memory/plan.py, makes the stronger check that knows the weights and KV.)

Platform margins (bytes kept free that the allocator may never plan to use):
- native 512 MiB: allocator rounding/fragmentation and library workspaces (cuBLAS, Triton) that
  appear after the probe. An assumption, to be checked against the probe on real cards.
- wsl2 2.5 GiB: users.md reports the WSL2 driver refusing residency (ENOMEM) while nvidia-smi still
  shows ~2 GB free; 2 GiB for that plus the native 512 MiB.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace
from typing import Literal

from dsv4serve.config import ConfigError, Setting
from dsv4serve.ipc.messages import ChunkReport
from dsv4serve.model.args import ModelArgs
from dsv4serve.resolve import who

Platform = Literal["native", "wsl2"]
Binding = Literal["user-cap", "memory", "kv-pool", "alignment", "model-len"]

MIB = 1024**2
PLATFORM_MARGIN_BYTES: dict[str, int] = {"native": 512 * MIB, "wsl2": 2560 * MIB}
GEOMETRY_SAFETY_FACTOR = 1.25  # unmodelled temporaries + allocator rounding; a probe replaces it
FLAG = "--max-prefill-length"


@dataclass(frozen=True)
class MemorySnapshot:
    free_bytes: int  # what the server may still allocate (already limited by --memory-ratio)
    total_bytes: int
    platform: Platform
    measured_activation_bytes_per_token: int | None = None  # from memory_probe.measure_activation_bytes
    origin: str = "planned"  # "measured" (by memory_probe), "planned" (a memory plan), "simulated" (CPU tests)


@dataclass(frozen=True)
class PrefillGeometry:
    activation_bytes_per_token: int  # peak working set of one layer's prefill, per token (estimate)
    fixed_bytes: int  # per-step bytes that do not grow with the chunk (logits, indexer logits tile)
    alignment_tokens: int
    terms: tuple[tuple[str, int], ...] = ()  # the per-token estimate, term by term (for reports)
    # bytes per (chunk tokens)^2: the dense reference attention materializes [T, H, keys] scores
    # with keys ~ T; the tiled GPU kernels never do (0)
    pairwise_bytes: int = 0


@dataclass(frozen=True)
class PlannerLimits:
    user_cap: Setting[int | None]  # --max-prefill-length as resolved
    kv_pool_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class ChunkPlan:
    requested: int | None  # the user's --max-prefill-length, None for auto
    effective_tokens: int
    binding: Binding
    reason: str
    warning: str | None = None
    safe_tokens: int = 0  # the memory bound (aligned)
    activation_bytes_per_token: int = 0  # what the plan used (measured, or estimate x safety)
    alignment_tokens: int = 1

    def report(self) -> ChunkReport:
        """The plan as it crosses to the API process (ipc.messages.ChunkReport)."""
        return ChunkReport(**dataclasses.asdict(self))


# ----------------------------------------------------------------------------------- geometry


def alignment_tokens(args: ModelArgs) -> int:
    """One window page: lcm of window_size and every compress ratio no larger than it (for the real
    model 4 and 128 divide 128, so the page is 128 tokens). A chunk ending on a page closes whole
    compressor windows; larger ratios carry partial windows in the state exactly anyway."""
    ratios = [r for r in args.compress_ratios if 0 < r <= args.window_size]
    return math.lcm(args.window_size, *ratios)


def prefill_geometry(
    args: ModelArgs, context_tokens: int, max_rows: int = 1, dense_attention: bool = False
) -> PrefillGeometry:
    """Peak activation bytes of one layer's prefill, per token, from the config alone.

    Layers run one after another, so the peak is: the residual streams (live across the layer) plus
    the larger of the attention half and the MoE half. Liveness inside a half is not modelled: every
    tensor of the half is summed, which over-counts a little (e.g. q's fp32 norm transient and o).
    Engine assumptions (the runner must keep them, or the probe will show it):
    - attention keys per query: window + index_topk (CSA's selected entries). HCA layers attend to up
      to context/ratio entries; the kernel is assumed to stream those in tiles of that same size, so
      no per-token score row grows with the context;
    - the indexer's logits over all visible entries, [tile, context / 4] fp32, are computed per query
      tile of one alignment unit: a FIXED buffer, not a per-token one;
    - logits: only the last position of each row, fp32, plus one same-sized buffer for sampling.
    `dense_attention` (the CPU reference path, dsv4serve/model/attention.py): every query scores
    every key of the chunk, fp32 scores + masked scores + probabilities [T, H, T] and a bool mask
    [T, T], plus the indexer's fp32 [T, H_I, T / ratio] scores: a term in T^2 (`pairwise_bytes`).
    """
    hc, dim, heads, hd = args.hc_mult, args.dim, args.n_heads, args.head_dim
    k, inter = args.n_activated_experts, args.moe_inter_dim
    keys = args.window_size + args.index_topk
    has_csa = "csa" in args.layer_kinds
    csa_ratio = min((r for r, kd in zip(args.compress_ratios, args.layer_kinds) if kd == "csa"), default=0)
    coff_d = 2 * hd if has_csa else hd  # CSA compressor projects 2x head_dim (overlapping windows)
    residual = [
        ("hc streams in [hc, D] fp32", hc * dim * 4),
        ("hc streams out [hc, D] fp32", hc * dim * 4),
        ("hc mix logits [(2+hc)*hc] fp32", (2 + hc) * hc * 4),
    ]
    attention = [
        ("hc_pre output + attn_norm [D] bf16 x2", 2 * dim * 2),
        ("fp8 activation copy [D] e4m3", dim),
        ("qr = q_norm(wq_a x) [q_lora] bf16", args.q_lora_rank * 2),
        ("q [H, d] bf16", heads * hd * 2),
        ("q per-head rms-norm transient [H, d] fp32", heads * hd * 4),
        ("kv (K = V) [d] bf16", hd * 2),
        ("compressor kv + gate projections [2, coff*d] fp32", 2 * coff_d * 4 if any(args.compress_ratios) else 0),
        ("indexer compressor kv + gate [2, 2*d_I] fp32", 2 * 2 * args.index_head_dim * 4 if has_csa else 0),
        ("indexer q [H_I, d_I] bf16", args.index_n_heads * args.index_head_dim * 2 if has_csa else 0),
        ("indexer head weights [H_I] fp32", args.index_n_heads * 4 if has_csa else 0),
        ("attention scores [H, window+topk] fp32", heads * keys * 4),
        ("attention probabilities [H, window+topk] fp32", heads * keys * 4),
        ("attention output o [H, d] fp32", heads * hd * 4),
        ("o after inverse rope [H, d] bf16", heads * hd * 2),
        ("wo_a output [groups, o_lora] bf16", args.o_groups * args.o_lora_rank * 2),
        ("wo_b output [D] bf16", dim * 2),
    ]
    shared = args.n_shared_experts * inter
    moe = [
        ("hc_pre output + ffn_norm [D] bf16 x2", 2 * dim * 2),
        ("router logits + scores [E] fp32", 2 * args.n_routed_experts * 4),
        ("routed inputs gathered [k, D] bf16", k * dim * 2),
        ("routed w1/w3 outputs [k, 2, I] fp32", k * 2 * inter * 4),
        ("routed activations [k, I] bf16", k * inter * 2),
        ("routed outputs [k, D] fp32", k * dim * 4),
        ("shared expert w1/w3 + act [2I] fp32 + [I] bf16", shared * 2 * 4 + shared * 2),
        ("shared expert output [D] fp32", dim * 4),
        ("moe accumulator [D] fp32", dim * 4),
    ]
    half, half_name = max((sum(b for _, b in attention), "attention"), (sum(b for _, b in moe), "moe"))
    terms = tuple(residual) + tuple(
        (f"{half_name}: {n}", b) for n, b in (attention if half_name == "attention" else moe)
    )
    unit = alignment_tokens(args)
    indexer_tile = unit * math.ceil(context_tokens / csa_ratio) * 4 if has_csa else 0
    logits = 2 * max_rows * args.vocab_size * 4
    pairwise = 0
    if dense_attention:
        pairwise = 3 * heads * 4 + 1 + (math.ceil(args.index_n_heads * 4 / csa_ratio) if has_csa else 0)
    return PrefillGeometry(
        activation_bytes_per_token=sum(b for _, b in residual) + half,
        fixed_bytes=indexer_tile + logits,
        alignment_tokens=unit,
        terms=terms,
        pairwise_bytes=pairwise,
    )


def activation_bytes(per_token: int, fixed: int, tokens: int, pairwise: int = 0) -> int:
    return tokens * per_token + pairwise * tokens * tokens + fixed


def bytes_per_token(snapshot: MemorySnapshot, geometry: PrefillGeometry) -> tuple[int, str]:
    if snapshot.measured_activation_bytes_per_token:
        return snapshot.measured_activation_bytes_per_token, "measured by the start-up probe"
    est = math.ceil(geometry.activation_bytes_per_token * GEOMETRY_SAFETY_FACTOR)
    return est, f"geometry estimate x {GEOMETRY_SAFETY_FACTOR}"


# ------------------------------------------------------------------------------------ planning


def _mib(n: int) -> str:
    return f"{n / MIB:,.0f} MiB"


def pairwise_bytes(snapshot: MemorySnapshot, geometry: PrefillGeometry) -> int:
    """The T^2 coefficient the plan uses: the estimate times the safety factor unless measured."""
    if snapshot.measured_activation_bytes_per_token:
        return geometry.pairwise_bytes
    return math.ceil(geometry.pairwise_bytes * GEOMETRY_SAFETY_FACTOR)


def max_tokens(room: int, per_token: int, pairwise: int) -> int:
    """The largest T with pairwise*T^2 + per_token*T <= room (0 when nothing fits)."""
    room = max(room, 0)
    if not pairwise:
        return room // per_token
    t = int((-per_token + math.sqrt(per_token * per_token + 4 * pairwise * room)) / (2 * pairwise))
    while t > 0 and pairwise * t * t + per_token * t > room:  # guard the float square root
        t -= 1
    return t


def safe_tokens(snapshot: MemorySnapshot, geometry: PrefillGeometry) -> tuple[int, int, str]:
    """(aligned memory bound in tokens, bytes per token used, how that figure was obtained)."""
    per_token, how = bytes_per_token(snapshot, geometry)
    margin = PLATFORM_MARGIN_BYTES[snapshot.platform]
    raw = max_tokens(snapshot.free_bytes - margin - geometry.fixed_bytes, per_token, pairwise_bytes(snapshot, geometry))
    unit = geometry.alignment_tokens
    return (raw // unit) * unit, per_token, how


def plan_chunk(snapshot: MemorySnapshot, geometry: PrefillGeometry, limits: PlannerLimits) -> ChunkPlan:
    safe, per_token, how = safe_tokens(snapshot, geometry)
    unit, margin = geometry.alignment_tokens, PLATFORM_MARGIN_BYTES[snapshot.platform]
    memory_why = (
        f"{_mib(snapshot.free_bytes)} free ({snapshot.origin}) - {_mib(margin)} {snapshot.platform} "
        f"margin - {_mib(geometry.fixed_bytes)} fixed, at {per_token:,} B/token ({how})"
    )
    if geometry.pairwise_bytes:
        memory_why += f" + {pairwise_bytes(snapshot, geometry)} B x tokens^2 (dense reference attention)"
    common = dict(safe_tokens=safe, activation_bytes_per_token=per_token, alignment_tokens=unit)
    cap = limits.user_cap
    if cap.value is not None and cap.source.explicit:
        return _honour_user_cap(cap, snapshot, geometry, limits, safe, per_token, memory_why, common)
    candidates: list[tuple[int, Binding, str]] = []
    if safe >= unit:
        candidates.append((safe, "memory", f"largest {unit}-token-aligned chunk that fits: {memory_why}"))
    else:
        candidates.append(
            (
                unit,
                "alignment",
                f"one {unit}-token window page, the smallest chunk the planner "
                f"uses; memory alone would allow less: {memory_why}",
            )
        )
    candidates.append((limits.kv_pool_tokens, "kv-pool", f"the KV pool holds {limits.kv_pool_tokens:,} tokens"))
    candidates.append(
        (limits.max_model_len, "model-len", f"no prompt is longer than max_model_len {limits.max_model_len:,}")
    )
    tokens, binding, reason = min(candidates, key=lambda c: c[0])  # ties: memory first (listed first)
    warning = None
    pairwise = pairwise_bytes(snapshot, geometry)
    if activation_bytes(per_token, geometry.fixed_bytes, tokens, pairwise) + margin > snapshot.free_bytes:
        warning = (
            f"only {_mib(snapshot.free_bytes)} free: even a {tokens}-token chunk "
            f"({_mib(tokens * per_token)} of activations) may run out of memory; out-of-memory "
            "recovery will shrink it further"
        )
    return ChunkPlan(None, tokens, binding, reason, warning, **common)


def _honour_user_cap(
    cap: Setting[int | None],
    snapshot: MemorySnapshot,
    geometry: PrefillGeometry,
    limits: PlannerLimits,
    safe: int,
    per_token: int,
    memory_why: str,
    common: dict,
) -> ChunkPlan:
    assert cap.value is not None, "plan_chunk calls this only for an explicit cap"
    n = int(cap.value)
    margin = PLATFORM_MARGIN_BYTES[snapshot.platform]
    flag = who("max_prefill_length", cap)  # the flag, or DSV4SERVE_MAX_PREFILL_LENGTH
    pairwise = pairwise_bytes(snapshot, geometry)
    need = activation_bytes(per_token, geometry.fixed_bytes, n, pairwise)
    if need > snapshot.total_bytes - margin:
        largest = max_tokens(snapshot.total_bytes - margin - geometry.fixed_bytes, per_token, pairwise)
        raise ConfigError(
            f"{flag} {n}: one prefill chunk of {n} tokens needs about {_mib(need)} of activations "
            f"({per_token:,} B/token), more than this GPU's {_mib(snapshot.total_bytes)} minus the "
            f"{_mib(margin)} {snapshot.platform} margin, so it can never run here; use at most {largest} "
            f"(the safe size now is {safe})"
        )
    never = []
    if n > limits.max_model_len:
        never.append(f"max_model_len {limits.max_model_len:,}")
    if n > limits.kv_pool_tokens:
        never.append(f"the KV pool ({limits.kv_pool_tokens:,} tokens)")
    note = f"; it never binds: no chunk is longer than {' or '.join(never)}" if never else ""
    if n <= safe:
        return ChunkPlan(
            n,
            n,
            "user-cap",
            f"{flag} {n} ({cap.source.value}), within the safe {safe} ({memory_why}){note}",
            None,
            **common,
        )
    warning = (
        f"{flag} {n} is honoured, but it is above the safe chunk of {safe} tokens: a {n}-token chunk "
        f"needs about {_mib(need)} + {_mib(margin)} margin and only {_mib(snapshot.free_bytes)} is free "
        f"({memory_why}). Long prompts may hit out-of-memory; recovery then runs smaller chunks. "
        f"Use {FLAG} {max(safe, geometry.alignment_tokens)} or less to avoid that."
    )
    return ChunkPlan(
        n, n, "user-cap", f"{flag} {n} ({cap.source.value}), honoured above the safe {safe}{note}", warning, **common
    )


def shrink_after_oom(plan: ChunkPlan, failed_tokens: int) -> ChunkPlan:
    """The plan learns from an out-of-memory error in a chunk of `failed_tokens`: the new ceiling is
    half of it aligned down to the alignment unit, and at least one unit; a chunk of under two units
    is halved unaligned (at least 1 token), so every OOM lowers the ceiling until a 1-token chunk,
    after which the caller must fail the request. A user cap is a ceiling: running below it after an
    OOM still honours it (the cap is never raised or ignored)."""
    unit = plan.alignment_tokens
    half = (failed_tokens // 2 // unit) * unit
    lowered = half if half >= unit else min(unit, max(1, failed_tokens // 2))
    lowered = min(lowered, plan.effective_tokens)
    if failed_tokens <= 1:
        lowered = 1
    reason = (
        f"out of memory in a {failed_tokens}-token chunk: ceiling lowered to {lowered} "
        f"(half, aligned to {unit}); was {plan.effective_tokens} ({plan.binding})"
    )
    return replace(
        plan, effective_tokens=lowered, binding="memory", reason=reason, safe_tokens=min(plan.safe_tokens, lowered)
    )
