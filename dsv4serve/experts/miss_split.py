"""Where a step's slot misses run, with --moe-backend hybrid: fetched over PCIe to the device path, or
computed on the CPU by kt-kernel from host memory (pure: costs in, experts out).

    cpu = split_misses(miss_tokens, expert_bytes, pinned, costs)   # the experts kt-kernel computes

Both sides run at once (the CPU on its threads while the device fetches and computes), so the split
minimizes the later of the two: fetching an expert costs its bytes over the host-to-device bandwidth
whatever its token count, the CPU's cost grows with the tokens routed to it (`CpuExpertCost`). So the
experts with the most tokens are the ones to fetch: a prefill chunk (many tokens per expert) fetches
nearly everything, a decode step (one token per expert) computes its misses on the CPU unless the
CPU is slower than the copy. The costs are measured at start-up (kt_calibrate.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CpuExpertCost:
    """Seconds kt-kernel takes for one expert with n tokens routed to it: fixed_s + n * per_token_s
    (the fixed part reads the expert's weights from memory; each token adds its GEMV work)."""

    fixed_s: float
    per_token_s: float

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + tokens * self.per_token_s

    def bytes_per_s(self, expert_bytes: int, tokens: int) -> float:
        """The CPU's expert GB/s (weights read per second) at `tokens` per expert."""
        return expert_bytes / self.seconds(tokens)


@dataclass(frozen=True)
class SplitCosts:
    """Measured at start-up. h2d_*: host-to-device bytes/s from pinned and pageable memory, None when the
    device is the CPU itself (a "fetched" miss is then the torch path's own CPU compute, slower than
    kt-kernel: every miss goes to kt-kernel)."""

    cpu: CpuExpertCost
    h2d_pinned_bytes_per_s: float | None
    h2d_pageable_bytes_per_s: float | None

    def fetch_seconds(self, expert_bytes: int, pinned: bool) -> float | None:
        rate = self.h2d_pinned_bytes_per_s if pinned else self.h2d_pageable_bytes_per_s
        return None if rate is None else expert_bytes / rate

    def describe(self, expert_bytes: int) -> str:
        def gbs(rate: float | None) -> str:
            return "n/a (CPU device)" if rate is None else f"{rate / 1e9:.3g} GB/s"

        return (
            f"CPU experts {gbs(self.cpu.bytes_per_s(expert_bytes, 1))} at 1 token/expert, "
            f"{gbs(self.cpu.bytes_per_s(expert_bytes, 16))} at 16; host-to-device "
            f"{gbs(self.h2d_pinned_bytes_per_s)} pinned, {gbs(self.h2d_pageable_bytes_per_s)} pageable"
        )


def split_misses(
    miss_tokens: dict[int, int], expert_bytes: int, pinned: bool, costs: SplitCosts, on_disk: bool = False
) -> set[int]:
    """The misses (expert -> tokens routed to it this step) that kt-kernel computes; the rest are
    fetched. Fetches go to the experts with the most tokens (ties: the lower id), and the split point
    minimizes max(fetch seconds, CPU seconds); an equal cost keeps the expert on the CPU (no copy).
    `on_disk`: the layer's bank part stayed in the checkpoint's shards, so a fetch would page it in from
    disk first (~3 GB/s, memory/decode_speed.py) where kt-kernel reads its own copy in RAM: all on the CPU."""
    fetch_each = costs.fetch_seconds(expert_bytes, pinned)
    if fetch_each is None or on_disk:
        return set(miss_tokens)
    order = sorted(miss_tokens, key=lambda e: (-miss_tokens[e], e))
    cpu_s = sum(costs.cpu.seconds(miss_tokens[e]) for e in order)
    best_n, best_s = 0, cpu_s  # n = how many of `order` are fetched
    for n, e in enumerate(order, start=1):
        cpu_s -= costs.cpu.seconds(miss_tokens[e])
        step_s = max(n * fetch_each, cpu_s)
        if step_s < best_s:
            best_n, best_s = n, step_s
    return set(order[best_n:])


def held_miss_weight(tier_weight: float, costs: SplitCosts, expert_bytes: int) -> float | None:
    """A decode miss's cost in a layer kt-kernel holds, in units of a pinned fetch (the slot cache's residency
    weights, experts/residency.py): the fetch (`tier_weight` pinned fetches) and the CPU at one token per expert
    run in parallel, so 1 / (1 / tier_weight + fetch / CPU). None on a CPU device (nothing is fetched)."""
    fetch = costs.fetch_seconds(expert_bytes, True)
    if fetch is None:
        return None
    return 1 / (1 / tier_weight + fetch / costs.cpu.seconds(1))
