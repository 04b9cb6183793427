"""Measuring the pin budget: a simulated platform cap stands in for cudaHostAlloc refusing more."""

from __future__ import annotations

import pytest
import torch

from dsv4serve.experts.pinning import GIB, MAX_BLOCK_BYTES, MIN_BLOCK_BYTES, PinBudget, measure_pin_budget


class CappedHost:
    """Hands out fake pinned blocks until `cap` bytes are held, then refuses like CUDA does."""

    def __init__(self, cap: int):
        self.cap, self.held, self.sizes = cap, 0, []

    def __call__(self, n: int) -> torch.Tensor:
        if self.held + n > self.cap:
            raise RuntimeError("CUDA error: out of memory")
        self.held += n
        self.sizes.append(n)
        return torch.empty(0)


def test_a_platform_cap_is_found_and_a_reserve_kept():
    host = CappedHost(int(7.3 * GIB))  # e.g. Docker on WSL2
    budget = measure_pin_budget(100 * GIB, "wsl2", allocate=host)
    assert budget.platform == "wsl2" and "refused" in budget.reason
    assert host.sizes[:3] == [MIN_BLOCK_BYTES, 2 * MIN_BLOCK_BYTES, 4 * MIN_BLOCK_BYTES]
    assert max(host.sizes) <= MAX_BLOCK_BYTES
    assert 6 * GIB <= budget.budget_bytes < host.held <= 7.3 * GIB  # below what the platform gave


def test_the_cap_bounds_the_measurement():
    host = CappedHost(1000 * GIB)
    budget = measure_pin_budget(3 * GIB + 5, "native", allocate=host)
    assert budget == PinBudget(3 * GIB + 5, "native", budget.reason) and host.held == 3 * GIB + 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only build")
def test_a_cpu_only_build_cannot_pin():
    budget = measure_pin_budget(GIB, "native")
    assert budget.budget_bytes == 0 and budget.reason == "pageable (no CUDA)"
