"""--moe-backend hybrid inside a decode step replayed as a CUDA graph: the CPU's share of each layer's misses is
fixed between steps, so the step itself needs no host sync (hybrid.py's split reads each layer's routing on the
host, which only an eager step can do: prefill chunks and mixed steps keep it).

    split = GraphSplit(kt, cache, cpu_share, device)
    split.begin_step()                       # host, before each decode step: each layer's CPU set, its masks
    job = split.submit(layer, x, ids, w)     # device copies and stream-queued CPU work; a HybridJob's interface

A layer's CPU set: its experts outside the device slots, coldest first by the slot cache's decayed-frequency
scores, until their expected share of the layer's misses (scores as use rates, an unseen expert counted as the
mean) reaches its share: the decode split at one token per expert (`decode_cpu_share`), where the copy of an
expert and kt-kernel's work on it finish together (a copy from pageable memory takes longer; a layer the bank left
on disk sends all of its misses to the CPU). Routes to the set get weight 0 and a stand-in
slot expert on the device (an exact 0); kt-kernel skips every other expert (its live mask). The device copies
x / ids / weights into pinned buffers, kt-kernel runs on the stream (kt_experts.run_on_stream), the stream
waits for it and copies its sum back: host nodes and copies a graph holds. The CPU's uses are added to the slot
cache's usage counters on the device, as the eager split records them on the host, so residency sees them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from dsv4serve.experts.kt_experts import KtExperts, KtStreamBuffers
from dsv4serve.experts.miss_split import SplitCosts
from dsv4serve.experts.slot_cache import ExpertSlotCache

REFRESH_STEPS = 16  # steps a CPU set is kept while the slot map stands still (the residency scores drift slowly)


def decode_cpu_share(costs: SplitCosts, expert_bytes: int, tier: str = "pinned") -> float:
    """The share of a decode step's misses kt-kernel takes: fetch / (fetch + CPU) at one token per expert (both
    lanes then finish together), the fetch from the layer's `tier` of the bank (pinned, or pageable: staged by the
    host); 1 where nothing can be fetched (the device is the CPU) or a fetch would page in from disk first (as
    miss_split.split_misses sends a disk layer's misses)."""
    fetch = costs.fetch_seconds(expert_bytes, tier == "pinned")
    if fetch is None or tier == "disk":
        return 1.0
    cpu = costs.cpu.seconds(1)
    return fetch / (fetch + cpu)


def cpu_set(free: torch.Tensor, scores: torch.Tensor, share: float) -> torch.Tensor:
    """[E] bool: of the experts `free` (outside the slots), the coldest by `scores` (ties: lower id) whose summed
    expected use stays within `share` of all free experts' (an unseen expert's rate: the mean, or 1)."""
    chosen = torch.zeros_like(free)
    idx = torch.nonzero(free).flatten()
    if not len(idx) or share <= 0:
        return chosen
    if share >= 1:
        chosen[idx] = True
        return chosen
    rate = scores[idx].double()
    seen = rate > 0
    rate = torch.where(seen, rate, rate[seen].mean() if bool(seen.any()) else 1.0)
    ordered, perm = torch.sort(rate, stable=True)  # idx ascends: equal rates keep the lower id first
    within = torch.cumsum(ordered, 0) <= share * float(rate.sum()) * (1 + 1e-12)  # a prefix: rates are >= 0
    chosen[idx[perm[within]]] = True
    return chosen


class GraphJob:
    """A layer's CPU part in a graph step (the interface MoE.forward reads of a HybridJob)."""

    def __init__(self, split: GraphSplit, layer: int, bufs: KtStreamBuffers):
        self._split, self._layer, self._row, self._bufs = split, layer, split.row(layer), bufs

    @property
    def cpu_experts(self) -> frozenset[int]:
        """The layer's CPU set (the torch path's experts to skip; the kernel path reads the device mask)."""
        return self._split.cpu_experts(self._layer)

    def device_routes(self, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As HybridJob's: CPU routes get weight 0 and the stand-in; the stand-in's counted use taken back where
        no real route used it (slot_cache.uncount_stand_in)."""
        split = self._split
        on_device, stand = split.on_device[self._row][ids], split.stand_in[self._row]
        fake = (~on_device).any() & ~((ids == stand) & on_device).any()
        split.cache.uncount_stand_in(self._layer, stand, fake)
        return torch.where(on_device, ids, stand), torch.where(on_device, weights, 0.0)

    def wait(self, device: torch.device) -> torch.Tensor:
        """The CPU experts' weighted sum [T, D] fp32 on `device`, once the stream has waited for kt-kernel."""
        split = self._split
        split.kt.wait_on_stream(device)
        if device.type == "cpu":
            return self._bufs.out.float()
        out = split.device_out(self._bufs.out.shape[0])
        out.copy_(self._bufs.out, non_blocking=True)  # pinned: stream-ordered after the wait
        return out.float()


class GraphSplit:
    def __init__(
        self,
        kt: KtExperts,
        cache: ExpertSlotCache,
        cpu_share: float,
        device: torch.device,
        layer_shares: dict[int, float] | None = None,
    ):
        """`cpu_share`: a layer's, unless `layer_shares` gives its own (a layer the bank does not pin)."""
        self.kt, self.cache, self.cpu_share, self.device = kt, cache, cpu_share, device
        self.layers = [layer for layer in cache.layers if kt.holds(layer)]
        self.shares = [(layer_shares or {}).get(layer, cpu_share) for layer in self.layers]
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        n, e = len(self.layers), cache.bank.n_experts
        pin = device.type == "cuda"
        self._host_mask = torch.ones((n, e), dtype=torch.bool, pin_memory=pin)
        self._host_stand_in = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self.on_device = self._host_mask.to(device) if pin else self._host_mask  # [L, E] bool: not on the CPU
        self.stand_in = self._host_stand_in.to(device) if pin else self._host_stand_in  # [L] a slot expert
        self._free: torch.Tensor | None = None  # the slot map's free experts the CPU sets were chosen from
        self._age = 0  # steps since the CPU sets were chosen
        self._buffers: dict[int, KtStreamBuffers] = {}
        self._device_out: dict[int, torch.Tensor] = {}
        self._copied = torch.cuda.Event() if pin else None  # the masks' last copy: the host rewrites them after it
        self.active = False

    @contextlib.contextmanager
    def steps(self) -> Iterator[None]:
        """MoE layers take this split (not the eager one) inside: a decode graph's capture and its eager form."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def begin_step(self) -> None:
        """Host, between steps (after the slot cache's boundary): each held layer's CPU set, chosen again when its
        slots changed, and every layer's REFRESH_STEPS steps on (the scores drift slowly), written to the device's
        masks stream-ordered before the step; kt-kernel's masks every step (an eager step's split rewrites them)."""
        if self._copied is not None:
            self._copied.synchronize()  # long done after a step; a capture's warm-up may still be reading
        free = self.cache.host_slot_maps(self.layers) < 0  # [L, E]
        if self._free is None or self._age >= REFRESH_STEPS:
            rows, self._age = list(range(len(self.layers))), 0
        else:  # the layers whose slots changed (a promotion touches a few)
            rows, self._age = torch.nonzero((free != self._free).any(1)).flatten().tolist(), self._age + 1
        if rows:
            for i in rows:
                self._host_mask[i] = ~cpu_set(free[i], self.cache.expert_scores(self.layers[i]), self.shares[i])
            in_slot, on_cpu = ~free, ~self._host_mask
            first_cpu = torch.where(on_cpu.any(1), on_cpu.int().argmax(1), 0)
            self._host_stand_in.copy_(torch.where(in_slot.any(1), in_slot.int().argmax(1), first_cpu))
            self._free = free
            if self._copied is not None:
                self.on_device.copy_(self._host_mask, non_blocking=True)
                self.stand_in.copy_(self._host_stand_in, non_blocking=True)
                self._copied.record()
        for i, layer in enumerate(self.layers):
            self.kt.set_mask(layer, self._host_mask[i])

    def set_rows(self, rows: int, used: int) -> None:
        """A `rows`-row step (a decode bucket) of which the first `used` are requests, the rest padding: kt-kernel
        computes only those (it reads the count when its task runs; the padding rows' sums are left stale)."""
        bufs = self._buffers.get(rows)
        if bufs is not None:
            with torch.inference_mode():  # made inside the model's forward: inference tensors
                bufs.n[0] = used

    def holds(self, layer: int) -> bool:
        return layer in self._row

    def row(self, layer: int) -> int:
        return self._row[layer]

    def cpu_experts(self, layer: int) -> frozenset[int]:
        """`layer`'s CPU set for the step `begin_step` prepared."""
        return frozenset(torch.nonzero(~self._host_mask[self._row[layer]]).flatten().tolist())

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> GraphJob:
        """x [T, D] (through act_quant), ids / weights [T, k] on the device: copied to kt-kernel's buffers and its
        forward queued on the stream; the CPU set's uses added to the slot cache's counters."""
        row, rows = self._row[layer], x.shape[0]
        bufs = self._buffers.get(rows)
        if bufs is None:
            bufs = self._buffers[rows] = self.kt.stream_buffers(rows, self.device)
        bufs.x.copy_(x.to(torch.bfloat16), non_blocking=True)
        bufs.ids.copy_(ids.to(torch.int64), non_blocking=True)
        bufs.weights.copy_(weights.to(torch.float32), non_blocking=True)
        self.kt.run_on_stream(self.kt.stream_task(layer, bufs), self.device)
        on_cpu = ~self.on_device[row][ids]  # [T, k]; an expert's routes all agree
        n = self.cache.bank.n_experts
        used = torch.zeros(n, dtype=torch.bool, device=ids.device).scatter_(0, ids.flatten(), on_cpu.flatten())
        self.cache.record_cpu_mask(layer, used)  # one use per expert and step, as moe_align counts
        return GraphJob(self, layer, bufs)

    def device_out(self, rows: int) -> torch.Tensor:
        out = self._device_out.get(rows)
        if out is None:
            out = self._device_out[rows] = torch.empty(
                (rows, self.kt.geometry.dim), dtype=torch.bfloat16, device=self.device
            )
        return out
