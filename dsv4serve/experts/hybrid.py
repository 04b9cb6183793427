"""--moe-backend hybrid: per MoE layer and step, the routed experts in device slots run on the device path,
the misses the split sends to the CPU (miss_split.py) are computed by kt-kernel from host memory, and
the two partial sums are added (dsv4serve/model/moe.py, `MoE.forward`).

    hybrid = HybridExperts(kt, cache, costs)
    job = hybrid.submit(layer, xq, ids, weights)    # None: nothing for the CPU this time
    ...the device path on job.device_routes(ids, weights) or without job.cpu_experts...
    part = job.wait(device)                          # [T, D] bf16 values, fp32 on the device: added to the
                                                     # device's sum before the shared expert (moe_combine)

The slot cache still decides residency: the experts computed on the CPU are counted as uses (not
hits), so the hot ones get promoted into slots. A step with this split syncs the host once per layer (the
routing must reach kt-kernel): prefill chunks and mixed steps. A step whose experts the cache streams
(prefill_stream.py: a chunk) fetches every miss, the stream copying the whole layer anyway, except in a layer left
on disk, whose misses kt-kernel computes from its own copy (and then the layer is not streamed: moe.py). Decode
steps replayed as CUDA graphs take `graph` instead (hybrid_graph.py: a CPU set per layer fixed between steps, no
sync), inside `graph.steps()`; `stats` counts the eager split's work only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv4serve.experts.hybrid_graph import GraphJob, GraphSplit, decode_cpu_share
from dsv4serve.experts.kt_experts import KtExperts, KtJob
from dsv4serve.experts.miss_split import SplitCosts, held_miss_weight, split_misses
from dsv4serve.experts.slot_cache import ExpertSlotCache


@dataclass
class HybridStats:
    cpu_experts: int = 0  # (layer, expert) computations kt-kernel ran
    fetched_misses: int = 0  # misses the split left to the device path (fetched or read in place)
    layer_steps: int = 0  # (layer, step) routings the split saw
    routed_experts: int = 0  # distinct experts those routings used (hits + misses)


class HybridJob:
    def __init__(
        self, kt_job: KtJob, cpu_experts: list[int], on_device: torch.Tensor, stand_in: int, uncount: Callable[[], None]
    ):
        self._kt_job, self.cpu_experts = kt_job, frozenset(cpu_experts)
        self._on_device, self._stand_in, self._uncount = on_device, stand_in, uncount

    def device_routes(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing for a device path that takes every route (the grouped kernel): a route to an
        expert kt-kernel computes gets weight 0 and a stand-in expert in a slot (its output is then an
        exact 0, and nothing is read over PCIe for it); the stand-in's counted use is taken back where no
        real route used it (slot_cache.uncount_stand_in)."""
        on_device = self._on_device.to(ids.device)[ids]  # [T, k] bool
        self._uncount()
        return torch.where(on_device, ids, self._stand_in), torch.where(on_device, weights, 0.0)

    def wait(self, device: torch.device) -> torch.Tensor:
        """The CPU experts' weighted sum [T, D] fp32 on `device`."""
        return self._kt_job.wait().to(device).float()


class HybridExperts:
    def __init__(self, kt: KtExperts, cache: ExpertSlotCache, costs: SplitCosts):
        self.kt, self.cache, self.costs = kt, cache, costs
        self.stats = HybridStats()
        # a miss in a layer kt-kernel holds splits with the CPU: it costs the slot cache less (residency.py)
        held = {layer: cache.miss_weight(layer) for layer in cache.layers if kt.holds(layer)}
        weights = {layer: held_miss_weight(w, costs, cache.bank.expert_bytes) for layer, w in held.items()}
        cache.weigh_layers({layer: w for layer, w in weights.items() if w is not None})
        eb = cache.bank.expert_bytes
        tiers = dict(zip(cache.layers, cache.row_tiers))  # a staged layer's misses cost more to fetch
        shares = {layer: decode_cpu_share(costs, eb, tier) for layer, tier in tiers.items() if tier != "pinned"}
        self.graph = GraphSplit(kt, cache, decode_cpu_share(costs, eb), cache.device, shares)

    def describe(self) -> str:
        """For the start-up report: kt-kernel's build and threads, the layers it holds, the measured costs, and
        the CPU's share of a decode graph step's misses that follows from them."""
        bank = self.cache.bank
        staged = sum(share != self.graph.cpu_share for share in self.graph.shares)
        return (
            f"{self.kt.describe}; measured {self.costs.describe(bank.expert_bytes)}; decode graph steps: "
            f"{100 * self.graph.cpu_share:.0f}% of each layer's expected misses on the CPU"
            + (f" ({staged} unpinned layers more: their fetches are staged)" if staged else "")
        )

    def submit(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> HybridJob | GraphJob | None:
        """Start kt-kernel on `layer`'s misses that the split gives the CPU: x [T, D] (the experts' input,
        already through act_quant), ids [T, k], weights [T, k] fp32. None when it gives it none."""
        if not self.kt.holds(layer):  # host RAM held no kt-kernel copy of it: offload only
            return None
        if self.graph.active:  # a decode graph's step: the CPU set fixed before it, no sync
            return self.graph.submit(layer, x, ids, weights)
        bank = self.cache.bank
        if self.cache.streams(ids.numel()) and layer not in bank.mapped:
            return None  # a prefill chunk streams every expert of the layer anyway (prefill_stream.py): all fetched
        slot_of = self.cache.host_slot_map(layer)  # [E] int32, -1: not in a slot
        ids_host = ids.to("cpu")  # the one host sync of the layer
        counts = torch.bincount(ids_host.flatten(), minlength=bank.n_experts)
        misses = {e: int(counts[e]) for e in torch.nonzero((counts > 0) & (slot_of < 0)).flatten().tolist()}
        self.stats.layer_steps += 1
        self.stats.routed_experts += int((counts > 0).sum())
        cpu = sorted(split_misses(misses, bank.expert_bytes, layer in bank.pinned, self.costs, layer in bank.mapped))
        self.stats.fetched_misses += len(misses) - len(cpu)
        if not cpu:
            return None
        on_device = torch.ones(bank.n_experts, dtype=torch.bool)
        on_device[cpu] = False
        kt_job = self.kt.submit(layer, x, ids_host, weights, on_device)
        self.cache.record_cpu_uses(layer, cpu)
        self.stats.cpu_experts += len(cpu)
        in_slots = torch.nonzero(slot_of >= 0).flatten()
        stand_in = int(in_slots[0]) if len(in_slots) else cpu[0]  # weight 0 either way
        fake = not bool((ids_host[on_device[ids_host]] == stand_in).any())  # no real route counts it already
        dev = self.cache.usage.device

        def uncount() -> None:
            stand = torch.tensor(stand_in, device=dev)
            self.cache.uncount_stand_in(layer, stand, torch.tensor(fake, device=dev))

        return HybridJob(kt_job, cpu, on_device, stand_in, uncount)
