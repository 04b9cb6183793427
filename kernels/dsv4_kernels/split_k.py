"""Split-K in one launch, deterministic: the pieces the GEMM kernels (fp4_moe.py, fp8_gemm.py) share.

A decode GEMM with few output tiles and a long K leaves most SMs idle and each busy one walking K serially
(a weight read at a small share of the bandwidth: bench/gpu_fp4_sweep.py, bench/gpu_fp8_sweep.py). With
SPLIT_K > 1 program axis 2 takes K / SPLIT_K; each program stores its fp32 tile sums into
part[split] ([SPLIT_K, ...] fp32, a scratch buffer) and then `_split_arrive`s: a CTA barrier, one
atomic increment of the tile's counter (acq_rel, GPU scope: the stores before it are visible to whoever
counts after). The program that counts SPLIT_K - 1 is last: `_split_sum` adds the SPLIT_K parts in split
order (the same order whichever program is last, so the bits do not change from run to run), it resets
the counter to 0 and finishes the tile as the unsplit kernel would. No second launch, no memset: the
counters (`split_counters`) stay zeroed between launches and across CUDA graph replays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_ALLOWED = [True]  # the K splits and tuned K-loop forms; off after a failed start-up check


def allow_k_splits(allowed: bool) -> None:
    """Switch the K splits (fp8_gemm, fp8_swiglu, head_logits) and fp4_moe's tuned choices on or off for the
    process: off, every launch the wrappers pick is the unsplit built-in form (dsv4serve's start-up check turns
    them off when a split form does not give the unsplit bits on the device). An explicit split_k still runs."""
    _ALLOWED[0] = allowed


def k_splits_allowed() -> bool:
    return _ALLOWED[0]


_RETIRED: list[torch.Tensor] = []  # outgrown buffers: a captured graph may still point at one


def split_counters(n: int, device: torch.device) -> torch.Tensor:
    """int32 zeros, at least n: one buffer per device that only grows. The kernels leave every counter they
    use at 0 again. Launches that use it run in stream order (the worker's one stream); a split-K GEMM on a
    second stream at the same time would need its own buffer."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)  # 256 KiB: every decode bucket
        _COUNTERS[device] = buf
    return buf


# a narrow decode launch's built-in K split: doubled while the programs stay within SPLIT_TARGET_PROGRAMS (the FP8
# projections with 4-32 tiles measured fastest at splits 8-16 on one H200, bench/RESULTS.md "the second GPU
# session"), at most MAX_SPLIT_K, and a divisor of the K steps
SPLIT_TARGET_PROGRAMS = 128
MAX_SPLIT_K = 8


def split_to_fill(tiles: int, k_steps: int) -> int:
    """The K split for a launch of `tiles` output tiles over `k_steps` K steps: doubled while the programs stay
    within SPLIT_TARGET_PROGRAMS, up to MAX_SPLIT_K, each split a whole number of steps."""
    split = 1
    while split < MAX_SPLIT_K and tiles * split * 2 <= SPLIT_TARGET_PROGRAMS and k_steps % (2 * split) == 0:
        split *= 2
    return split


_UNUSED: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def unsplit_args(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (part, counters) pointers an unsplit launch passes, never read nor written: fp32 and int32, so every
    launch has the pointer types the compile checks build; `torch.empty`, so no launch (the step census)."""
    for dtype in (torch.float32, torch.int32):
        if (device, dtype) not in _UNUSED:
            _UNUSED[device, dtype] = torch.empty(16, dtype=dtype, device=device)
    return _UNUSED[device, torch.float32], _UNUSED[device, torch.int32]


@triton.jit
def _split_arrive(count_ptr, tile, SPLIT_K: tl.constexpr):
    """After this program's part stores: True for the tile's last program to arrive (which resets the
    counter: the reset is ordered after every other program's increment, as they all came first)."""
    tl.debug_barrier()  # every thread's part stores are done before the one atomic releases them
    last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
    if last:
        tl.store(count_ptr + tile, 0)
    return last


@triton.jit
def _split_sum(p_ptrs, p_mask, stride_ps, SPLIT_K: tl.constexpr):
    """The SPLIT_K parts of a tile added in split order; .cg loads read L2, where the other programs' stores
    are (an SM's L1 is not coherent with the others'). A loop, not unrolled: unrolled, the eight parts' loads
    were all in flight at once and the shared expert's two-accumulator epilogue spilled on sm_120."""
    acc = tl.load(p_ptrs, mask=p_mask, other=0.0, cache_modifier=".cg")
    for s in range(1, SPLIT_K):
        acc += tl.load(p_ptrs + s * stride_ps, mask=p_mask, other=0.0, cache_modifier=".cg")
    return acc
