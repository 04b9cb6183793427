"""The whole-card memory plan: what lives on the GPU, from the config alone (pure: no device calls).

    plan_memory(args, weights, machine, settings) -> MemoryPlan

Budget = gpu bytes x --memory-ratio; the platform margin (chunk_planner.PLATFORM_MARGIN_BYTES) is
never planned. From the rest, in this priority order:
1. Resident non-expert weights: everything but routed experts (attention, shared experts, embed,
   head, norms, hc, compressors, indexer, router). The MTP block (its weights and KV layer) only with
   --speculative-tokens N > 0 (memory/weights.include_mtp). If they do not fit: error naming --memory-ratio.
2. Routed experts: all resident when they fit beside the floors (sequence states, KV floor) and an
   OFFLOAD_CHUNK_TARGET chunk. Otherwise an expert-slot cache of N slots (one slot = one expert's
   w1+w3+w2 with scales, of any layer) with the whole expert bank in host memory; the cache gets
   what is left after the KV target (OFFLOAD_KV_TOKENS) and an OFFLOAD_CHUNK_TARGET chunk. When that
   is below the minimum (n_activated_experts: one token's experts of one layer) the KV and chunk
   targets shrink to their floors (KV_FLOOR_TOKENS, one window page) and the plan says so. Offloaded experts
   also get the prefill stream's area (two ranges of experts: memory/prefill_speed.py) before the slots.
3. KV capacity: bf16 cache bytes per token from the geometry (kv_geometry.py, dsv4-model.md §2.11: one compressed
   entry per ratio tokens in every CSA/HCA layer, plus CSA indexer keys), and the fixed per-sequence
   state (a window of window_size keys per layer, fp32 compressor rings) x max_num_seqs. Offloaded:
   OFFLOAD_KV_TOKENS (capped by max_model_len). Resident: the KV target, then a chunk of up to
   RESIDENT_CHUNK_TARGET, then everything left (up to max_model_len x max_num_seqs). The auto
   max_model_len is the model limit capped by the KV capacity.
4. Activation headroom: what is left is the chunk planner's free memory (chunk_planner.plan_chunk),
   always at least one window page of prefill.
5. Host memory (offloaded experts): the expert bank (dsv4serve/experts/bank.py) takes host RAM minus
   HOST_MARGIN_BYTES; what does not fit stays in the checkpoint's shards and pages in from disk
   (a warning). The pin budget is estimated (WSL2: about half of RAM, less in Docker) and measured at
   startup.

Explicit user values (source cli/env) are honoured exactly, or planning stops with a ConfigError that
names the flag, the limit and why: --num-tokens, --moe-cache-size, --max-num-seqs, --max-model-len
(must fit the KV) and --memory-ratio. --max-prefill-length: refused only when one chunk of it cannot
fit even with no expert slots and no KV; reserved (shrinking the auto expert cache, KV to its target)
when it fits beside the floors; otherwise honoured with a loud warning, as the chunk planner does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from dsv4serve.config import ConfigError, Setting, Source
from dsv4serve.memory.chunk_planner import (
    GEOMETRY_SAFETY_FACTOR,
    PLATFORM_MARGIN_BYTES,
    ChunkPlan,
    MemorySnapshot,
    PlannerLimits,
    PrefillGeometry,
    plan_chunk,
    prefill_geometry,
)
from dsv4serve.memory.decode_choice import eager_reason, split_tiers
from dsv4serve.memory.graph_memory import decode_graph_bytes
from dsv4serve.memory.host_plan import HostSplit, host_split, plans_cpu_experts
from dsv4serve.memory.kv_geometry import KvGeometry, kv_bytes, kv_geometry, kv_tokens_for
from dsv4serve.memory.prefill_speed import stream_area_bytes
from dsv4serve.memory.weights import WeightBytes
from dsv4serve.model.args import ModelArgs
from dsv4serve.resolve import who

GIB = 1024**3
# experts offloaded: slots matter for decode; ds4 saw 1K->8K = +24% prefill. A streamed cold prefill's tokens/s grow
# with the chunk (memory/prefill_speed.py), but 8,192 here takes slots the disk tier's misses need: on a 32 GB card
# and 128 GiB host, decode 6.6 -> 5.2 tokens/s for prefill 416 -> 803 (the plan prints both; --max-prefill-length picks)
OFFLOAD_CHUNK_TARGET = 4096
RESIDENT_CHUNK_TARGET = 16384  # all resident: memory is plentiful, bigger chunks prefill faster
OFFLOAD_KV_TOKENS = 262144  # users.md: agent prompts of 20K-300K tokens
KV_FLOOR_TOKENS = 32768  # below this an auto plan would be useless: shrink slots instead


def _g(n: int | float) -> str:
    return f"{n / GIB:.2f} GiB"


# ----------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Machine:
    gpu_bytes: int
    host_bytes: int | None
    platform: str  # native | wsl2


@dataclass(frozen=True)
class PlanSettings:
    memory_ratio: Setting[float]
    num_tokens: Setting[int | None]
    moe_cache_size: Setting[int | None]
    max_num_seqs: Setting[int]
    max_model_len: Setting[int]  # resolved: explicit, or the model limit (model-rule)
    max_prefill_length: Setting[int | None]
    enforce_eager: Setting[bool] = Setting(False, Source.DEFAULT)  # off: decode graphs are captured (and planned)
    cpu_experts: bool = False  # --moe-backend hybrid (or auto with kt-kernel): host RAM holds kt-kernel's copy
    speculative_tokens: int = 0  # --speculative-tokens: the verify steps' graphs grow the graph pool
    kt_layers: int | None = None  # hybrid: layers kt-kernel holds (decode_choice.best_kt_layers); None: all that fit

    @classmethod
    def from_config(cls, cfg: Any) -> PlanSettings:
        return cls(
            cfg.memory_ratio,
            cfg.num_tokens,
            cfg.moe_cache_size,
            cfg.max_num_seqs,
            cfg.max_model_len,
            cfg.max_prefill_length,
            cfg.enforce_eager,
            plans_cpu_experts(cfg.moe_backend.value),
            cfg.speculative_tokens.value,
        )


def _explicit(setting: Setting[int | None]) -> int | None:
    """The user's value, or None when the setting was not given (an explicit value is a parsed positive int)."""
    if not setting.source.explicit:
        return None
    assert setting.value is not None, "an explicit setting always carries a value"
    return setting.value


# ----------------------------------------------------------------------------------- output


@dataclass(frozen=True)
class MemoryPlan:
    machine: Machine
    budget_bytes: int
    margin_bytes: int
    resident_weight_bytes: int
    include_mtp: bool
    experts_resident: bool
    expert_slots: int  # = n_experts when resident
    expert_slot_bytes: int
    n_experts: int
    host_expert_bytes: int
    kv_tokens: int
    kv_cache_bytes: int
    seq_state_bytes: int  # all sequences
    max_running: int
    max_model_len: int
    activation_free_bytes: int  # free for activations after everything above (margin included)
    geometry: PrefillGeometry
    chunk: ChunkPlan
    decisions: tuple[str, ...]
    warnings: tuple[str, ...]
    host: HostSplit | None = None  # where the expert bank lives in host memory; None: all resident
    decode_graph_bytes: int = 0  # the decode CUDA graphs' pool (memory/graph_memory.py); 0 with --enforce-eager
    stream_area_bytes: int = 0  # the prefill stream's two ranges of experts (memory/prefill_speed.py); 0: resident

    @property
    def gpu_used_bytes(self) -> int:
        return (
            self.resident_weight_bytes
            + self.decode_graph_bytes
            + self.expert_slots * self.expert_slot_bytes
            + self.stream_area_bytes
            + self.kv_cache_bytes
            + self.seq_state_bytes
        )

    def to_json(self) -> dict[str, Any]:
        c = self.chunk
        return {
            "budget_bytes": self.budget_bytes,
            "platform_margin_bytes": self.margin_bytes,
            "resident_weight_bytes": self.resident_weight_bytes,
            "mtp_resident": self.include_mtp,
            "decode_graph_bytes": self.decode_graph_bytes,
            "experts": {
                "all_resident": self.experts_resident,
                "slots": self.expert_slots,
                "slot_bytes": self.expert_slot_bytes,
                "total": self.n_experts,
                "gpu_bytes": self.expert_slots * self.expert_slot_bytes,
                "prefill_stream_bytes": self.stream_area_bytes,
                "host_bytes": self.host_expert_bytes,
                "host_memory": dataclasses.asdict(self.host) if self.host else None,
            },
            "kv": {
                "tokens": self.kv_tokens,
                "cache_bytes": self.kv_cache_bytes,
                "seq_state_bytes": self.seq_state_bytes,
                "max_running": self.max_running,
                "max_model_len": self.max_model_len,
            },
            "activations": {
                "free_bytes": self.activation_free_bytes,
                "bytes_per_token_estimate": self.geometry.activation_bytes_per_token,
                "bytes_per_token_planned": c.activation_bytes_per_token,
                "safety_factor": GEOMETRY_SAFETY_FACTOR,
                "fixed_bytes": self.geometry.fixed_bytes,
                "alignment_tokens": self.geometry.alignment_tokens,
            },
            "chunk": {
                "requested": c.requested,
                "effective": c.effective_tokens,
                "binding": c.binding,
                "safe_tokens": c.safe_tokens,
                "reason": c.reason,
                "warning": c.warning,
            },
            "gpu_used_bytes": self.gpu_used_bytes,
            "decisions": list(self.decisions),
            "warnings": list(self.warnings),
        }


# ---------------------------------------------------------------------------------- planning


def plan_memory(
    args: ModelArgs, weights: WeightBytes, machine: Machine, settings: PlanSettings, include_mtp: bool = False
) -> MemoryPlan:
    s, seqs, model_len = settings, settings.max_num_seqs.value, settings.max_model_len.value
    margin = margin_for(machine)
    budget = int(machine.gpu_bytes * s.memory_ratio.value)
    resident = weights.non_expert_bytes + (weights.mtp_bytes if include_mtp else 0)
    decisions = [
        f"budget {_g(budget)} = {_g(machine.gpu_bytes)} x {s.memory_ratio.value} (--memory-ratio, "
        f"{s.memory_ratio.source.value}); {_g(margin)} {machine.platform} margin is never planned"
    ]
    graphs = 0 if s.enforce_eager.value else decode_graph_bytes(args, seqs, model_len, s.speculative_tokens)
    avail = budget - margin - resident - graphs
    if avail <= 0:
        raise ConfigError(
            f"{who('memory_ratio', s.memory_ratio)} {s.memory_ratio.value}: a budget of {_g(budget)} "
            f"minus the {_g(margin)} {machine.platform} margin cannot hold the {_g(resident)} of "
            "non-expert weights that must stay on the GPU; use a larger GPU or memory ratio"
        )
    decisions.append(
        f"non-expert weights resident: {_g(resident)}"
        + (
            f" (the MTP block's {_g(weights.mtp_bytes)} included: it drafts for --speculative-tokens)"
            if include_mtp
            else f" (MTP block, {_g(weights.mtp_bytes)}, not loaded: --speculative-tokens 0)"
        )
    )
    decisions.append(
        "decode graphs: none (--enforce-eager)"
        if s.enforce_eager.value
        else f"decode graphs: {_g(graphs)} reserved for the CUDA graphs of decode batches up to {seqs} rows "
        + (f"and their verify steps of up to {s.speculative_tokens} drafts " if s.speculative_tokens else "")
        + "(estimate: one forward of the largest bucket; captured before the chunk planner measures free memory)"
    )
    r = _Reservations.make(args, weights, s, avail, include_mtp)
    cap = s.max_prefill_length
    if cap.source.explicit and cap.value is not None:
        decisions.append(
            f"{who('max_prefill_length', cap)} {cap.value}: "
            + (
                "activation room for it is reserved before the expert cache"
                if r.cap
                else "does not fit beside the minimum expert slots and KV floor; honoured anyway, with a warning "
                f"(the largest cap the plan can reserve is {r.largest_reservable_chunk(weights.expert_bytes):,})"
            )
        )
    stream = stream_area_bytes(weights.n_experts // args.n_layers, weights.expert_bytes)  # if offloaded
    slots, resident_all, kv_target, act_target = _experts(r, weights, s, decisions, stream)
    stream = 0 if resident_all else stream
    rest = avail - slots * weights.expert_bytes - stream - r.seq_bytes  # for KV + activations
    kv_tok = _kv_tokens(r, s, rest, kv_target, act_target)
    kvb = kv_bytes(r.kv, kv_tok)
    max_len = model_len if s.max_model_len.source.explicit else min(model_len, kv_tok)
    decisions.append(
        f"KV: {kv_tok:,} tokens ({_g(kvb)} at {float(r.kv.bytes_per_token):,.1f} B/token bf16) + "
        f"{seqs} sequence states ({_g(r.seq_bytes)}); max_model_len {max_len:,}"
        + ("" if max_len == model_len else f" (model limit {model_len:,}, capped by KV capacity)")
    )
    host = 0 if resident_all else weights.routed_expert_bytes
    warnings: list[str] = []
    layer_bytes = host // args.n_layers
    split = host_split(host, machine, decisions, warnings, s.cpu_experts, layer_bytes, s.kt_layers) if host else None
    if split is not None and graphs:  # as engine_setup.eager_reason decides from the pin budget it measures
        tiers = split_tiers(split, s.cpu_experts, args.n_layers)
        why = eager_reason(False, "hybrid" if s.cpu_experts else "offload", s.speculative_tokens > 0)
        if why is not None:
            decisions.append(f"decode graphs: none after all ({why}); their {_g(graphs)} go to activations")
            graphs = 0
        elif tiers.pinned < 1.0:
            cuts = round((1.0 - tiers.pinned) * args.n_layers)
            decisions.append(
                f"decode graphs: cut at about {cuts} of {args.n_layers} MoE layers, whose experts are not pinned (the "
                "host stages their misses between graph segments: experts/graph_cuts.py)"
            )
    free = budget - resident - graphs - slots * weights.expert_bytes - stream - kvb - r.seq_bytes
    geometry, chunk = final_chunk(args, machine, s, free, kv_tok, max_len)
    warnings += [chunk.warning] if chunk.warning else []
    return MemoryPlan(
        machine,
        budget,
        margin,
        resident,
        include_mtp,
        resident_all,
        slots,
        weights.expert_bytes,
        weights.n_experts,
        host,
        kv_tok,
        kvb,
        r.seq_bytes,
        seqs,
        max_len,
        free,
        geometry,
        chunk,
        tuple(decisions),
        tuple(warnings),
        split,
        graphs,
        stream,
    )


@dataclass(frozen=True)
class _Reservations:
    """The floors every plan must hold, and the activation cost of a chunk (estimate x safety)."""

    kv: KvGeometry
    seq_bytes: int
    kv_floor: int
    per_token: int
    fixed: int
    unit: int
    cap: int | None  # explicit --max-prefill-length
    min_slots: int
    avail: int

    @classmethod
    def make(
        cls, args: ModelArgs, weights: WeightBytes, s: PlanSettings, avail: int, include_mtp: bool = False
    ) -> _Reservations:
        kv = kv_geometry(args, include_mtp)
        model_len = s.max_model_len.value
        geo = prefill_geometry(args, model_len, s.max_num_seqs.value)  # context upper bound: conservative
        explicit_kv = _explicit(s.num_tokens)
        if explicit_kv is not None:
            kv_floor = explicit_kv
            if s.max_model_len.source.explicit and model_len > kv_floor:
                raise ConfigError(
                    f"{who('max_model_len', s.max_model_len)} {model_len} needs a KV cache of at least "
                    f"{model_len} tokens, but {who('num_tokens', s.num_tokens)} {kv_floor} holds "
                    "fewer: raise the KV capacity or lower the context limit"
                )
        else:
            kv_floor = model_len if s.max_model_len.source.explicit else min(model_len, KV_FLOOR_TOKENS)
        cap = _explicit(s.max_prefill_length)
        explicit_slots = _explicit(s.moe_cache_size)
        min_slots = min(explicit_slots, weights.n_experts) if explicit_slots else args.n_activated_experts
        r = cls(
            kv,
            s.max_num_seqs.value * kv.seq_state_bytes,
            kv_floor,
            math.ceil(geo.activation_bytes_per_token * GEOMETRY_SAFETY_FACTOR),
            geo.fixed_bytes,
            geo.alignment_tokens,
            None,
            min_slots,
            avail,
        )
        r.check_floors(weights, s, r.unit)
        if cap is None:
            return r
        if r.act(cap) > avail:
            flag = who("max_prefill_length", s.max_prefill_length)
            largest = max(avail - r.fixed, 0) // r.per_token
            raise ConfigError(
                f"{flag} {cap}: one {cap}-token prefill chunk needs about {_g(r.act(cap))} of "
                f"activations ({r.per_token:,} B/token, estimate x {GEOMETRY_SAFETY_FACTOR}), more "
                f"than the {_g(avail)} this GPU has beside the non-expert weights even with no expert "
                f"slots and no KV cache; use at most {largest}"
            )
        fits = r.floor_bytes(weights.expert_bytes, cap) <= avail
        return dataclasses.replace(r, cap=cap if fits else None)  # a cap that does not fit is not reserved

    def act(self, tokens: int) -> int:
        return tokens * self.per_token + self.fixed

    @property
    def act_floor(self) -> int:
        return self.act(self.cap if self.cap is not None else self.unit)

    def floor_bytes(self, slot_bytes: int, chunk_tokens: int) -> int:
        return self.min_slots * slot_bytes + self.seq_bytes + kv_bytes(self.kv, self.kv_floor) + self.act(chunk_tokens)

    def largest_reservable_chunk(self, slot_bytes: int) -> int:
        room = self.avail - self.floor_bytes(slot_bytes, 0)
        return max(room, 0) // self.per_token

    def check_floors(self, weights: WeightBytes, s: PlanSettings, chunk_tokens: int) -> None:
        need = self.floor_bytes(weights.expert_bytes, chunk_tokens)
        if need <= self.avail:
            return
        parts = [
            (f"{self.min_slots} expert slots", self.min_slots * weights.expert_bytes, "moe_cache_size"),
            (
                f"KV for {self.kv_floor:,} tokens",
                kv_bytes(self.kv, self.kv_floor),
                "num_tokens" if s.num_tokens.source.explicit else "max_model_len",
            ),
            (f"{s.max_num_seqs.value} sequence states", self.seq_bytes, "max_num_seqs"),
            (f"one {chunk_tokens}-token prefill chunk", self.act(chunk_tokens), "memory_ratio"),
        ]
        named = [f"{who(f, getattr(s, f))} {getattr(s, f).value}" for _, _, f in parts if getattr(s, f).source.explicit]
        raise ConfigError(
            f"{', '.join(named) or 'this GPU'}: after the weights, {_g(self.avail)} is left, but the plan needs "
            f"{_g(need)}: "
            + "; ".join(f"{n} {_g(b)}" for n, b, _ in parts)
            + ". Lower the named values (or use a larger GPU / --memory-ratio)"
        )


def _experts(
    r: _Reservations, w: WeightBytes, s: PlanSettings, decisions: list[str], stream: int
) -> tuple[int, bool, int, int]:
    """(slots, all resident, KV target tokens, activation target bytes); `stream`: the prefill stream's area, which
    offloaded experts need beside their slots."""
    model_len, seqs, slot = s.max_model_len.value, s.max_num_seqs.value, w.expert_bytes
    kv_target = r.kv_floor if s.num_tokens.source.explicit else max(r.kv_floor, min(model_len, OFFLOAD_KV_TOKENS))
    res_target = r.act(r.cap if r.cap is not None else min(RESIDENT_CHUNK_TARGET, model_len))
    off_target = r.act(r.cap if r.cap is not None else min(OFFLOAD_CHUNK_TARGET, model_len))
    all_bytes = w.n_experts * slot
    explicit_slots = _explicit(s.moe_cache_size)
    if explicit_slots is not None:
        slots = min(explicit_slots, w.n_experts)
        decisions.append(
            f"expert slots: {slots} ({who('moe_cache_size', s.moe_cache_size)}, honoured), {_g(slots * slot)}"
        )
        resident = slots == w.n_experts
        if not resident:
            decisions.append(_stream_decision(stream, w))
        return slots, resident, (model_len * seqs if resident else kv_target), (res_target if resident else off_target)
    if all_bytes + r.seq_bytes + kv_bytes(r.kv, r.kv_floor) + off_target <= r.avail:
        # resident: a chunk of the offload target, then the KV target, then a chunk of up to the
        # resident target; whatever is left after that goes to the KV as well
        left = r.avail - all_bytes - r.seq_bytes
        kv_first = max(r.kv_floor, min(kv_target, kv_tokens_for(r.kv, left - off_target)))
        act_target = max(off_target, min(res_target, left - kv_bytes(r.kv, kv_first)))
        decisions.append(f"routed experts: all {w.n_experts} resident ({_g(all_bytes)})")
        return w.n_experts, True, model_len * seqs, act_target
    left = r.avail - r.seq_bytes - kv_bytes(r.kv, kv_target) - off_target - stream
    slots = min(max(left, 0) // slot, w.n_experts - 1)
    why = (
        f"after the KV target ({kv_target:,} tokens) and a {r.cap or min(OFFLOAD_CHUNK_TARGET, model_len)}-token chunk"
    )
    if slots < r.min_slots:
        slots, kv_target, off_target = r.min_slots, r.kv_floor, r.act_floor
        why = (
            f"the minimum ({r.min_slots}, one token's experts of one layer): the KV and chunk targets shrank to "
            f"their floors ({r.kv_floor:,} tokens, {r.cap or r.unit}-token chunk)"
        )
    decisions.append(
        f"routed experts: {_g(all_bytes)} do not fit; GPU expert-slot cache of {slots} slots x "
        f"{slot / 2**20:.2f} MiB = {_g(slots * slot)} ({100 * slots / w.n_experts:.1f}% of "
        f"{w.n_experts}), {why}; the expert bank stays in host memory"
    )
    decisions.append(_stream_decision(stream, w))
    return slots, False, kv_target, off_target


def _stream_decision(stream: int, w: WeightBytes) -> str:
    return (
        f"prefill expert stream: {_g(stream)} ({stream // w.expert_bytes} experts' room, two ranges) beside the slots: "
        "a prefill chunk's experts cross PCIe once each, as copies, instead of being read in place once per block of "
        "64 routes (experts/prefill_stream.py)"
    )


def _kv_tokens(r: _Reservations, s: PlanSettings, rest: int, kv_target: int, act_target: int) -> int:
    explicit_kv = _explicit(s.num_tokens)
    if explicit_kv is not None:
        return explicit_kv
    tokens = min(kv_target, kv_tokens_for(r.kv, rest - act_target))
    tokens = min(max(tokens, r.kv_floor), kv_tokens_for(r.kv, rest - r.act_floor))  # the chunk floor first
    aligned = (tokens // r.unit) * r.unit
    return max(aligned, r.kv_floor)


def final_chunk(
    args: ModelArgs, machine: Machine, settings: PlanSettings, free_bytes: int, kv_tokens: int, max_model_len: int
) -> tuple[PrefillGeometry, ChunkPlan]:
    geometry = prefill_geometry(args, max_model_len, settings.max_num_seqs.value)
    snapshot = MemorySnapshot(free_bytes, machine.gpu_bytes, machine.platform, None, "planned")  # type: ignore
    limits = PlannerLimits(settings.max_prefill_length, kv_tokens, max_model_len)
    return geometry, plan_chunk(snapshot, geometry, limits)


def margin_for(machine: Machine) -> int:
    return PLATFORM_MARGIN_BYTES[machine.platform]
