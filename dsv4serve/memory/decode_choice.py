"""Which MoE backend decodes faster on this machine, by the projection (pure: no device calls).

    tiers = bank_tiers(bank_bytes, machine, cpu_experts, n_moe_layers)   # the host memory plan's split, as shares
    tiers = split_tiers(split, cpu_experts, n_moe_layers)                 # the same, from a split already made
    k = best_kt_layers(b, slots, bank_bytes, machine, bw, graphs)         # hybrid: the layers kt-kernel should hold
    why = eager_reason(enforce_eager, backend)                           # None: decode steps replay CUDA graphs
    projections = project_backends(b, slots, bank_bytes, machine, bw, enforce_eager, backends)
    faster = faster_backend(projections)                                 # "offload" or "hybrid"

`dsv4serve plan` prints the projections (its memory plan reserves decode graphs by `eager_reason`); the worker's
--moe-backend auto asks `faster_backend` before it hands the experts to kt-kernel (experts/moe_backend.py), so that
installing kt-kernel never makes decode slower. Each backend is projected as the worker would run it: the bank's
tiers from host_plan.py (hybrid: kt-kernel's copy planned first, whole layers), its staged layers cutting the decode
graphs (experts/graph_cuts.py), and eager where a step makes the host wait in a way no cut holds
(engine_setup.eager_reason: hybrid CPU experts in speculative verify steps).

How many layers kt-kernel holds is chosen the same way (`best_kt_layers`). Its copy and the bank compete for host
RAM: each layer kt-kernel holds takes KT_COPY_FACTOR x its packed bytes, which the bank then leaves to the disk
(decode_lanes: a miss there is a page-in). With the CPU's expert rate below PCIe's (40 against 50 GB/s assumed),
a layer's misses are served faster pinned than by the CPU alone, so on a 192 GiB host holding every layer in
kt-kernel (the bank then 98% on disk) projects 12.0 tokens/s where offload gives 14.3; holding the first few
layers beside a bank still pinned whole gives both their misses' lanes. Every count from 0 to what fits is
projected and the fastest kept (the fewer layers on a tie).
"""

from __future__ import annotations

from dsv4serve.memory import decode_speed as ds
from dsv4serve.memory.decode_lanes import BankTiers
from dsv4serve.memory.host_plan import HostSplit, Machine, host_split, kt_copy_bytes


def bank_tiers(
    bank_bytes: int, machine: Machine | None, cpu_experts: bool, n_moe_layers: int, kt_layers: int | None = None
) -> BankTiers:
    """Where the bank holds the experts outside the slots, as the host memory plan splits it for this backend
    (hybrid: kt-kernel's copy of its first `kt_layers` layers, None: all that fit); all pinned (and every layer
    held by kt-kernel) when there is no bank or host memory is not known."""
    if not bank_bytes or machine is None or machine.host_bytes is None:
        return ds.ALL_PINNED
    split = host_split(bank_bytes, machine, [], [], cpu_experts, bank_bytes // n_moe_layers, kt_layers)
    return split_tiers(split, cpu_experts, n_moe_layers)


def best_kt_layers(
    b: ds.DecodeBytes,
    slots: int,
    bank_bytes: int,
    machine: Machine | None,
    bw: ds.Bandwidths,
    graphs: bool = True,
    hit_rate: float | None = None,
    at_least: int = 1,
) -> int | None:
    """The number of MoE layers (the first ones) kt-kernel should hold for the fastest projected hybrid decode
    (module doc), from `at_least` to as many as host memory holds; None when host memory is not known (then it
    holds every layer that fits, as before a plan)."""
    if not bank_bytes or machine is None or machine.host_bytes is None:
        return None
    n = b.n_moe_layers
    fits = int(split_tiers(host_split(bank_bytes, machine, [], [], True, bank_bytes // n), True, n).cpu_layers * n)
    best: tuple[float, int] | None = None
    for k in range(min(at_least, fits), fits + 1):
        tiers = bank_tiers(bank_bytes, machine, True, n, k)
        speed = ds.project_decode(b, slots, bw, "hybrid", graphs, hit_rate, tiers).tokens_per_second
        if best is None or speed > best[0] * (1 + 1e-9):
            best = (speed, k)
    return best[1] if best is not None else 0


def split_tiers(split: HostSplit, cpu_experts: bool, n_moe_layers: int) -> BankTiers:
    """A host memory plan's split (host_plan.host_split) as shares of the bank; all pinned without host memory."""
    if split.ram_bytes is None or split.pin_estimate_bytes is None or not split.bank_bytes:
        return ds.ALL_PINNED
    bank = split.bank_bytes
    held = 1.0
    if cpu_experts:  # experts/attach.kt_layers: as many whole layers as kt-kernel's copy of them fits
        layers = split.kt_copy_bytes * n_moe_layers / kt_copy_bytes(bank)
        held = min(n_moe_layers, int(layers + 1e-6)) / n_moe_layers  # whole layers (bytes rounded per layer)
    return BankTiers(split.pin_estimate_bytes / bank, (split.ram_bytes - split.pin_estimate_bytes) / bank, held)


def eager_reason(enforce_eager: bool, backend: str, speculative: bool = False) -> str | None:
    """Why this backend's decode steps run eager (worker/engine_setup.eager_reason), or None: CUDA graphs (hybrid
    too: its decode steps take the CPU split fixed between steps, experts/hybrid_graph.py; a bank not all pinned
    too: its staged layers cut the graphs, experts/graph_cuts.py)."""
    if enforce_eager:
        return "--enforce-eager"
    if backend == "hybrid" and speculative:
        return "hybrid CPU experts sync per MoE layer in the speculative verify steps"
    return None


def project_backends(
    b: ds.DecodeBytes,
    slots: int,
    bank_bytes: int,
    machine: Machine | None,
    bw: ds.Bandwidths,
    enforce_eager: bool,
    backends: tuple[str, ...],
    speculative: bool = False,
    hit_rate: float | None = None,
) -> dict[str, tuple[ds.DecodeProjection, BankTiers, str | None]]:
    """backend -> (its projection, the bank's tiers for it, why it runs eager or None); `hit_rate`: the slot hits
    measured (or supposed) instead of uniform routing's."""
    out = {}
    for backend in backends:
        why = eager_reason(enforce_eager, backend, speculative)
        kt = None
        if backend == "hybrid":
            kt = best_kt_layers(b, slots, bank_bytes, machine, bw, why is None, hit_rate)
        tiers = bank_tiers(bank_bytes, machine, backend == "hybrid", b.n_moe_layers, kt)
        projection = ds.project_decode(b, slots, bw, backend, why is None, hit_rate, tiers)
        out[backend] = (projection, tiers, why)
    return out


def faster_backend(projections: dict[str, tuple[ds.DecodeProjection, BankTiers, str | None]]) -> str:
    """The backend with the higher projected tokens/s; a tie keeps the one without kt-kernel (offload)."""
    return max(projections, key=lambda k: (projections[k][0].tokens_per_second, k != "hybrid"))


def offload_faster(projections: dict[str, tuple[ds.DecodeProjection, BankTiers, str | None]]) -> str | None:
    """The line --moe-backend auto logs when the projections say offload decodes faster than hybrid, else None."""
    if faster_backend(projections) != "offload" or "hybrid" not in projections:
        return None
    speed = {k: v[0].tokens_per_second for k, v in projections.items()}
    eager = {k: v[2] for k, v in projections.items() if v[2]}
    how = "".join(f"; {k} eager: {why}" for k, why in eager.items())
    return (
        f"projected batch-1 decode offload {speed['offload']:.1f} vs hybrid {speed['hybrid']:.1f} tokens/s "
        f"(memory/decode_speed.py at the assumed bandwidths{how}; `dsv4serve plan` shows the terms; "
        "--moe-backend hybrid forces it)"
    )
