"""The MoE phase of a projected decode step, where the misses' experts live (pure: the model of decode_speed.py).

    tiers = BankTiers(pinned, pageable, cpu_layers)          # shares of the bank / of the MoE layers
    for c in tiers.classes(): ...                            # (tier, share of the layers, kt-kernel holds them)
    lanes, f = class_lanes(tier, held, fixed, misses, rates) # one class's lanes at its best CPU share f

The expert bank places whole layers, in order, in three tiers (experts/bank.py; memory/host_plan.py plans the
same split): pinned, pageable RAM, and the checkpoint's shards on disk. A miss costs a different path in each:
- pinned: the GPU reads it in place over PCIe (unified addressing) while the layer's other reads go on: the PCIe
  lane runs beside the host-memory lane;
- pageable: the host waits for the layer's routing, copies each miss into a pinned staging area (a read and a
  write of host memory), then the GPU reads it over PCIe: one chain, one after the other (experts/staging.py);
- on disk: the same chain after a page-in from the shards (the page cache's write is one more crossing of host
  memory).
With --moe-backend hybrid, kt-kernel holds the first layers that fit beside the bank (experts/attach.kt_layers);
only their misses can go to the CPU, which reads kt-kernel's own copy in RAM whatever tier the bank put them in.
Each class of layers (tier x held) runs its own MoE phase: the slowest of its lanes at the CPU share that
minimises it. A step's MoE phase is the sum over the classes.

The expert-slot cache weighs each expert's use by what its miss costs (experts/residency.py): under uniform
routing the slots go to the costliest misses' experts first (disk, then pageable, then pinned; a layer kt-kernel
holds costs less, its misses split with the CPU), so each class has its own hit rate (`class_hit_rates`).
"""

from __future__ import annotations

from dataclasses import dataclass

TIERS = ("pinned", "pageable", "disk")
# crossings of host memory per byte of a fetched miss: the DMA's read; + the staging copy's read and write;
# + the page cache's write of a page-in
HOST_CROSSINGS = {"pinned": 1, "pageable": 3, "disk": 4}
CPU_CROSSINGS = 1  # kt-kernel reads its copy once


@dataclass(frozen=True)
class BankTiers:
    """Shares of the expert bank by bytes: pinned and pageable (the rest on disk); and with hybrid the share of the
    MoE layers whose experts kt-kernel holds (1.0: all, the default for a machine not planned)."""

    pinned: float = 1.0
    pageable: float = 0.0
    cpu_layers: float = 1.0

    def __post_init__(self) -> None:
        for name in ("pinned", "pageable", "cpu_layers"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {getattr(self, name)}")
        if self.pinned + self.pageable > 1.0 + 1e-9:
            raise ValueError(f"pinned {self.pinned} + pageable {self.pageable} exceed the bank")

    @property
    def disk(self) -> float:
        return max(0.0, 1.0 - self.pinned - self.pageable)

    def classes(self) -> list[tuple[str, float, bool]]:
        """(tier, share of the MoE layers, kt-kernel holds them) for every nonempty overlap of the bank's tiers
        (layers in order: pinned first) with kt-kernel's layers (the first cpu_layers of them)."""
        edges = {"pinned": (0.0, self.pinned), "pageable": (self.pinned, self.pinned + self.pageable)}
        edges["disk"] = (self.pinned + self.pageable, 1.0)
        out = []
        for tier in TIERS:
            lo, hi = edges[tier]
            for held, a, b in ((True, 0.0, self.cpu_layers), (False, self.cpu_layers, 1.0)):
                share = min(hi, b) - max(lo, a)
                if share > 1e-12:
                    out.append((tier, share, held))
        return out


@dataclass(frozen=True)
class Rates:
    """Bytes per second of each path (decode_speed.Bandwidths, resolved)."""

    gpu: float  # the GPU's reads of its weights
    h2d: float  # PCIe reads of pinned host memory
    host: float  # host memory
    cpu: float  # kt-kernel's expert GEMV over its weights
    disk: float  # page-ins from the checkpoint's shards


def fetch_seconds_per_byte(tier: str, r: Rates) -> float:
    """A fetched miss's chain per byte (module doc): PCIe; + the host's staging copy; + the page-in."""
    return 1 / r.h2d + (0.0 if tier == "pinned" else 2 / r.host) + (1 / r.disk if tier == "disk" else 0.0)


def miss_seconds_per_byte(tier: str, held: bool, r: Rates, use_cpu: bool) -> float:
    """What a miss costs a class per byte: its fetch chain, or where kt-kernel holds the layer and takes a share,
    the fetch and the CPU in parallel (the two lanes finish together: 1 / (1 / fetch + CPU bytes/s))."""
    fetch = fetch_seconds_per_byte(tier, r)
    return 1 / (1 / fetch + r.cpu) if held and use_cpu else fetch


def class_hit_rates(classes: list[tuple[str, float, bool]], slot_fraction: float, cost: list[float]) -> list[float]:
    """Each class's slot hit rate under uniform routing: the slots (`slot_fraction` of all experts) go to the
    classes of the costliest misses first (`cost`, per class: miss_seconds_per_byte), spread evenly over the
    layers of equal cost (experts/residency.py's weighted policy in its steady state)."""
    if not 0.0 <= slot_fraction <= 1.0:
        raise ValueError(f"slot_fraction must be within [0, 1], got {slot_fraction}")
    rates, left = [0.0] * len(classes), slot_fraction
    for c in sorted(set(cost), reverse=True):
        group = [i for i, ci in enumerate(cost) if ci == c]
        size = sum(classes[i][1] for i in group)
        take = min(left, size)
        for i in group:
            rates[i] = min(1.0, take / size) if size > 0 else 0.0
        left -= take
    return rates


def _lines(tier: str, held: bool, fixed_s: float, miss_bytes: float, r: Rates) -> dict[str, tuple[float, float]]:
    """Each lane of a class as a line a + b f in the CPU share f of its misses."""
    fetch = miss_bytes * fetch_seconds_per_byte(tier, r)
    host = miss_bytes * HOST_CROSSINGS[tier] / r.host
    cpu_host = miss_bytes * CPU_CROSSINGS / r.host
    gpu_fetched = miss_bytes / r.gpu
    lanes = {
        "GPU experts": (fixed_s + gpu_fetched, -gpu_fetched),
        "PCIe copies" if tier == "pinned" else "staged copies": (fetch, -fetch),
        "CPU experts": (0.0, miss_bytes / r.cpu if held else 0.0),
        "host memory": (host, cpu_host - host),
    }
    if tier != "pinned":
        lanes["PCIe copies"] = (0.0, 0.0)
    if tier == "pinned":
        lanes["staged copies"] = (0.0, 0.0)
    return lanes


def _at(lines: dict[str, tuple[float, float]], f: float) -> dict[str, float]:
    return {name: a + b * f for name, (a, b) in lines.items()}


def class_lanes(
    tier: str, held: bool, fixed_s: float, miss_bytes: float, r: Rates, use_cpu: bool
) -> tuple[dict[str, float], float]:
    """(lane -> seconds, f) for one class of layers: `fixed_s` the GPU's reads it always does (shared expert,
    hits), `miss_bytes` its misses' bytes a token. With `use_cpu` and kt-kernel holding the class, f is the CPU
    share minimising the slowest lane (a convex, piecewise-linear function: its minimum is at an end or where two
    lanes cross); among equal minima the one that leaves the other lanes least loaded (the host lane of pinned
    misses does not depend on f), then the smaller f."""
    lines = _lines(tier, held, fixed_s, miss_bytes, r)
    if not (use_cpu and held and miss_bytes > 0):
        return _at(lines, 0.0), 0.0
    candidates = {0.0, 1.0}
    items = list(lines.values())
    for i, (a1, b1) in enumerate(items):
        for a2, b2 in items[i + 1 :]:
            if b1 != b2:
                f = (a2 - a1) / (b1 - b2)
                if 0.0 < f < 1.0:
                    candidates.add(f)

    def slowest(f: float, skip: str = "") -> float:
        return max(s for name, s in _at(lines, f).items() if name != skip)

    best = min(slowest(f) for f in candidates)
    ties = [f for f in candidates if slowest(f) <= best * (1 + 1e-9)]
    f = min(ties, key=lambda f: (slowest(f, "host memory"), f))
    return _at(lines, f), f
