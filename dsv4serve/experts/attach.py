"""Wiring the expert bank and slot cache into a model (called by the worker's engine setup).

    cache = attach_expert_cache(model, ckpt, slots, device)   # None: every expert stays resident
    weights = iter_dense(ckpt) if cache is None else iter_resident_dense(ckpt)
    model.load_state_dict(dict(weights), strict=True)
    hybrid = attach_cpu_experts(model, cache, device)   # --moe-backend hybrid: misses on the CPU (kt-kernel)

`slots` is the memory plan's `expert_slots` (or --moe-cache-size); a count that covers every routed
expert of the model means "all resident" and nothing changes. Otherwise the bank is read packed from
the shards (pinned within the measured budget), every MoE layer gets the cache, and the routed
experts are left out of the dense state dict (`iter_resident_dense` never dequantizes them).
With --moe-backend hybrid, `attach_cpu_experts` then hands the bank to kt-kernel (experts/hybrid.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping

import torch
from tqdm import tqdm

from dsv4serve.checkpoint.loader import Checkpoint, iter_dense
from dsv4serve.experts.bank import ExpertBank, bank_bytes, check_bankable, expert_specs, load_expert_bank
from dsv4serve.experts.hybrid import HybridExperts
from dsv4serve.experts.kt_backend import KtGeometry, kt_threads
from dsv4serve.experts.pinning import PinBudget, measure_pin_budget
from dsv4serve.experts.slot_cache import ExpertSlotCache
from dsv4serve.memory.host_plan import HOST_MARGIN_BYTES, KT_COPY_FACTOR, kt_layers_copy_bytes
from dsv4serve.memory.prefill_speed import planned_stream_group
from dsv4serve.memory.probe import host_snapshot
from dsv4serve.model.moe import MoE
from dsv4serve.model.transformer import Transformer

log = logging.getLogger("dsv4serve.worker")


def moe_layers(model: Transformer) -> list[MoE]:
    """The model's MoE layers in execution order: main layers, then MTP blocks."""
    return [block.ffn for block in [*model.layers, *model.mtp]]


def attach_expert_cache(
    model: Transformer,
    ckpt: Checkpoint,
    slots: int | None,
    device: torch.device,
    pin: PinBudget | None = None,
    ram_bytes: int | None = None,
    progress: bool = True,
    stream_group: int | None = None,
) -> ExpertSlotCache | None:
    """Offload the routed experts to a host bank behind `slots` device slots, or None when `slots`
    is None or covers every routed expert. `pin`: a budget measured already (else measured here);
    `ram_bytes`: host RAM the bank may fill (else MemAvailable minus HOST_MARGIN_BYTES); `stream_group`: the
    prefill stream's range (prefill_stream.py; default: on CUDA the plan's `stream_group`, on the CPU none,
    whose kernels read RAM in place anyway)."""
    moes = moe_layers(model)
    total = sum(m.n_routed_experts for m in moes)
    if slots is None or slots >= total:
        return None
    k = ckpt.args.n_activated_experts
    if slots < k:
        raise ValueError(f"{slots} expert slots cannot hold one token's {k} experts of a layer")
    layers = [m.layer_id for m in moes]
    if ram_bytes is None:  # before the pin probe, which takes host memory while it measures
        ram_bytes = max(0, host_snapshot().free_bytes - HOST_MARGIN_BYTES)
    if pin is None:  # never probe past the RAM the bank may fill
        pin = measure_pin_budget(min(bank_bytes(expert_specs(ckpt, layers)), ram_bytes))
    bank = load_expert_bank(ckpt, layers, pin, ram_bytes, progress)
    if stream_group is None:
        stream_group = planned_stream_group(bank.n_experts) if device.type == "cuda" else 0
    cache = ExpertSlotCache(bank, slots, device, first_layer=moes[0].layer_id, stream_group=stream_group)
    for m in moes:
        m.use_expert_cache(cache)
    log.info(
        "expert-slot cache: %d slots x %.2f MiB on %s for %d routed experts%s",
        slots,
        bank.expert_bytes / 2**20,
        device,
        total,
        f"; prefill chunks stream their experts in 2 x {stream_group} more" if stream_group else "",
    )
    return cache


def iter_resident_dense(
    ckpt: Checkpoint, dtype: torch.dtype = torch.float32, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_dense` without the routed experts (they live in the bank, packed)."""
    check_bankable(ckpt)
    resident = tuple(s for s in ckpt.specs if s.group != "routed_experts")
    n_out = sum(1 for s in resident if s.role not in ("fp8_scale", "fp4_scale"))  # scales are consumed
    with tqdm(
        total=n_out, unit="tensor", desc=f"loading {ckpt.folder.name} (no routed experts)", disable=not progress
    ) as bar:
        for item in iter_dense(dataclasses.replace(ckpt, specs=resident), dtype, progress=False):
            bar.update(1)
            yield item


class _LayerParts(Mapping):
    """The bank's stacked parts of `layers`, a layer at a time: RAM layers as they are, a mapped layer read
    from the shards into temporaries (freed once kt-kernel has its copy)."""

    def __init__(self, bank: ExpertBank, layers: list[int]):
        self.bank, self.layers = bank, layers

    def __getitem__(self, layer: int) -> dict[str, torch.Tensor]:
        if layer in self.bank.layers:
            return self.bank.layers[layer]
        experts = [self.bank.expert(layer, e) for e in range(self.bank.n_experts)]
        return {part: torch.stack([x[part] for x in experts]) for part in self.bank.part_shapes}

    def __iter__(self):
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)


def bank_ram_beside_kt(specs, n_moe_layers: int = 0, kt_layers: int | None = None) -> int:
    """Host RAM the bank may fill with --moe-backend hybrid: MemAvailable minus HOST_MARGIN_BYTES minus
    kt-kernel's copy of the routed experts among `specs`, of its first `kt_layers` of the `n_moe_layers` layers
    (None: all; memory/host_plan.py plans the same order)."""
    experts = sum(s.nbytes for s in specs if s.group == "routed_experts")
    layer = experts // n_moe_layers if n_moe_layers else 0
    return max(0, host_snapshot().free_bytes - HOST_MARGIN_BYTES - kt_layers_copy_bytes(experts, layer, kt_layers))


def kt_layers(bank: ExpertBank, layers: list[int], room_bytes: int) -> list[int]:
    """The MoE layers whose kt-kernel copy (KT_COPY_FACTOR x the packed bytes) fits `room_bytes` of host RAM,
    in order; the others stay on the offload path."""
    layer_bytes = int(bank.expert_bytes * bank.n_experts * KT_COPY_FACTOR)
    return layers[: max(0, room_bytes // layer_bytes)]


def attach_cpu_experts(
    model: Transformer,
    cache: ExpertSlotCache,
    device: torch.device,
    room_bytes: int | None = None,
    max_layers: int | None = None,
) -> HybridExperts:
    """--moe-backend hybrid: hand the bank's experts to kt-kernel once (as many layers as host RAM holds
    beside the bank: `room_bytes`, else MemAvailable minus HOST_MARGIN_BYTES; at most `max_layers`, the count the
    decode projection prefers: memory/decode_choice.best_kt_layers), check its output against the torch reference
    (kt_check.py; ValueError when off), measure the split's costs, and let every MoE layer compute its CPU misses
    there."""
    from dsv4serve.experts.kt_calibrate import measure_split_costs
    from dsv4serve.experts.kt_check import verify_kt
    from dsv4serve.experts.kt_experts import KtExperts

    a = model.args
    geometry = KtGeometry(a.n_routed_experts, a.n_activated_experts, a.dim, a.moe_inter_dim, a.swiglu_limit)
    if room_bytes is None:
        room_bytes = max(0, host_snapshot().free_bytes - HOST_MARGIN_BYTES)
    layers = kt_layers(cache.bank, cache.layers, room_bytes)[:max_layers]
    if not layers:
        raise ValueError("--moe-backend hybrid: host memory holds no MoE layer's kt-kernel copy beside the bank")
    parts = _LayerParts(cache.bank, layers)
    kt = KtExperts(parts, geometry, kt_threads())
    err = verify_kt(kt, layers[0], parts[layers[0]], a.swiglu_limit)  # ValueError: this build computes wrong
    costs = measure_split_costs(kt, device)
    hybrid = HybridExperts(kt, cache, costs)
    for m in moe_layers(model):
        m.cpu_experts = hybrid
    log.info(
        "hybrid MoE: %s (%d of %d offloaded layers, the rest offload only; checked against the torch reference: "
        "relative error %.2g); measured: %s",
        kt.describe,
        len(layers),
        len(cache.layers),
        err,
        costs.describe(cache.bank.expert_bytes),
    )
    return hybrid


HYBRID_EAGER = (
    "off (--moe-backend hybrid with --speculative-tokens: the verify steps' MoE layers sync with the CPU experts)"
)


def cpu_experts_of(model: Transformer) -> HybridExperts | None:
    """The model's hybrid CPU experts (--moe-backend hybrid), else None."""
    found = {id(m.cpu_experts): m.cpu_experts for m in moe_layers(model) if m.cpu_experts is not None}
    return next(iter(found.values()), None)  # type: ignore[return-value]


def expert_bank_line(cache: ExpertSlotCache, hybrid: HybridExperts | None) -> str:
    """The ready report's expert line: where the bank lives, and with hybrid what computes the misses."""
    line = cache.bank.report.describe()
    return line if hybrid is None else f"{line}; misses: {hybrid.describe()}"
