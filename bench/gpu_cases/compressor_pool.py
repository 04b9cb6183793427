"""GPU cases for the compressor pooling kernel at DeepSeek-V4-Flash's dimensions: the CSA main
compressor (d = 512) and the indexer's (d = 128), both overlapping (8 slots per window), and HCA
(d = 512, 128 slots). Decode closes at most one window per request per step (batch 32 -> 32
windows); a prefill chunk of 8192 tokens closes 2048 CSA or 64 HCA windows.

Tolerance: the reference is fp64; the kernel's fp32 error is at most ~(2L + 20) * 2^-23 of
sum_l p_l |kv_l| (tests/kernels/test_compressor_pool.py), below 1e-4 for unit-scale kv at L = 128.
"""

from __future__ import annotations

import torch

from bench.gpu_cases import GpuCase
from dsv4_kernels.compressor_pool import compressor_pool
from dsv4_kernels.compressor_pool_ref import compressor_pool_ref


def _case(name: str, n_windows: int, slots: int, d: int, device: torch.device, seed: int) -> GpuCase:
    gen = torch.Generator(device=device).manual_seed(seed)
    kv = torch.randn(n_windows, slots, d, generator=gen, device=device)
    score = torch.randn(n_windows, slots, d, generator=gen, device=device) * 4
    if slots == 8:  # the first window of a sequence has no previous half
        score[0, :4] = float("-inf")
        kv[0, :4] = 0.0
    return GpuCase(
        name=name,
        run=lambda: compressor_pool(kv, score),
        reference=lambda: compressor_pool_ref(kv, score),
        atol=1e-4,
        rtol=1e-4,
        bytes_moved=(2 * slots + 1) * n_windows * d * 4,
        baseline=lambda: (kv * score.softmax(dim=1)).sum(dim=1),  # the model's expression in fp32
        baseline_name="torch softmax + sum",
    )


def cases(device: torch.device) -> list[GpuCase]:
    out = []
    for label, slots, d, prefill_windows in (
        ("csa d=512", 8, 512, 2048),
        ("csa indexer d=128", 8, 128, 2048),
        ("hca d=512", 128, 512, 64),
    ):
        out.append(_case(f"compressor_pool {label} decode b=32", 32, slots, d, device, seed=slots + d))
        out.append(
            _case(f"compressor_pool {label} prefill 8192 tokens", prefill_windows, slots, d, device, seed=slots * d)
        )
    return out


def smoke_cases(device: torch.device) -> list[GpuCase]:
    """Tiny shapes for the CPU interpreter: a few windows of each kind at small widths."""
    return [
        _case("compressor_pool tiny csa", 3, 8, 64, device, seed=1),
        _case("compressor_pool tiny hca", 2, 128, 32, device, seed=2),
    ]
