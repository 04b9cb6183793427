"""The one path of the expert-slot cache that makes the host wait: a layer whose bank tensors the
device cannot read in place.

    staging = LayerStaging(bank, device)
    parts = staging.layer_parts(layer, ids, in_slot)   # six [E, ...] tensors for the FP4 kernel's bank source

The FP4 kernel reads an expert outside the slots from the layer's stacked [E, ...] bank tensors in
place. That needs them in memory the device can address: on CUDA pinned host memory (the bank's
pinned tier), on the CPU any RAM. A layer held pageable (CUDA) or left in the mapped checkpoint
shards (both) is not: before its kernels run, the experts the step routes to must be staged into a
one-layer staging area of that kind (pinned on CUDA; the bank reserves its pin budget, bank.py).
Which experts those are only the device knows, so this path learns the layer's ids: a non-blocking
copy to the host and a wait on its event (on the CPU a plain read), then copies each routed expert
that is in no slot into the staging area on the host, and the kernels read the staging area as the
layer's bank tensors. The wait also orders the host's overwrite of the area after every kernel queued
before it (the previous staged layer's readers). The cache counts each use as a stall; a fully pinned
bank never takes this path (on the CPU: a bank without mapped layers).

The area remembers which (layer, expert)s it holds, so a layer staged twice in a row copies only
what is new. A layer's experts are staged by STAGE_THREADS threads at once, each copying an expert straight
out of RAM or out of a view of its mapped shard (no intermediate copy). In a decode graph the staging runs
between two segments of the captured step (graph_cuts.py): the kernels read the same area tensors (`area`)
every replay.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from dsv4serve.experts.bank import ExpertBank

# experts staged at once: their page-ins from disk queue together (an SSD serves several reads in parallel; a
# memory-mapped page-in on one thread waits for each of its read-ahead windows in turn), and their copies out of
# pageable RAM share the memory bus; doctor_disk.py measures the disk with as many threads
STAGE_THREADS = max(1, min(4, os.cpu_count() or 1))


class LayerStaging:
    def __init__(self, bank: ExpertBank, device: torch.device):
        self.bank, self.device = bank, device
        self._cuda = device.type == "cuda"
        self._parts: dict[str, torch.Tensor] | None = None  # part -> [E, ...], made on first use
        self._layer: int | None = None
        self._held: set[int] = set()  # experts of self._layer in the area
        self.staged_bytes = 0  # host bytes copied into the area (stats)
        self._ids_host: dict[tuple, torch.Tensor] = {}  # pinned copies of the routing, per shape
        self._threads: ThreadPoolExecutor | None = None  # made at the first layer with two experts to stage

    def layer_parts(self, layer: int, ids: torch.Tensor, in_slot: torch.Tensor) -> dict[str, torch.Tensor]:
        """ids [T, k] on the device, in_slot [E] bool on the host -> the staging area's [E, ...] parts
        holding every routed expert of `layer` that is in no slot (host sync: module doc)."""
        routed = self._routed(ids)
        parts = self.area()
        if layer != self._layer:
            self._layer, self._held = layer, set()
        todo = [e for e in routed if e not in self._held and not bool(in_slot[e])]

        def stage(e: int) -> None:  # torch's copy releases the GIL: the experts' page-ins and copies overlap
            with torch.inference_mode():  # thread-local: the area is made inside a forward, under it
                for part, t in self.bank.expert(layer, e).items():
                    parts[part][e].copy_(t)

        if len(todo) > 1:
            list(self._pool().map(stage, todo))
        elif todo:
            stage(todo[0])
        self._held.update(todo)
        self.staged_bytes += len(todo) * self.bank.expert_bytes
        return parts

    def _pool(self) -> ThreadPoolExecutor:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(STAGE_THREADS, thread_name_prefix="dsv4serve-staging")
        return self._threads

    def area(self) -> dict[str, torch.Tensor]:
        """The staging area's [E, ...] parts (pinned on CUDA), made on first use: the same tensors for every staged
        layer, so a captured kernel reads them at fixed addresses."""
        if self._parts is None:
            self._parts = {
                part: torch.empty((self.bank.n_experts, *shape), dtype=dtype, pin_memory=self._cuda)
                for part, (shape, dtype) in self.bank.part_shapes.items()
            }
        return self._parts

    def forget(self) -> None:
        """Hold nothing: the next staging of any layer copies every expert it routes to (a check's clean start)."""
        self._layer, self._held = None, set()
        if self._parts is not None:
            with torch.inference_mode():  # the area is made inside a forward, under inference mode
                for t in self._parts.values():
                    t.zero_()

    def _routed(self, ids: torch.Tensor) -> list[int]:
        """The experts in ids, read on the host: on CUDA after a non-blocking copy and its event."""
        if self._cuda:
            key = (tuple(ids.shape), ids.dtype)
            host = self._ids_host.get(key)
            if host is None:  # one pinned buffer per shape: pinning is slow, a decode step's shapes are few
                host = self._ids_host[key] = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
            ids = host
        return sorted(set(ids.flatten().tolist()))
