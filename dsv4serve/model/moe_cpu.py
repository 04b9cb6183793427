"""The routed experts of a decode step on the CPU's torch path in one numba call: MoE._routed_torch's arithmetic
(gate / up, clamped SwiGLU, routing weight, w2's FP8 input, w2, each token's sum by ascending expert), without its
~70 torch ops a layer.

On dsv4-tiny a layer's routed experts are ~0.35 ms at one decoding row and ~0.75 ms at 16 (of which ~0.05 ms
arithmetic): the per-expert GEMMs, or the stacks' two padded `bmm`, and the glue around them (bincount, sort,
placement, SwiGLU, the FP8 simulation, the sum by pair). Here every pair (token, expert) runs in one call: the
pairs grouped by expert so that each expert's weights are read once, each product a sum over K in ascending order
vectorized across the outputs, which needs the stacks K-major ([E, D, 2I] and [E, I, D], moe_stacked.py).

The roundings are the torch path's: gate and up rounded to the compute dtype (bf16: round to nearest even), the
clamp, silu in fp64 rounded to fp32 (`numerics.in_fp64`: x / (1 + exp(-x))), times up, times the routing weight,
rounded to the compute dtype, the FP8 quantize-dequantize of w2's input in blocks of 128 (`numerics.act_quant`:
ue8m0 scale, e4m3 round to nearest even), w2's product rounded to the compute dtype, and each token's outputs
added in fp32 by ascending expert onto zeros. The sums over K run in ascending order; MKL's run in its own: with
the FP8 / MXFP4 simulation on, products of few significant bits whose fp32 sums do not round on dsv4-tiny, the
values are the torch path's bit for bit (tests/unit/test_moe_cpu.py); without it, within fp32 rounding. No
fast-math (numba_loops): no fused multiply-add, no reordering.

Each row's arithmetic is independent of the other rows (a fixed order), but differs from the one-row GEMMs that
--batch-invariant runs, so MoE uses this call only without batch invariance, on resident dense fp32 experts
(`MoE._compiled_for`). Where numba cannot compile it, the torch path runs (logged; doctor's "CPU loops" line).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from dsv4_kernels.formats import FP8_MAX
from dsv4serve.model.numba_loops import compile_loop
from dsv4serve.model.numba_math import exp_inplace, fp8_quant_dequant_row
from dsv4serve.model.numerics import ACT_BLOCK, FP8_AMAX_FLOOR


def _to_bf16(v: np.ndarray) -> None:  # pragma: no cover (runs compiled)
    """v float32 rounded in place to bf16 values (round to nearest even; NaN stays NaN), as `.to(torch.bfloat16)`."""
    u = v.view(np.uint32)
    for i in range(u.shape[0]):
        b = u[i]
        if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            u[i] = (b | np.uint32(0x00400000)) & np.uint32(0xFFFF0000)
        else:
            u[i] = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)


def _swiglu(
    h: np.ndarray,
    limit: np.float32,
    weight: np.float32,
    out: np.ndarray,
    g64: np.ndarray,
    p64: np.ndarray,
    s64: np.ndarray,
) -> None:  # pragma: no cover (runs compiled)
    """h [2I] float32 (gate, then up) -> out [I] float32: weight * (silu(gate) * up), gate and up clamped first
    (limit > 0), silu in fp64 rounded to fp32 as numerics.in_fp64(F.silu): g / (1 + exp(-g)), exp by
    numba_math.exp_inplace (vectorized; rounded to fp32, torch's values: tests/unit/test_moe_cpu.py checks 2^20
    and the edges). g64, p64, s64: fp64 scratch of I values."""
    inter = out.shape[0]
    for i in range(inter):
        g = h[i]
        if limit > 0:
            g = min(g, limit)
        g64[i] = np.float64(g)
        p64[i] = -g64[i]
    exp_inplace(p64, s64)
    for i in range(inter):
        u = h[inter + i]
        if limit > 0:
            u = min(max(u, -limit), limit)
        silu = np.float32(g64[i] / (1.0 + p64[i]))
        out[i] = weight * (silu * u)


def _routed(
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    w13: np.ndarray,
    w2: np.ndarray,
    limit: np.float32,
    bf16: bool,
    fp8: bool,
    y: np.ndarray,
) -> None:  # pragma: no cover (runs compiled)
    """x [N, D] f32 (w1 / w3's input, already through act_quant), ids [N, k] int64, weights [N, k] f32, w13 [E, D,
    2I] f32 (w1's columns, then w3's), w2 [E, I, D] f32 -> y [N, D] f32 (written): the routed experts' sum."""
    n_tokens, k = ids.shape
    n_experts, dim, two_inter = w13.shape
    inter = two_inter // 2
    pairs = n_tokens * k
    counts = np.zeros(n_experts + 1, np.int64)
    for p in range(pairs):
        e = ids[p // k, p % k]
        if e < 0 or e >= n_experts:
            raise ValueError("an expert id is out of range")
        counts[e + 1] += 1
    for e in range(n_experts):
        counts[e + 1] += counts[e]  # now each expert's first slot in `order`
    order = np.empty(pairs, np.int64)
    fill = counts[:n_experts].copy()
    for p in range(pairs):
        e = ids[p // k, p % k]
        order[fill[e]] = p
        fill[e] += 1
    busiest = 0
    for e in range(n_experts):
        busiest = max(busiest, counts[e + 1] - counts[e])
    h = np.empty((busiest, two_inter), np.float32)
    act = np.empty((busiest, inter), np.float32)
    out = np.empty((pairs, dim), np.float32)  # each pair's w2 product, by pair n * k + j
    scratch = np.empty(1, np.float32)
    g64, p64, s64 = np.empty(inter), np.empty(inter), np.empty(inter)
    for e in range(n_experts):
        first, count = counts[e], counts[e + 1] - counts[e]
        if count == 0:
            continue
        h[:count] = 0.0
        for d in range(dim):  # gate / up: sum over D ascending, across the outputs at once
            row = w13[e, d]
            for m in range(count):
                p = order[first + m]
                xd = x[p // k, d]
                acc = h[m]
                for i in range(two_inter):
                    acc[i] = acc[i] + xd * row[i]
        for m in range(count):
            p = order[first + m]
            hm = h[m]
            if bf16:
                _to_bf16(hm)
            a = act[m]
            _swiglu(hm, limit, weights[p // k, p % k], a, g64, p64, s64)
            if bf16:
                _to_bf16(a)
            if fp8:
                fp8_quant_dequant_row(a, ACT_BLOCK, np.float32(FP8_AMAX_FLOOR), np.float32(FP8_MAX), scratch)
            o = out[p]
            o[:] = 0.0
            for i in range(inter):  # w2: sum over I ascending, across the outputs at once
                ai = a[i]
                row = w2[e, i]
                for c in range(dim):
                    o[c] = o[c] + ai * row[c]
            if bf16:
                _to_bf16(o)
    rank = np.empty(k, np.int64)
    for t in range(n_tokens):  # each token's pairs by ascending expert (stable), added onto zeros
        for j in range(k):  # insertion sort of the k pairs
            m = j
            while m > 0 and ids[t, rank[m - 1]] > ids[t, j]:
                rank[m] = rank[m - 1]
                m -= 1
            rank[m] = j
        for c in range(dim):
            y[t, c] = 0.0
        for j in range(k):
            p = t * k + rank[j]
            for c in range(dim):
                y[t, c] = y[t, c] + out[p, c]


WHAT = "routed experts"  # its name in numba_loops' log and doctor's line


def _sample() -> tuple:
    x = np.zeros((1, 2), np.float32)
    return (
        x,
        np.zeros((1, 1), np.int64),
        np.ones((1, 1), np.float32),
        np.zeros((1, 2, 2), np.float32),
        np.zeros((1, 1, 2), np.float32),
        np.float32(10.0),
        True,
        True,
        np.empty_like(x),
    )


@functools.cache
def compiled() -> Callable[..., None] | None:
    """The compiled loop (compiled or loaded from numba's cache on the first call); None where numba cannot compile
    it on this machine (logged once): MoE then runs the torch path."""
    return compile_loop(
        _routed,
        _sample(),
        WHAT,
        "the routed experts run as torch ops",
        helpers=(_to_bf16, fp8_quant_dequant_row, exp_inplace, _swiglu),
    )


def routed_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    swiglu_limit: float,
    compute_dtype: torch.dtype,
    fp8_act: bool,
) -> torch.Tensor | None:
    """The routed experts' sum [N, D] fp32 of x [N, D] (act_quant's output, any float dtype) over ids / weights
    [N, k], from K-major stacks w13 [E, D, 2I] and w2 [E, I, D] fp32 on the CPU; None where the loop did not
    compile (the caller's torch path serves)."""
    loop = compiled()
    if loop is None:
        return None
    if compute_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the compiled routed experts round to fp32 or bf16, not {compute_dtype}")
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous fp32 CPU stack, got {t.dtype} on {t.device}")
    y = torch.empty(x.shape, dtype=torch.float32, device=w13.device)
    loop(
        x.float().contiguous().numpy(),
        ids.to(torch.int64).contiguous().numpy(),
        weights.float().contiguous().numpy(),
        w13.numpy(),
        w2.numpy(),
        np.float32(swiglu_limit),
        compute_dtype == torch.bfloat16,
        fp8_act,
        y.numpy(),
    )
    return y
