"""The expert-slot cache's transfers between steps, none of which makes the host wait for the device.

    counts = LaggedCounts(usage)        counts.collect() -> the counters' growth since the last call, or None
    copier = SlotCopier(slots, device)  copier.idle(); copier.issue(copies, map_host, map_dev); copier.compute_waits()

LaggedCounts: the device usage counters ([L, E + 2] int64, cumulative; moe_align.py adds to them) are
copied to a pinned host buffer on the compute stream, non-blocking, with an event; `collect` reads the
buffer only once the event is done and never waits: on CUDA the counts arrive a step or two late. On
the CPU the copy is synchronous, so a step's counts are read at the next boundary.

SlotCopier: a batch of experts copied into slots, then the host mirror of the slot map copied to the
device map. On CUDA the batch runs on a side stream that first waits for the compute already queued
(which includes every reader of the slots being overwritten), and ends with one event; the compute
stream waits on that event before the step's first MoE layer (`compute_waits`). A copy's source must
be pinned to be asynchronous: bank experts held pageable or in the mapped shards are first copied on
the host into pinned transfer buffers (one per batch entry, reused once the previous batch is done).
On the CPU every copy is synchronous.
"""

from __future__ import annotations

import torch

Parts = dict[str, torch.Tensor]  # part name (w1, w1_scale, ...) -> one expert's tensor


class LaggedCounts:
    def __init__(self, usage: torch.Tensor):
        self.usage = usage  # [L, E + 2] int64 on the device, cumulative (slot_cache.py)
        self._cuda = usage.is_cuda
        self._host = torch.zeros(usage.shape, dtype=usage.dtype, pin_memory=self._cuda)
        self._seen = torch.zeros(usage.shape, dtype=usage.dtype)
        self._event: torch.cuda.Event | None = None
        self._pending = False

    def collect(self) -> torch.Tensor | None:
        """The counters' growth since the last collected copy ([L, E + 2] int64 on the host), or None;
        issues the next copy when none is in flight."""
        grown = self._take()
        if not self._pending:
            self._issue()
            more = self._take()  # the CPU's copy is done at once
            if more is not None:
                grown = more if grown is None else grown + more
        return grown

    def _issue(self) -> None:
        self._host.copy_(self.usage, non_blocking=self._cuda)
        if self._cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self._pending = True

    def _take(self) -> torch.Tensor | None:
        if not self._pending or (self._event is not None and not self._event.query()):
            return None
        totals = self._host.clone()
        grown, self._seen = totals - self._seen, totals
        self._pending = False
        return grown


class SlotCopier:
    def __init__(self, slots: Parts, device: torch.device, max_batch: int):
        self.slots, self.device = slots, device  # part -> [S, ...]
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._done: torch.cuda.Event | None = None
        self._max_batch = max_batch
        self._transfer: Parts | None = None  # pinned [max_batch, ...] per part, made on first need

    def idle(self) -> bool:
        """True when no batch is in flight: the slot map's host mirror and the transfer buffers are free."""
        return self._done is None or self._done.query()

    def issue(self, copies: list[tuple[int, Parts, bool]], map_host: torch.Tensor, map_dev: torch.Tensor) -> None:
        """Copy each (slot, source parts, source pinned) into its slot, then map_host into map_dev."""
        if len(copies) > self._max_batch:
            raise ValueError(f"{len(copies)} copies in one batch, at most {self._max_batch}")
        if not self._cuda:
            for slot, src, _ in copies:
                for part, t in self.slots.items():
                    t[slot].copy_(src[part])
            map_dev.copy_(map_host)
            return
        sources = [src if pinned else self._pinned(i, src) for i, (_, src, pinned) in enumerate(copies)]
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the slots' readers first
        with torch.cuda.stream(self._stream):
            for (slot, _, _), src in zip(copies, sources):
                for part, t in self.slots.items():
                    t[slot].copy_(src[part], non_blocking=True)
            map_dev.copy_(map_host, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(self._stream)

    def compute_waits(self) -> bool:
        """Order the compute stream after the last batch; True when it was still running (a stall)."""
        if self._done is None:
            return False
        running = not self._done.query()
        torch.cuda.current_stream(self.device).wait_event(self._done)
        if not running:
            self._done = None
        return running

    def _pinned(self, i: int, src: Parts) -> Parts:
        """A host copy of `src` in pinned transfer buffer i (free: the previous batch is done)."""
        if self._transfer is None:
            self._transfer = {
                part: torch.empty((self._max_batch, *t.shape[1:]), dtype=t.dtype, pin_memory=True)
                for part, t in self.slots.items()
            }
        return {part: buf[i].copy_(src[part]) for part, buf in self._transfer.items()}
