"""Item 5 of the memory plan (memory/plan.py): the expert bank in host memory, what RAM holds, what
stays in the checkpoint's shards and pages in from disk, and what may be pinned (pure: no device calls).

    host_split(bank_bytes, machine, decisions, warnings) -> HostSplit
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsv4serve.memory.plan import Machine

GIB = 1024**3
HOST_MARGIN_BYTES = 8 * GIB  # host RAM the expert bank leaves to the OS, the API process and the worker
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
    pin_estimate_bytes: int | None  # measured at startup (experts/pinning.py); this is the expectation


def host_split(bank: int, machine: Machine, decisions: list[str], warnings: list[str]) -> HostSplit:
    """Item 5 of the plan: the bank against host RAM minus the margin, and the expected pin budget."""
    if machine.host_bytes is None:
        decisions.append(
            f"expert bank {_g(bank)} in host memory (give --host-memory to check it fits; the pin "
            "budget is measured at startup)"
        )
        return HostSplit(bank, HOST_MARGIN_BYTES, None, None, None)
    room = max(0, machine.host_bytes - HOST_MARGIN_BYTES)
    ram = min(bank, room)
    cap = int(machine.host_bytes * WSL2_PIN_FRACTION) if machine.platform == "wsl2" else room
    pin = min(ram, cap)
    decisions.append(
        f"expert bank {_g(bank)} in host memory: {_g(ram)} in RAM ({_g(machine.host_bytes)} minus the "
        f"{_g(HOST_MARGIN_BYTES)} margin), about {_g(pin)} of it pinned"
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
