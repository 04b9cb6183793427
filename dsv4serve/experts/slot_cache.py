"""The expert-slot cache: S device slots holding the hottest routed experts of every MoE layer; the FP4
kernel reads the rest in place from the host bank, so a step never waits for an expert copy.

    cache = ExpertSlotCache(bank, n_slots, device, first_layer)
    cache.kernel_sources(layer, ids)     the Triton path: slots, slot map, bank tensors, usage row
    cache.layer_experts(layer, experts)  the torch path (the oracle): each expert's packed parts
    cache.begin_step()                   a step boundary (else the step's first MoE layer is one)

State, on the device: the slots stacked per part (`w1` int8 [S, I, D/2], `w1_scale` uint8 [S, I, D/32],
... as the bank stacks a layer), `slot_of_expert` int32 [L, E] (-1: not in a slot; L = the MoE layers
in `layers` order) and `usage` int64 [L, E + 2] (cumulative: steps that routed to each expert, in column E
the layer's hits, in column E + 1 its uses computed on the CPU by kt-kernel under --moe-backend hybrid; the
FP4 path's moe_align adds to the first E + 1 in its own launch). The kernel's
second weight source is the layer's bank tensors (kernels/dsv4_kernels/fp4_moe.py): on CUDA pinned host
memory read through unified virtual addressing, so a step has no host sync, no copy issued by the
host, and stays capturable in a CUDA graph.

Residency changes only between steps (`begin_step`): the usage counters reach the host late and
without a wait (transfers.LaggedCounts); their growth feeds decayed-frequency scores
(residency.py), which pick the experts to promote; a side stream copies them into their slots behind
the compute already queued, then the slot map (transfers.SlotCopier), and the compute stream waits
on that one event before the step's first MoE layer. On the CPU the same logic runs synchronously.
A fresh cache fills every slot at once, the layers of the costliest misses first and an equal share each
among layers of one cost (residency.initial_keys).

A step with many routes per expert (a prefill chunk) takes its misses another way: each layer's experts are
copied into device memory a range at a time, overlapped with the previous range's GEMMs (prefill_stream.py),
when the cache was made with a `stream_group`: 2 x that many slot rows past the n_slots of the cache.

A layer whose bank tensors the device cannot read in place (pageable or mapped on CUDA, mapped on the
CPU) takes the staging path (staging.py), the one host sync, counted; in a decode graph the capture is cut there
and the staging runs between the segments (graph_cuts.py).

Stats (ExpertCacheStats; the worker exports the first six): `queries` the (step, layer, expert)
uses, `hits` those read from a slot, and `cpu_uses` those kt-kernel computed (hybrid), all from the usage
counters, so on CUDA a step or two late;
`h2d_bytes` expert bytes copied host -> device (promotions; streamed layers; the torch path's bank reads on CUDA), not
the zero-copy reads of the bank by the kernel ((queries - hits) x expert_bytes at most); `stalls` the
waits: step boundaries whose promotion copies were still running when the compute reached them (CPU:
every boundary with copies, which run synchronously) plus every staging-path sync; `prefetches` the
experts promoted into slots ahead of the steps that use them; `evictions` promotions that replaced
an expert. The initial fill at load is not counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dsv4serve.experts import graph_cuts
from dsv4serve.experts.bank import ExpertBank
from dsv4serve.experts.prefill_stream import BUFFERS, Ahead, ExpertStream, StreamedLayer, streams
from dsv4serve.experts.residency import PromotionPolicy, decayed, initial_keys, plan_promotions
from dsv4serve.experts.staging import LayerStaging
from dsv4serve.experts.transfers import LaggedCounts, Parts, SlotCopier
from dsv4serve.memory.decode_speed import miss_cost_weights

PART_ORDER = ("w1", "w1_scale", "w3", "w3_scale", "w2", "w2_scale")  # the FP4 kernel's argument order


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@dataclass
class ExpertCacheStats:
    queries: int = 0
    hits: int = 0
    h2d_bytes: int = 0
    stalls: int = 0
    prefetches: int = 0
    evictions: int = 0
    cpu_uses: int = 0  # uses kt-kernel computed on the CPU (--moe-backend hybrid)
    staged_layers: int = 0  # staging-path syncs (each also a stall)
    staged_bytes: int = 0  # expert bytes copied on the host into the staging area
    streamed_layers: int = 0  # layers whose experts a step streamed into device memory (prefill_stream.py)

    def stats_fields(self) -> dict[str, int]:
        """The fields of ipc.messages.Stats these counters fill."""
        return {
            "expert_cache_queries_total": self.queries,
            "expert_cache_hits_total": self.hits,
            "expert_cache_cpu_uses_total": self.cpu_uses,
            "expert_cache_h2d_bytes_total": self.h2d_bytes,
            "expert_cache_stalls_total": self.stalls,
            "expert_cache_prefetches_total": self.prefetches,
        }


@dataclass(frozen=True)
class KernelSources:
    """What the FP4 kernel reads for one layer: tensors in PART_ORDER."""

    bank: tuple[torch.Tensor, ...]  # [E, ...]: experts outside the slots (pinned bank or staging area)
    slots: tuple[torch.Tensor, ...]  # [S, ...]
    slot_of_expert: torch.Tensor  # [E] int32 on the device
    usage: torch.Tensor  # [E + 1] int64 on the device: the layer's usage row
    stream: StreamedLayer | None = None  # the step's experts streamed into device memory a range at a time


class ExpertSlotCache:
    def __init__(
        self,
        bank: ExpertBank,
        n_slots: int,
        device: torch.device,
        first_layer: int | None = None,
        policy: PromotionPolicy | None = None,
        miss_weights: dict[str, float] | None = None,
        stream_group: int = 0,
    ):
        """`miss_weights`: tier -> a miss's cost relative to a pinned one (residency.py; default
        decode_speed.miss_cost_weights at its assumed bandwidths); `stream_group` > 0: prefill chunks stream their
        experts in ranges of that many (prefill_stream.py), in 2 x `stream_group` more slot rows."""
        if n_slots < 1:
            raise ValueError(f"an expert-slot cache needs at least one slot, got {n_slots}")
        self.bank, self.n_slots, self.device = bank, n_slots, device
        self.policy = policy or PromotionPolicy()
        self.layers = sorted([*bank.layers, *bank.mapped])
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        self._first_layer = self.layers[0] if first_layer is None else first_layer
        n_rows, n_experts = len(self.layers), bank.n_experts
        rows = n_slots + BUFFERS * stream_group
        self.slots = {
            part: torch.empty((rows, *shape), dtype=dtype, device=device)
            for part, (shape, dtype) in bank.part_shapes.items()
        }  # part -> [S (+ the stream's rows), ...]
        self.stream = (
            ExpertStream(self.slots, n_slots, stream_group, n_experts, device, self._count_streamed)
            if stream_group
            else None
        )
        self.slot_of_expert = torch.full((n_rows, n_experts), -1, dtype=torch.int32, device=device)
        self.usage = torch.zeros((n_rows, n_experts + 2), dtype=torch.int64, device=device)
        self._map_host = torch.full((n_rows, n_experts), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._slot_keys = torch.full((n_slots,), -1, dtype=torch.int64)  # flat key row * E + expert
        self._scores = torch.zeros(n_rows * n_experts, dtype=torch.float64)
        self.stats = ExpertCacheStats()
        self._counts = LaggedCounts(self.usage)
        self._copier = SlotCopier(self.slots, device, self.policy.max_per_step)
        self._staging = LayerStaging(bank, device)
        self._begun = False
        self._epoch = 0  # step boundaries so far
        self.row_tiers = [self._tier(layer) for layer in self.layers]
        weights = miss_weights or miss_cost_weights()
        row_weights = [weights[t] for t in self.row_tiers]
        self._key_weights = torch.tensor(row_weights, dtype=torch.float64).repeat_interleave(n_experts)
        self._fill(initial_keys(n_slots, n_rows, n_experts, row_weights))

    @property
    def resident(self) -> dict[tuple[int, int], int]:
        """(layer, expert) -> slot, by slot."""
        e = self.bank.n_experts
        return {(self.layers[k // e], k % e): s for s, k in enumerate(self._slot_keys.tolist()) if k >= 0}

    def _tier(self, layer: int) -> str:
        """Where the bank holds `layer`, as a miss pays it: pinned (read in place; on the CPU any RAM), pageable
        (staged by the host) or disk (the mapped shards)."""
        if layer in self.bank.mapped:
            return "disk"
        return "pinned" if self.bank.device_readable(layer, self.device) else "pageable"

    @property
    def staged_layers(self) -> list[int]:
        """The MoE layers whose bank tensors the device cannot read in place (kernel_sources' staging path):
        a step through one of them makes the host wait for its routing, so it cannot be a CUDA graph."""
        return [layer for layer, tier in zip(self.layers, self.row_tiers) if tier != "pinned"]

    # ------------------------------------------------------------------ what the MoE layer calls

    def _count_streamed(self, n_experts: int) -> None:
        """The prefill stream queued n experts' copies: each crosses PCIe once (prefill_stream.ExpertStream.on_copy)."""
        self.stats.h2d_bytes += n_experts * self.bank.expert_bytes

    def streams(self, num_routes: int) -> bool:
        """Whether a step of `num_routes` routes a layer streams its experts (prefill_stream.py) in kernel_sources."""
        return self.stream is not None and streams(num_routes, self.bank.n_experts) and not _capturing(self.device)

    def kernel_sources(self, layer: int, ids: torch.Tensor, stream: bool = True) -> KernelSources:
        """The FP4 kernel's weight sources for `layer`, whose routing is ids [T, k] (read only on the
        staging path); `stream` False: no streaming whatever the step (hybrid's CPU takes the layer's misses)."""
        self._enter(layer)
        row = self._row[layer]
        if self.bank.device_readable(layer, self.device):
            bank = self.bank.layers[layer]
        else:

            def stage() -> None:  # the host's part: now, or between two segments of a cut graph (graph_cuts.py)
                self._staging.layer_parts(layer, ids, self._map_host[row] >= 0)
                self.stats.stalls += 1
                self.stats.staged_layers += 1
                self.stats.staged_bytes = self._staging.staged_bytes

            if not graph_cuts.cut(stage):
                stage()
            bank = self._staging.area()
        streamed = None
        if stream and self.streams(ids.numel()):
            assert self.stream is not None
            in_slot, key = self._map_host[row] >= 0, (layer, self._epoch)
            streamed = self.stream.layer(bank, self.slot_of_expert[row], in_slot, key, self._ahead(row))
            self.stats.streamed_layers += 1
        return KernelSources(
            tuple(bank[p] for p in PART_ORDER),
            tuple(self.slots[p] for p in PART_ORDER),
            self.slot_of_expert[row],
            self.usage_row(layer),
            streamed,
        )

    def _ahead(self, row: int) -> Ahead | None:
        """The next MoE layer, when pinned: its first streamed ranges are copied ahead (prefill_stream.py)."""
        if row + 1 >= len(self.layers) or self.row_tiers[row + 1] != "pinned":
            return None
        layer = self.layers[row + 1]
        return Ahead((layer, self._epoch), self.bank.layers[layer], self._map_host[row + 1] >= 0)

    def layer_experts(self, layer: int, experts: list[int]) -> Iterator[tuple[int, Parts]]:
        """(expert, its packed parts) for each of `experts` (ascending): a slot's, else the bank's (on
        CUDA copied to the device). Records the uses as the kernel's moe_align does."""
        self._enter(layer)
        row = self._row[layer]
        slot_of = self._map_host[row]
        used = torch.tensor(experts, dtype=torch.long)
        self.usage[row, used.to(self.usage.device)] += 1
        self.usage[row, self.bank.n_experts] += int((slot_of[used] >= 0).sum())
        for e in experts:
            slot = int(slot_of[e])
            if slot >= 0:
                yield e, {part: t[slot] for part, t in self.slots.items()}
                continue
            parts = self.bank.expert(layer, e)
            if self.device.type != "cpu":
                parts = {part: t.to(self.device) for part, t in parts.items()}
                self.stats.h2d_bytes += self.bank.expert_bytes
            yield e, parts

    def miss_weight(self, layer: int) -> float:
        """What a miss in `layer` costs the residency policy, in pinned fetches (residency.py)."""
        return float(self._key_weights[self._row[layer] * self.bank.n_experts])

    def weigh_layers(self, weights: dict[int, float]) -> None:
        """Set the miss weights of some layers (hybrid: kt-kernel's, whose misses split with the CPU); promotions
        from the next boundary on follow them (the slots filled at load stay until they do)."""
        e = self.bank.n_experts
        for layer, w in weights.items():
            row = self._row[layer]
            self._key_weights[row * e : (row + 1) * e] = w

    def host_slot_map(self, layer: int) -> torch.Tensor:
        """`layer`'s slot of each expert [E] int32 on the host (-1: not in a slot), as the next step reads it
        (the hybrid split, experts/hybrid.py)."""
        return self._map_host[self._row[layer]]

    def host_slot_maps(self, layers: list[int]) -> torch.Tensor:
        """`host_slot_map` of each of `layers`, stacked [L, E] (a copy)."""
        return self._map_host[[self._row[layer] for layer in layers]]

    def expert_scores(self, layer: int) -> torch.Tensor:
        """`layer`'s experts' decayed-frequency scores [E] float64 on the host (residency.py), as of the last
        boundary: the hybrid graph split's use rates (experts/hybrid_graph.py)."""
        e = self.bank.n_experts
        row = self._row[layer]
        return self._scores[row * e : (row + 1) * e]

    def usage_row(self, layer: int) -> torch.Tensor:
        """`layer`'s usage counters [E + 1] int64 on the device (uses and hits: the module doc), a view: the
        device path's uses add here."""
        return self.usage[self._row[layer], : self.bank.n_experts + 1]

    def uncount_stand_in(self, layer: int, expert: torch.Tensor, fake: torch.Tensor) -> None:
        """Take back the use (and the hit, if `expert` is in a slot) the MXFP4 path's moe_align records for a
        stand-in: hybrid gives a route the CPU computes weight 0 and a slot expert's id, which counts as that
        expert's use unless a real route used it too (`fake` False). expert int64 and fake bool, 0-d tensors on
        the device (a graph can hold it); hit rates in /metrics stay the routing's."""
        row = self._row[layer]
        usage, n = self.usage[row], self.bank.n_experts
        take = fake.to(usage.dtype).view(1)
        usage.index_add_(0, expert.view(1), -take)
        in_slot = (self.slot_of_expert[row].index_select(0, expert.view(1)) >= 0).to(usage.dtype)
        usage.narrow(0, n, 1).sub_(take * in_slot)

    def record_cpu_uses(self, layer: int, experts: list[int]) -> None:
        """Count uses of `experts` computed outside the device path (kt-kernel, --moe-backend hybrid): uses,
        not hits, so the residency scores still see them and promote the hot ones; and CPU uses."""
        used = torch.zeros(self.bank.n_experts, dtype=torch.bool, device=self.usage.device)
        used[torch.tensor(experts, dtype=torch.long, device=self.usage.device)] = True
        self.record_cpu_mask(layer, used)

    def record_cpu_mask(self, layer: int, used: torch.Tensor) -> None:
        """`record_cpu_uses` on the device: used bool [E], the experts of the step the CPU computed (a graph
        can hold it: two launches, no host value)."""
        usage, n = self.usage[self._row[layer]], self.bank.n_experts
        usage[:n] += used.to(usage.dtype)
        usage[n + 1] += used.sum()

    # ------------------------------------------------------------------ step boundaries

    def begin_step(self) -> None:
        """A step boundary: collect the usage counts that have arrived, promote, and order the compute
        after the copies. Call it before a step (outside a captured CUDA graph); without the call the
        step's first MoE layer (`first_layer`) runs it."""
        self._boundary()
        self._begun = True

    def end_step(self) -> None:
        """The step began with `begin_step` ran without the layers' Python hooks (a CUDA graph's replay): the
        next eager step's first MoE layer is a boundary again."""
        self._begun = False

    @contextlib.contextmanager
    def detached(self) -> Iterator[None]:
        """Run layers through the cache without a step: no boundary, and the usage counters and stats as they were
        afterwards (a start-up check's forwards are no requests' uses)."""
        usage, stats, begun = self.usage.clone(), dataclasses.replace(self.stats), self._begun
        self._begun = True
        try:
            yield
        finally:
            self.usage.copy_(usage)
            self.stats, self._begun = stats, begun

    def collect_usage(self) -> None:
        """Fold the usage counts that have arrived into the stats and scores (no promotion, no wait)."""
        grown = self._counts.collect()
        if grown is not None:
            self._account(grown)

    def _enter(self, layer: int) -> None:
        if layer != self._first_layer:
            return
        if self._begun:
            self._begun = False
        else:
            self._boundary()

    def _boundary(self) -> None:
        self._epoch += 1  # the slots may change here: ranges copied ahead before it are stale
        self.collect_usage()
        if self._copier.idle():
            plan = plan_promotions(self._scores, self._slot_keys, self.policy, self._key_weights)
            if plan:
                self._promote(plan)
        if self._copier.compute_waits():
            self.stats.stalls += 1

    def _account(self, grown: torch.Tensor) -> None:
        n = self.bank.n_experts
        used = grown[:, :n]  # [L, E] steps that routed to each expert
        self.stats.queries += int(used.sum())
        self.stats.hits += int(grown[:, n].sum())
        self.stats.cpu_uses += int(grown[:, n + 1].sum())
        self._scores = decayed(self._scores, used.flatten(), self.policy)

    def _promote(self, plan) -> None:
        e = self.bank.n_experts
        copies = []
        for p in plan:
            if p.evicted >= 0:
                self._map_host.view(-1)[p.evicted] = -1
                self.stats.evictions += 1
            self._map_host.view(-1)[p.key] = p.slot
            self._slot_keys[p.slot] = p.key
            layer = self.layers[p.key // e]
            copies.append((p.slot, self.bank.expert(layer, p.key % e), layer in self.bank.pinned))
        self._copier.issue(copies, self._map_host, self.slot_of_expert)
        self.stats.prefetches += len(plan)
        self.stats.h2d_bytes += len(plan) * self.bank.expert_bytes
        if self.device.type != "cuda":
            self.stats.stalls += 1  # the copies ran synchronously

    def _fill(self, keys: list[int]) -> None:
        """Load `keys` into slots 0.. synchronously (at construction; not counted)."""
        e = self.bank.n_experts
        for slot, key in enumerate(keys):
            src = self.bank.expert(self.layers[key // e], key % e)
            for part, t in self.slots.items():
                t[slot].copy_(src[part])
            self._map_host.view(-1)[key] = slot
            self._slot_keys[slot] = key
        self.slot_of_expert.copy_(self._map_host)
