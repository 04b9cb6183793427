"""Wiring the expert bank and slot cache into a model (called by the worker's engine setup).

    cache = attach_expert_cache(model, ckpt, slots, device)   # None: every expert stays resident
    weights = iter_dense(ckpt) if cache is None else iter_resident_dense(ckpt)
    model.load_state_dict(dict(weights), strict=True)

`slots` is the memory plan's `expert_slots` (or --moe-cache-size); a count that covers every routed
expert of the model means "all resident" and nothing changes. Otherwise the bank is read packed from
the shards (pinned within the measured budget), every MoE layer gets the cache, and the routed
experts are left out of the dense state dict (`iter_resident_dense` never dequantizes them).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import torch
from tqdm import tqdm

from dsv4serve.checkpoint.loader import Checkpoint, iter_dense
from dsv4serve.experts.bank import bank_bytes, check_bankable, expert_specs, load_expert_bank
from dsv4serve.experts.pinning import PinBudget, measure_pin_budget
from dsv4serve.experts.slot_cache import ExpertSlotCache
from dsv4serve.memory.host_plan import HOST_MARGIN_BYTES
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
) -> ExpertSlotCache | None:
    """Offload the routed experts to a host bank behind `slots` device slots, or None when `slots`
    is None or covers every routed expert. `pin`: a budget measured already (else measured here);
    `ram_bytes`: host RAM the bank may fill (else MemAvailable minus HOST_MARGIN_BYTES)."""
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
    cache = ExpertSlotCache(bank, slots, device, first_layer=moes[0].layer_id)  # a step starts at layer 0
    for m in moes:
        m.use_expert_cache(cache)
    log.info(
        "expert-slot cache: %d slots x %.2f MiB on %s for %d routed experts",
        slots,
        bank.expert_bytes / 2**20,
        device,
        total,
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
