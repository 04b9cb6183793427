"""Item 5 of the memory plan (memory/plan.py): the expert bank in host memory, what RAM holds, what
stays in the checkpoint's shards and pages in from disk, and what may be pinned (pure: no device calls).

    host_split(bank_bytes, machine, decisions, warnings, cpu_experts=False) -> HostSplit

With --moe-backend hybrid (`cpu_experts`) kt-kernel keeps its own copy of the experts it computes,
about KT_COPY_FACTOR times their packed bytes (measured with kt-kernel 0.7.2: 3.19 GiB packed per
layer of 256 experts): that copy is resident RAM and is planned first, for the first `kt_layers` MoE layers
(the count the decode projection prefers: memory/decode_choice.best_kt_layers; None: every layer that fits);
the bank then holds in RAM what is left beside it (its pinned part feeds the slots), the rest stays in the
shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Machine(Protocol):
    """What this part reads of the plan's machine (memory/plan.py's Machine; not imported: plan imports us)."""

    @property
    def host_bytes(self) -> int | None: ...

    @property
    def platform(self) -> str: ...


GIB = 1024**3
HOST_MARGIN_BYTES = 8 * GIB  # host RAM the expert bank leaves to the OS, the API process and the worker
KT_COPY_FACTOR = 1.3  # kt-kernel's copy of the experts / their packed MXFP4 bytes (issue 18, measured)
WSL2_PIN_FRACTION = 0.5  # users.md: WSL2 caps pinned host memory near half of RAM


def _g(n: int | float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class HostSplit:
    """The expert bank in host memory: what RAM holds, what stays on disk, what may be pinned."""

    bank_bytes: int
    margin_bytes: int
    ram_bytes: int | None  # None: host memory not given
    disk_bytes: int | None
    pin_estimate_bytes: int | None  # the bank's pinned part expected (the budget, less a staging area, is measured
    # at startup: experts/pinning.py)
    kt_copy_bytes: int = 0  # hybrid: kt-kernel's own copy of the experts, resident RAM


def plans_cpu_experts(moe_backend: str) -> bool:
    """Whether offloaded experts would be computed on the CPU: --moe-backend hybrid, or auto with kt-kernel
    installed (experts/moe_backend.py decides at start-up, with experts/kt_backend.kt_kernel_available; memory
    imports nothing above it, so the package is looked up here directly, without importing it)."""
    import importlib.util

    return moe_backend == "hybrid" or (moe_backend == "auto" and importlib.util.find_spec("kt_kernel") is not None)


def kt_copy_bytes(bank: int) -> int:
    """kt-kernel's resident copy of `bank` packed expert bytes (--moe-backend hybrid)."""
    return int(bank * KT_COPY_FACTOR)


def staging_bytes(bank: int, room: int, cap: int, layer_bytes: int) -> int:
    """The staging area experts/bank.py keeps when the bank is not all pinned: one layer's bytes, pinned, out of
    the pin budget and of the RAM beside the bank (0 when every layer of the bank is pinned)."""
    return layer_bytes if bank > min(room, cap) else 0


def host_split(
    bank: int,
    machine: Machine,
    decisions: list[str],
    warnings: list[str],
    cpu_experts: bool = False,
    layer_bytes: int = 0,
    kt_layers: int | None = None,
) -> HostSplit:
    """Item 5 of the plan: the bank against host RAM minus the margin, and the expected pin budget;
    with `cpu_experts` (hybrid) kt-kernel's copy of `kt_layers` layers (None: all) first (`_kt_copy`).
    `layer_bytes`: one MoE layer's experts, the staging area a bank beyond the pin budget keeps pinned
    (experts/bank.py)."""
    if cpu_experts:
        return _kt_copy(bank, machine, decisions, warnings, layer_bytes, kt_layers)
    if machine.host_bytes is None:
        decisions.append(
            f"expert bank {_g(bank)} in host memory (give --host-memory to check it fits; the pin "
            "budget is measured at startup)"
        )
        return HostSplit(bank, HOST_MARGIN_BYTES, None, None, None)
    room = max(0, machine.host_bytes - HOST_MARGIN_BYTES)
    cap = int(machine.host_bytes * WSL2_PIN_FRACTION) if machine.platform == "wsl2" else room
    staging = staging_bytes(bank, room, cap, layer_bytes)
    ram = min(bank, max(0, room - staging))
    pin = min(ram, max(0, cap - staging))
    decisions.append(
        f"expert bank {_g(bank)} in host memory: {_g(ram)} in RAM ({_g(machine.host_bytes)} minus the "
        f"{_g(HOST_MARGIN_BYTES)} margin"
        + (f" and a {_g(staging)} pinned staging area for the unpinned layers" if staging else "")
        + f"), about {_g(pin)} of it pinned"
        + (" (WSL2 caps pinning near half of RAM, less inside Docker)" if machine.platform == "wsl2" else "")
        + "; the real pin budget is measured at startup, pageable staging beyond it"
    )
    if bank > ram:
        warnings.append(
            f"the expert bank ({_g(bank)}) is larger than host memory ({_g(machine.host_bytes)}) minus "
            f"the {_g(HOST_MARGIN_BYTES)} margin: {_g(bank - ram)} of experts stay in the checkpoint "
            "files and page in from disk (mmap) on a miss, and decode slows down"
        )
    return HostSplit(bank, HOST_MARGIN_BYTES, ram, bank - ram, pin)


def kt_layers_copy_bytes(bank: int, layer_bytes: int, kt_layers: int | None) -> int:
    """kt-kernel's copy of its first `kt_layers` MoE layers (None: the whole bank)."""
    if kt_layers is None or not layer_bytes:
        return kt_copy_bytes(bank)
    return kt_copy_bytes(min(bank, kt_layers * layer_bytes))


def _kt_copy(
    bank: int, machine: Machine, decisions: list[str], warnings: list[str], layer_bytes: int, kt_layers: int | None
) -> HostSplit:
    """Hybrid: kt-kernel's copy (resident) planned before the bank; the bank's RAM part is what is left."""
    kt = kt_layers_copy_bytes(bank, layer_bytes, kt_layers)
    if kt_layers is None or not layer_bytes:
        what = f"kt-kernel's copy {_g(kt)} ({KT_COPY_FACTOR}x the {_g(bank)} packed bank)"
    else:
        what = (
            f"kt-kernel's copy of the first {min(kt_layers, bank // layer_bytes)} of {bank // layer_bytes} MoE layers, "
            f"{_g(kt)} ({KT_COPY_FACTOR}x their packed bytes; the count the decode projection prefers: "
            "memory/decode_choice.best_kt_layers),"
        )
    if machine.host_bytes is None:
        decisions.append(f"hybrid experts: {what} in host memory (give --host-memory to check it fits)")
        return HostSplit(bank, HOST_MARGIN_BYTES, None, None, None, kt)
    room = max(0, machine.host_bytes - HOST_MARGIN_BYTES)
    kt_held = min(kt, room)
    cap = int(machine.host_bytes * WSL2_PIN_FRACTION) if machine.platform == "wsl2" else room
    staging = staging_bytes(bank, room - kt_held, cap, layer_bytes)
    ram = min(bank, max(0, room - kt_held - staging))
    pin = min(ram, max(0, cap - staging))
    decisions.append(
        f"hybrid experts: {what} in RAM first, "
        f"then {_g(ram)} of the bank beside it (about {_g(pin)} pinned for the slots), {_g(bank - ram)} left in "
        "the checkpoint files (mmap)"
    )
    if kt > room:
        warnings.append(
            f"kt-kernel's copy of the experts ({_g(kt)}) does not fit host memory ({_g(machine.host_bytes)}) minus "
            f"the {_g(HOST_MARGIN_BYTES)} margin: only the layers that fit ({_g(kt_held)}) are computed on the "
            "CPU, the rest run as --moe-backend offload"
        )
    return HostSplit(bank, HOST_MARGIN_BYTES, ram, bank - ram, pin, kt_held)
