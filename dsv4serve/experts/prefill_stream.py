"""A prefill chunk's routed experts streamed into device memory a group at a time: the expert-slot cache's way to
serve the misses of a step with many routes per expert.

    stream = ExpertStream(slots, first_slot, group, n_experts, device)
    layer = stream.layer(bank_parts, slot_map, in_slot)   # a StreamedLayer: slot_of_expert, ranges()

Why. The FP4 kernel reads an expert outside the slots in place from the host bank (pinned memory over PCIe), once
per block of up to 64 of its routes: a decode step reads each miss once, but a 4,096-token chunk of
DeepSeek-V4-Flash routes ~96 tokens to each expert (2 blocks), so it reads every expert of every layer over PCIe
about twice, at the rate of the GPU's scattered in-place loads (26.7 GB/s on the H200's host at batch 1, against
51.6 for its pinned copies: bench/RESULTS.md, 2026-12-04). Streamed, each expert crosses PCIe once, as a
copy-engine transfer, and the GEMMs re-read it from device memory.

How. The slot tensors hold 2 x `group` rows past the cache's own slots (`first_slot` on): two buffers of `group`
experts. A layer's experts are served in ranges of `group` consecutive ids; range g lives in buffer g % 2. On a
side stream the bank's rows of range g that are in no slot are copied into its buffer (a copy per part and run of
consecutive such experts, out of the pinned bank or the staging area) after the compute stream's last reader of
that buffer (an event), and the compute stream waits for the copy (an event) before the range's GEMMs; so range
g + 1 crosses PCIe while range g computes. `slot_of_expert` points each expert at its cache slot, else at its row
in its range's buffer, and the kernel, launched once per range on that range's blocks only
(dsv4_kernels.fp4_moe_layer.ExpertGroups), never reads the bank. On the CPU the copies are plain copies, made in
turn: the same arithmetic, for the tests.

When the next MoE layer is pinned (`Ahead`), its first two ranges are copied once this layer's last two ranges have
their GEMMs queued: they cross PCIe during that layer's attention, which would otherwise leave the link idle. They
are used only by that layer at the same epoch (no step boundary between: the slots, and so what was copied, are
the same); otherwise copied again.

The order of every fp32 sum is the kernel's, per tile, as in place: the streamed layer's output is bit for bit the
in-place one. Not used while a CUDA graph is captured (a decode step has few routes per expert anyway).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from dsv4serve.memory.prefill_speed import ROUTE_BLOCK
from dsv4serve.memory.prefill_speed import STREAM_BUFFERS as BUFFERS  # one range computes while the next is copied


def streams(num_routes: int, n_experts: int) -> bool:
    """Whether a step's routes stream a layer instead of reading it in place: where the kernel takes its prefill route
    blocks (fp4_moe_choices.pick_block_m: past 4 routes per expert), so that nearly every expert is used and each
    would be read once per block."""
    from dsv4_kernels.fp4_moe_choices import pick_block_m  # lazy: kernel modules build kernels on import

    return pick_block_m(num_routes, n_experts) == ROUTE_BLOCK


@dataclass(frozen=True)
class Ahead:
    """The next MoE layer, pinned, whose first ranges are copied ahead: its key ((layer, epoch)), bank parts and the
    host mirror of its slot map's `>= 0`."""

    key: tuple[int, int]
    bank: dict[str, torch.Tensor]
    in_slot: torch.Tensor


class ExpertStream:
    def __init__(
        self,
        slots: dict[str, torch.Tensor],
        first_slot: int,
        group: int,
        n_experts: int,
        device: torch.device,
        on_copy: Callable[[int], None] | None = None,
    ):
        """`slots`: the cache's slot tensors, part -> [first_slot + BUFFERS x group, ...]; `on_copy(n)`: told of every
        n experts copied as the copy is queued (the cache's h2d bytes: ranges copied ahead and then not used count
        too, they crossed PCIe)."""
        if group < 1:
            raise ValueError(f"a streamed range holds at least one expert, got {group}")
        rows = first_slot + BUFFERS * group
        if any(t.shape[0] != rows for t in slots.values()):
            raise ValueError(f"the slot tensors need {rows} rows: {first_slot} slots and {BUFFERS} x {group} streamed")
        self.group, self.n_experts, self.device = group, n_experts, device
        self.area = {part: t[first_slot:rows] for part, t in slots.items()}
        e = torch.arange(n_experts)
        self._row = (first_slot + (e // group) % BUFFERS * group + e % group).to(torch.int32).to(device)
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in slots.values())
        self._cuda = device.type == "cuda"
        self._copies = torch.cuda.Stream(device) if self._cuda else None
        self._copied = [torch.cuda.Event() for _ in range(BUFFERS)] if self._cuda else []
        self._free = [torch.cuda.Event() for _ in range(BUFFERS)] if self._cuda else []
        self.ahead: tuple[int, int] | None = None  # the key of the layer whose first ranges the buffers hold
        self.on_copy = on_copy

    @property
    def area_bytes(self) -> int:
        return BUFFERS * self.group * self.expert_bytes

    def layer(
        self,
        bank: dict[str, torch.Tensor],
        slot_map: torch.Tensor,
        in_slot: torch.Tensor,
        key: tuple[int, int] | None = None,
        after: Ahead | None = None,
    ) -> StreamedLayer:
        """`bank`: the layer's [E, ...] parts the ranges are copied from (pinned bank or staging area: every expert
        the step uses outside the slots is there); slot_map [E] int32 on the device, -1 outside the slots, and
        in_slot [E] bool, its host mirror (the experts not copied); `key`: (layer, epoch), matched against the
        ranges copied ahead; `after`: the next layer to copy ahead (module doc)."""
        slot_of = torch.where(slot_map >= 0, slot_map, self._row)
        return StreamedLayer(self, bank, slot_of, self.runs(in_slot), key, after)

    def runs(self, in_slot: torch.Tensor) -> list[list[tuple[int, int]]]:
        """Per range, the runs of experts a layer copies (those in no slot)."""
        return [_runs(in_slot, g * self.group, min((g + 1) * self.group, self.n_experts)) for g in range(self.ranges)]

    @property
    def ranges(self) -> int:
        return -(-self.n_experts // self.group)

    def copy_range(self, bank: dict[str, torch.Tensor], g: int, runs: list[tuple[int, int]]) -> None:
        """Copy `runs` ((lo, hi) expert ids) of range g of `bank` into its buffer, after the buffer's last reader (on
        CUDA: on the side stream)."""
        b = g % BUFFERS
        if self.on_copy is not None:
            self.on_copy(sum(hi - lo for lo, hi in runs))
        if self._copies is None:
            self._copy(bank, b, g * self.group, runs)
        else:
            self._copies.wait_event(self._free[b])
            with torch.cuda.stream(self._copies):
                self._copy(bank, b, g * self.group, runs)
                self._copied[b].record(self._copies)

    def _copy(self, bank: dict[str, torch.Tensor], b: int, first: int, runs: list[tuple[int, int]]) -> None:
        for lo, hi in runs:
            at = b * self.group + lo - first
            for part, area in self.area.items():
                area[at : at + hi - lo].copy_(bank[part][lo:hi], non_blocking=self._cuda)

    def compute_waits(self, g: int) -> None:
        """The compute stream waits for range g's copy."""
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(self._copied[g % BUFFERS])

    def compute_done(self, g: int) -> None:
        """Range g's readers are queued: its buffer is free once the compute stream passes here."""
        if self._cuda:
            self._free[g % BUFFERS].record(torch.cuda.current_stream(self.device))


def _runs(in_slot: torch.Tensor, lo: int, hi: int) -> list[tuple[int, int]]:
    """The maximal runs (a, b) of consecutive experts in [lo, hi) that are in no slot."""
    out: list[tuple[int, int]] = []
    for e, held in zip(range(lo, hi), in_slot[lo:hi].tolist()):
        if held:
            continue
        if out and out[-1][1] == e:
            out[-1] = (out[-1][0], e + 1)
        else:
            out.append((e, e + 1))
    return out


@dataclass
class StreamedLayer:
    stream: ExpertStream
    bank: dict[str, torch.Tensor]
    slot_of_expert: torch.Tensor  # [E] int32: each expert's cache slot, else its row in its range's buffer
    runs: list[list[tuple[int, int]]]  # per range, the runs of experts copied (those in no slot)
    key: tuple[int, int] | None = None  # (layer, epoch): its first ranges may have been copied ahead
    after: Ahead | None = None  # the next layer, whose first ranges this one copies ahead

    @property
    def copied_experts(self) -> int:
        return sum(b - a for runs in self.runs for a, b in runs)

    def ranges(self) -> Iterator[tuple[int, int]]:
        """(lo, hi) expert id ranges in order, each copied into its buffer and waited for by the compute stream
        before it is yielded; the caller queues the range's GEMMs before asking for the next."""
        s = self.stream
        n, first = s.ranges, min(BUFFERS, s.ranges)
        ready = first if self.key is not None and s.ahead == self.key else 0
        s.ahead = None
        for g in range(ready, first):
            s.copy_range(self.bank, g, self.runs[g])
        for g in range(n):
            s.compute_waits(g)
            yield g * s.group, min((g + 1) * s.group, s.n_experts)
            s.compute_done(g)
            if g + BUFFERS < n:
                s.copy_range(self.bank, g + BUFFERS, self.runs[g + BUFFERS])
        if self.after is not None:  # the next layer's first ranges, during its attention
            runs = s.runs(self.after.in_slot)
            for g in range(first):
                s.copy_range(self.after.bank, g, runs[g])
            s.ahead = self.after.key
