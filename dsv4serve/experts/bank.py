"""The expert bank: every routed expert in host memory, packed MXFP4 exactly as the checkpoint stores it.

    load_expert_bank(ckpt, layers, pin, ram_bytes=None) -> ExpertBank

Per MoE layer and per part one stacked tensor: `w1`, `w3`, `w2` int8 [E, out, in/2] (two e2m1 codes
a byte, low nibble = even K) and `w1_scale`, `w3_scale`, `w2_scale` uint8 [E, out, in/32] (e8m0
bytes). That is the layout kernels/dsv4_kernels/fp4_moe.py consumes, so one expert's slice copies to
a GPU slot unchanged. Nothing is dequantized: the bank is the checkpoint's ~137 GiB, not 8x that.

Whole layers, in order, are placed in three tiers: pinned while they fit the measured pin budget
(pinning.py), then pageable RAM while they fit `ram_bytes` (host RAM minus a margin), and the rest
stays in the checkpoint's memory-mapped shards, read through the OS page cache (a 128 GiB machine
cannot hold all 137 GiB). `report` says which tier holds how much, and why.

On CUDA the FP4 kernel reads an expert outside the device slots in place from its pinned layer
tensors (experts/slot_cache.py). A layer outside the pinned tier must be staged into a pinned
one-layer area first (experts/staging.py); when the bank does not fit the pin budget whole, one
layer's bytes of the budget are kept for that area (`BankReport.staging_bytes`) and the pinned tier
gets the rest; the area is RAM too, so it comes out of `ram_bytes` as well (memory/host_plan.py plans the same).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from tqdm import tqdm

from dsv4serve.checkpoint.loader import Checkpoint
from dsv4serve.checkpoint.source import CheckpointError, SafetensorsFolder
from dsv4serve.experts.pinning import GIB, PinBudget
from dsv4serve.model.schema import TensorSpec

log = logging.getLogger("dsv4serve.worker")
PartShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]  # part -> one expert's shape, dtype


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class BankReport:
    pinned_bytes: int
    pageable_bytes: int
    mapped_bytes: int  # left in the shards (mmap)
    pin: PinBudget
    staging_bytes: int = 0  # of the pin budget, kept for the staging area of the unpinned layers

    @property
    def bank_bytes(self) -> int:
        return self.pinned_bytes + self.pageable_bytes + self.mapped_bytes

    @property
    def mode(self) -> str:
        """`pinned N GiB`, `pageable (no CUDA)`, or the split over the three tiers."""
        if self.pinned_bytes == self.bank_bytes:
            return f"pinned {_gib(self.pinned_bytes)}"
        if self.pinned_bytes == 0 and self.mapped_bytes == 0:
            return "pageable (no CUDA)" if self.pin.reason == "pageable (no CUDA)" else "pageable"
        tiers = [
            (self.pinned_bytes, "pinned"),
            (self.pageable_bytes, "pageable"),
            (self.mapped_bytes, "on disk (mmap)"),
        ]
        return ", ".join(f"{_gib(n)} {what}" for n, what in tiers if n)

    def describe(self) -> str:
        """One line for the log and the startup report."""
        staging = f" ({_gib(self.staging_bytes)} of it kept to stage unpinned layers)" if self.staging_bytes else ""
        return (
            f"expert bank {_gib(self.bank_bytes)}: {self.mode}; pin budget {_gib(self.pin.budget_bytes)}{staging} on "
            f"{self.pin.platform}: {self.pin.reason}"
        )


@dataclass(frozen=True)
class ExpertBank:
    layers: dict[int, dict[str, torch.Tensor]]  # layers in RAM: part (w1, w1_scale, ...) -> [E, ...]
    mapped: dict[int, dict[tuple[int, str], str]]  # layers left in the shards: (expert, part) -> tensor name
    source: SafetensorsFolder | None  # where the mapped layers are read from
    part_shapes: PartShapes
    n_experts: int  # routed experts per layer
    expert_bytes: int  # one expert, all six parts: one slot
    report: BankReport
    pinned: frozenset[int] = frozenset()  # the layers held in pinned memory (CUDA)

    def device_readable(self, layer: int, device: torch.device) -> bool:
        """True when a kernel on `device` can read `layer`'s stacked tensors in place: pinned on CUDA, in
        RAM on the CPU (the mapped shards hold no stacked tensor)."""
        return layer in self.pinned if device.type == "cuda" else layer in self.layers

    def expert(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """One expert's six packed parts: views into RAM, or into the mapped shard (no copy: its pages come in as
        the caller copies them out)."""
        if layer in self.layers:
            return {part: t[expert] for part, t in self.layers[layer].items()}
        assert self.source is not None  # a bank with mapped layers keeps its source
        names = self.mapped[layer]
        return {
            part: self.source.view(names[(expert, part)]).view(dtype).view(shape)
            for part, (shape, dtype) in self.part_shapes.items()
        }


def _part(spec: TensorSpec) -> str:
    """`layers.3.ffn.experts.7.w1.scale` -> `w1_scale`; `...w1.weight` -> `w1`."""
    linear, kind = spec.name.rsplit(".", 2)[-2:]
    return linear if kind == "weight" else f"{linear}_scale"


def check_bankable(ckpt: Checkpoint) -> None:
    """The bank holds MXFP4 experts under official names; refuse anything else by name."""
    if ckpt.layout != "official" or ckpt.args.expert_dtype != "fp4":
        raise CheckpointError(
            f"{ckpt.folder}: the expert bank holds MXFP4 experts as the official DeepSeek "
            f"checkpoint stores them; this one has {ckpt.layout} names with "
            f"{ckpt.args.expert_dtype} experts: keep every expert resident instead"
        )


def expert_specs(ckpt: Checkpoint, layers: list[int]) -> dict[int, list[TensorSpec]]:
    """The packed FP4 tensors of the routed experts of `layers`, by layer (refuses other formats)."""
    check_bankable(ckpt)
    wanted = set(layers)
    out: dict[int, list[TensorSpec]] = {layer: [] for layer in layers}
    for s in ckpt.specs:
        if s.group == "routed_experts" and s.layer in wanted:
            out[s.layer].append(s)
    return out


def bank_bytes(specs: dict[int, list[TensorSpec]]) -> int:
    return sum(s.nbytes for layer in specs.values() for s in layer)


def _expert(spec: TensorSpec) -> int:
    assert spec.expert is not None, f"{spec.name}: a routed-expert tensor names its expert"
    return spec.expert


def _dtype(spec: TensorSpec) -> torch.dtype:
    return torch.int8 if spec.role == "fp4_weight" else torch.uint8


def load_expert_bank(
    ckpt: Checkpoint, layers: list[int], pin: PinBudget, ram_bytes: int | None = None, progress: bool = False
) -> ExpertBank:
    """Read the routed experts of `layers` packed into at most `ram_bytes` of RAM (None: no limit),
    pinned within `pin`, the rest left mapped in the shards (whose handles must then stay open)."""
    specs = expert_specs(ckpt, layers)
    bar = tqdm(
        total=bank_bytes(specs), unit="B", unit_scale=True, unit_divisor=1024, desc="expert bank", disable=not progress
    )
    n_experts = ckpt.args.n_routed_experts
    shapes: PartShapes = {_part(s): (s.shape, _dtype(s)) for s in specs[layers[0]]}
    ram: dict[int, dict[str, torch.Tensor]] = {}
    mapped: dict[int, dict[tuple[int, str], str]] = {}
    layer_sizes = [sum(s.nbytes for s in layer_specs) for layer_specs in specs.values()]
    staging = 0 if sum(layer_sizes) <= pin.budget_bytes or not torch.cuda.is_available() else max(layer_sizes)
    pin_room = max(0, pin.budget_bytes - staging)
    ram_room = None if ram_bytes is None else max(0, ram_bytes - staging)  # the staging area is RAM too
    pinned = pageable = left = 0
    pinned_layers = []
    for layer, layer_specs in specs.items():
        size = sum(s.nbytes for s in layer_specs)
        in_ram = ram_room is None or pinned + pageable + size <= ram_room
        if in_ram and torch.cuda.is_available() and pinned + size <= pin_room:
            pinned, pin_it = pinned + size, True
            pinned_layers.append(layer)
        elif in_ram:
            pageable, pin_it = pageable + size, False
        else:
            left += size
            mapped[layer] = {(_expert(s), _part(s)): s.name for s in layer_specs}
            bar.update(size)
            continue
        parts = {
            p: torch.empty((n_experts, *shape), dtype=dtype, pin_memory=pin_it) for p, (shape, dtype) in shapes.items()
        }
        for s in layer_specs:
            parts[_part(s)][_expert(s)].copy_(ckpt.source.read(s.name).view(_dtype(s)))
            bar.update(s.nbytes)
        ram[layer] = parts
    bar.close()
    report = BankReport(pinned, pageable, left, pin, staging)
    log.info("%s", report.describe())
    expert_bytes = report.bank_bytes // (len(layers) * n_experts)
    source = ckpt.source if mapped else None
    return ExpertBank(ram, mapped, source, shapes, n_experts, expert_bytes, report, frozenset(pinned_layers))
