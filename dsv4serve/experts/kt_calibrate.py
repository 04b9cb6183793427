"""Start-up measurements for the hybrid split (miss_split.SplitCosts): kt-kernel's time per expert at 1
and at 16 tokens per expert on a real MoE layer, and the host-to-device bandwidth from pinned and from
pageable memory (None on a CPU device). About a second (DeepSeek-V4-Flash's experts on a loaded 2-core VM:
3 s); the result goes to the start-up log and the worker's ready report (`expert_bank`).
"""

from __future__ import annotations

import time

import torch

from dsv4serve.experts.kt_experts import KtExperts
from dsv4serve.experts.miss_split import CpuExpertCost, SplitCosts

CAL_TOKENS = (1, 16)  # tokens per expert of the two CPU measurements
H2D_BYTES = 64 * 2**20
REPEATS = 3


def _best_of(fn, repeats: int = REPEATS) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def cpu_expert_cost(kt: KtExperts, layer: int) -> CpuExpertCost:
    """Seconds per expert at CAL_TOKENS tokens each: every token routed to the same k experts."""
    g = kt.geometry
    per_expert = []
    for n in CAL_TOKENS:
        x = torch.randn(n, g.dim, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
        ids = torch.arange(g.topk, dtype=torch.int64).expand(n, -1).contiguous()
        weights = torch.full((n, g.topk), 1.0 / g.topk)
        kt.forward(layer, x, ids, weights)  # warm-up (first touch of kt-kernel's buffers)
        per_expert.append(_best_of(lambda x=x, ids=ids, w=weights: kt.forward(layer, x, ids, w)) / g.topk)
    (n0, n1), (s0, s1) = CAL_TOKENS, per_expert
    per_token = max(0.0, (s1 - s0) / (n1 - n0))
    return CpuExpertCost(max(1e-9, s0 - n0 * per_token), per_token)


def h2d_bytes_per_s(device: torch.device, pinned: bool, nbytes: int = H2D_BYTES) -> float | None:
    """Host-to-device copy bandwidth (bytes/s) from pinned or pageable memory; None on a CPU device."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy() -> None:
        dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize(device)

    copy()
    return nbytes / _best_of(copy)


def measure_split_costs(kt: KtExperts, device: torch.device) -> SplitCosts:
    return SplitCosts(
        cpu_expert_cost(kt, kt.layers[0]), h2d_bytes_per_s(device, pinned=True), h2d_bytes_per_s(device, pinned=False)
    )
