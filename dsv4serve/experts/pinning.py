"""How much host memory may be page-locked (pinned) for the expert bank, measured, not assumed.

    measure_pin_budget(cap_bytes, platform, allocate=None) -> PinBudget

Pinned memory is what lets a host->GPU copy run asynchronously at full PCIe speed. How much of it a
process gets depends on the platform: native Linux pins most of RAM, WSL2 caps it near half of RAM,
and Docker on WSL2 far lower (users.md). So the budget is measured on CUDA: blocks of growing size
(MIN_BLOCK_BYTES, doubling up to MAX_BLOCK_BYTES) are pinned until `cap_bytes` is reached; a refused
block is retried at half its size down to MIN_BLOCK_BYTES, so the limit is found to within one small
block. Then all are released. A sixteenth of what was pinned (at least one small block) is kept as
a reserve so the bank never takes the very last pinnable byte (CUDA's own staging needs some). A
CPU-only torch build cannot pin: the budget is zero, "pageable (no CUDA)".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv4serve.memory.probe import detect_platform

MIB, GIB = 1024**2, 1024**3
MIN_BLOCK_BYTES = 256 * MIB
MAX_BLOCK_BYTES = 4 * GIB

Allocate = Callable[[int], torch.Tensor]  # pinned uint8 tensor of n bytes, or raises RuntimeError


@dataclass(frozen=True)
class PinBudget:
    budget_bytes: int  # bytes the bank may pin
    platform: str  # native | wsl2
    reason: str  # why the budget is what it is (capped, refused at N, no CUDA)


def _pin(n_bytes: int) -> torch.Tensor:
    return torch.empty(n_bytes, dtype=torch.uint8, pin_memory=True)


def measure_pin_budget(cap_bytes: int, platform: str | None = None, allocate: Allocate | None = None) -> PinBudget:
    """Pin growing blocks until failure or `cap_bytes`; everything pinned here is released again.

    `allocate` replaces the real pinned allocation (tests simulate a platform cap with it); without
    it, a torch build without CUDA reports a zero budget.
    """
    platform = platform or detect_platform()
    if allocate is None:
        if not torch.cuda.is_available():
            return PinBudget(0, platform, "pageable (no CUDA)")
        allocate = _pin
    held: list[torch.Tensor] = []
    pinned, block, refusal = 0, MIN_BLOCK_BYTES, ""
    try:
        while pinned < cap_bytes and block >= MIN_BLOCK_BYTES:
            n = min(block, cap_bytes - pinned)
            try:
                held.append(allocate(n))
            except RuntimeError as exc:  # CUDA reports a refused cudaHostAlloc as a RuntimeError
                refusal = str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__
                block //= 2
                continue
            pinned += n
            block = min(2 * block, MAX_BLOCK_BYTES) if not refusal else block
    finally:
        held.clear()
        if allocate is _pin:  # freed pinned blocks stay in torch's host cache, still locked, until emptied
            empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
            if empty_host_cache is not None:
                empty_host_cache()
    if not refusal:
        return PinBudget(pinned, platform, f"pinned the whole {cap_bytes / GIB:.2f} GiB asked for")
    reserve = min(pinned, max(MIN_BLOCK_BYTES, pinned // 16))
    return PinBudget(
        pinned - reserve,
        platform,
        f"the platform refused to pin more than {pinned / GIB:.2f} GiB "
        f"({refusal}); {reserve / GIB:.2f} GiB of it kept as reserve",
    )
