"""The GPU expert-slot cache: N slots, each holding one routed expert (of any layer), packed MXFP4.

    cache.layer_experts(layer, experts, token_ids) -> iterator of (expert, slot parts)

A mapping (layer, expert) -> slot with LRU replacement. A miss copies the expert's packed bytes from
the host bank into a slot; on CUDA the copy runs on a side stream and records an event that the
compute stream waits on before the slot is read (before overwriting a slot the side stream waits
for the compute work already queued, which includes the slot's previous reader). On CPU the "device"
is host memory and copies are synchronous: the same mapping, eviction and accounting run in tests.

While a multi-token forward (prefill) computes layer l, the experts layer l+1 will probably need are
prefetched into spare slots (double buffering): exactly for a hash-routed layer (its tid2eid table
and the token ids decide), otherwise the set that layer used last time. A prefetch only takes slots
beyond what layer l needs and never evicts an expert layer l still needs.

The slots are stacked per part (`w1` int8 [S, I, D/2], `w1_scale` uint8 [S, I, D/32], ...): on CUDA,
kernels/dsv4_kernels/fp4_moe.py can consume them as its [E, ...] expert tensors with routed ids
mapped to slot ids; the CPU reference path dequantizes one lent slot at a time (model/moe.py).

Counted: queries and hits (lookups by the compute), bytes moved host->device, stalls (CUDA: the
compute had to wait for a copy not yet finished; CPU: a miss served synchronously), prefetches and
evictions.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from dsv4serve.experts.bank import ExpertBank

Key = tuple[int, int]  # (layer, expert)


class HashRouter(Protocol):
    tid2eid: torch.Tensor  # [vocab, k] int64


@dataclass
class ExpertCacheStats:
    queries: int = 0
    hits: int = 0
    h2d_bytes: int = 0
    stalls: int = 0
    prefetches: int = 0
    evictions: int = 0

    def stats_fields(self) -> dict[str, int]:
        """The fields of ipc.messages.Stats these counters fill."""
        return {
            "expert_cache_queries_total": self.queries,
            "expert_cache_hits_total": self.hits,
            "expert_cache_h2d_bytes_total": self.h2d_bytes,
            "expert_cache_stalls_total": self.stalls,
            "expert_cache_prefetches_total": self.prefetches,
        }


class ExpertSlotCache:
    def __init__(
        self,
        bank: ExpertBank,
        n_slots: int,
        device: torch.device,
        next_layer: dict[int, int] | None = None,
        hash_routers: dict[int, HashRouter] | None = None,
    ):
        if n_slots < 1:
            raise ValueError(f"an expert-slot cache needs at least one slot, got {n_slots}")
        self.bank, self.n_slots, self.device = bank, n_slots, device
        self.slots = {
            part: torch.empty((n_slots, *shape), dtype=dtype, device=device)
            for part, (shape, dtype) in bank.part_shapes.items()
        }  # part -> [S, ...]
        self.stats = ExpertCacheStats()
        self._lru: OrderedDict[Key, int] = OrderedDict()  # oldest first
        self._free = list(range(n_slots - 1, -1, -1))
        self._next_layer = next_layer or {}
        self._hash_routers = hash_routers or {}
        self._last_used: dict[int, list[int]] = {}
        self._cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if self._cuda else None
        self._ready: dict[int, torch.cuda.Event] = {}  # slot -> its copy's completion

    @property
    def resident(self) -> dict[Key, int]:
        """(layer, expert) -> slot, oldest use first."""
        return dict(self._lru)

    # ------------------------------------------------------------------ what the MoE layer calls

    def layer_experts(
        self, layer: int, experts: list[int], token_ids: torch.Tensor
    ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """(expert, its slot's packed parts) for each of `experts`, resident ones first, then misses.

        Each yielded slot stays valid until the next item is requested. With more than one token the
        next layer's likely experts are prefetched first, into slots this layer does not need.
        """
        pending = {(layer, e) for e in experts}
        nxt = self._next_layer.get(layer)
        if token_ids.numel() > 1 and nxt is not None:
            self._prefetch(nxt, self._predict(nxt, token_ids), pending)
        self._last_used[layer] = list(experts)
        for e in sorted(experts, key=lambda e: ((layer, e) not in self._lru, e)):
            pending.discard((layer, e))
            slot = self._demand((layer, e), pending)
            yield e, {part: t[slot] for part, t in self.slots.items()}

    # ------------------------------------------------------------------ mapping and replacement

    def _demand(self, key: Key, pending: set[Key]) -> int:
        self.stats.queries += 1
        slot = self._lru.get(key)
        if slot is not None:
            self.stats.hits += 1
            self._lru.move_to_end(key)
        else:
            # rather an expert this layer needs later (it is fetched again) than no slot at all
            slot = self._take_slot(pending)
            slot = self._take_slot(set()) if slot is None else slot
            assert slot is not None  # n_slots >= 1 and `key` holds none of them
            self._load(key, slot)
            if not self._cuda:
                self.stats.stalls += 1  # the CPU serves a miss synchronously
        self._wait_ready(slot)
        return slot

    def _predict(self, layer: int, token_ids: torch.Tensor) -> list[int]:
        router = self._hash_routers.get(layer)
        if router is not None:
            return sorted(set(router.tid2eid[token_ids.long()].flatten().tolist()))
        return self._last_used.get(layer, [])

    def _prefetch(self, layer: int, experts: list[int], current: set[Key]) -> None:
        """Copy `experts` of `layer` ahead into the slots the current layer's `current` set leaves."""
        spare = self.n_slots - len(current)
        keep = set(current)
        for key in [(layer, e) for e in experts if (layer, e) not in self._lru][: max(spare, 0)]:
            slot = self._take_slot(keep)
            if slot is None:
                return
            self._load(key, slot)
            keep.add(key)
            self.stats.prefetches += 1

    def _take_slot(self, keep: set[Key]) -> int | None:
        """A free slot, else the least recently used one whose expert is not in `keep`."""
        if self._free:
            return self._free.pop()
        victim = next((k for k in self._lru if k not in keep), None)
        if victim is None:
            return None
        self.stats.evictions += 1
        return self._lru.pop(victim)

    # ------------------------------------------------------------------ copies

    def _load(self, key: Key, slot: int) -> None:
        src = self.bank.expert(*key)
        if self._copy_stream is None:
            for part, t in self.slots.items():
                t[slot].copy_(src[part])
        else:
            # the slot's previous reader is queued on the compute stream: copy after it
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                for part, t in self.slots.items():
                    t[slot].copy_(src[part], non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._copy_stream)
            self._ready[slot] = done
        self._lru[key] = slot
        self.stats.h2d_bytes += self.bank.expert_bytes

    def _wait_ready(self, slot: int) -> None:
        done = self._ready.pop(slot, None)
        if done is None:
            return
        if not done.query():
            self.stats.stalls += 1
        torch.cuda.current_stream(self.device).wait_event(done)
