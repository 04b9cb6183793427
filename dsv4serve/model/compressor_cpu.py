"""A compressor's decode update on the CPU's torch path up to its pooled windows, in one numba call: the ~45 torch
ops of Compressor.update_decode before `_finish` (carry writes, the window's rows, the overlap's previous half,
the softmax pooling in fp64), ~0.15 ms a call at one row on dsv4-tiny, 5 calls a step.

Row by row, as the torch ops do it for all rows at once (each row its own sequence slot): the token's kv and
score (gate + ape[p % ratio], fp32) written to carry row p % ratio; an overlapping (CSA) compressor's previous
half read (zeros and -inf before the first window), then replaced by this window's A half where the window closes;
the window's slots ([previous half; B half] or the ratio carry rows) pooled per channel: softmax over the slots
in fp64 rounded to fp32 (`numerics.in_fp64`; exp by numba_math.exp_inplace), times kv, summed over the slots in
ascending order in fp32 from zero, which is torch's `sum(dim=1)` order here: bit for bit the torch ops' pooled
windows and carry (tests/model/test_compressor_cpu.py). Used without batch invariance (Compressor.update_decode),
as moe_cpu.py; torch's ops where numba cannot compile (logged; doctor's "CPU loops" line).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from dsv4serve.model.numba_loops import compile_loop
from dsv4serve.model.numba_math import exp_inplace


def _carry_pool(
    kv: np.ndarray,
    gate: np.ndarray,
    ape: np.ndarray,
    pos: np.ndarray,
    slots: np.ndarray,
    pending_kv: np.ndarray,
    pending_score: np.ndarray,
    prev_kv: np.ndarray,
    prev_score: np.ndarray,
    overlap: bool,
    pooled: np.ndarray,
) -> None:  # pragma: no cover (runs compiled)
    """kv / gate [B, C] f32 (C = 2d overlapping, else d), ape [ratio, C] f32, pos / slots [B] int64, the carry
    pending_* [S, ratio, C] and prev_* [S, ratio, d] f32 (updated in place; prev_* unused without overlap) ->
    pooled [B, d] f32: each row's current window pooled."""
    n_rows, width = kv.shape
    ratio = pending_kv.shape[1]
    d = pooled.shape[1]
    slots_in = 2 * ratio if overlap else ratio
    win_kv = np.empty((slots_in, d), np.float32)
    win_score = np.empty((slots_in, d), np.float64)
    top = np.empty(d)
    total = np.empty(d)
    s64 = np.empty(d)
    for b in range(n_rows):
        s, p = slots[b], pos[b]
        j = p % ratio
        for c in range(width):
            pending_kv[s, j, c] = kv[b, c]
            pending_score[s, j, c] = gate[b, c] + ape[j, c]
        if overlap:
            has_prev = p // ratio > 0
            for r in range(ratio):  # the previous window's A half, as it was before this token
                for c in range(d):
                    win_kv[r, c] = prev_kv[s, r, c] if has_prev else np.float32(0.0)
                    win_score[r, c] = np.float64(prev_score[s, r, c]) if has_prev else -np.inf
                    win_kv[ratio + r, c] = pending_kv[s, r, d + c]  # this window's B half
                    win_score[ratio + r, c] = np.float64(pending_score[s, r, d + c])
            if j == ratio - 1:  # the window closes: its A half is the next window's previous half
                for r in range(ratio):
                    for c in range(d):
                        prev_kv[s, r, c] = pending_kv[s, r, c]
                        prev_score[s, r, c] = pending_score[s, r, c]
        else:
            for r in range(ratio):
                for c in range(d):
                    win_kv[r, c] = pending_kv[s, r, c]
                    win_score[r, c] = np.float64(pending_score[s, r, c])
        for c in range(d):  # softmax over the slots in fp64, per channel
            top[c] = win_score[0, c]
        for r in range(1, slots_in):
            for c in range(d):
                top[c] = max(top[c], win_score[r, c])
        for c in range(d):
            total[c] = 0.0
        for r in range(slots_in):
            row = win_score[r]
            for c in range(d):
                row[c] = row[c] - top[c]
            exp_inplace(row, s64)
            for c in range(d):
                total[c] = total[c] + row[c]
        for c in range(d):
            pooled[b, c] = 0.0
        for r in range(slots_in):
            for c in range(d):
                pooled[b, c] = pooled[b, c] + win_kv[r, c] * np.float32(win_score[r, c] / total[c])


WHAT = "compressor decode update"  # its name in numba_loops' log and doctor's line


def _sample() -> tuple:
    carry = np.zeros((1, 4, 2), np.float32)
    return (
        np.zeros((1, 2), np.float32),
        np.zeros((1, 2), np.float32),
        np.zeros((4, 2), np.float32),
        np.zeros(1, np.int64),
        np.zeros(1, np.int64),
        carry,
        carry.copy(),
        carry[:, :, :1].copy(),
        carry[:, :, :1].copy(),
        True,
        np.empty((1, 1), np.float32),
    )


@functools.cache
def compiled() -> Callable[..., None] | None:
    """The compiled update (compiled or loaded from numba's cache on the first call); None where numba cannot compile
    it on this machine (logged once): the compressor then runs its torch ops."""
    return compile_loop(_carry_pool, _sample(), WHAT, "the compressors' torch ops run", helpers=(exp_inplace,))


def carry_and_pool(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    pos: torch.Tensor,
    slots: torch.Tensor,
    carry: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    head_dim: int,
) -> torch.Tensor | None:
    """The decode update's carry writes and each row's pooled window [B, head_dim] fp32 (module doc), the carry
    (pending_kv, pending_score, prev_kv, prev_score: contiguous fp32 CPU tensors, prev_* None without overlap)
    updated in place; None (nothing touched) where the loop did not compile or a tensor does not fit it."""
    loop = compiled()
    pending_kv, pending_score, prev_kv, prev_score = carry
    overlap = prev_kv is not None and prev_score is not None
    state = [pending_kv, pending_score] + ([prev_kv, prev_score] if overlap else [])
    if loop is None or any(
        t is None or t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in state
    ):
        return None
    pooled = torch.empty(kv.shape[0], head_dim, dtype=torch.float32, device=pending_kv.device)
    unused = np.zeros((1, 1, 1), np.float32)
    loop(
        kv.float().contiguous().numpy(),
        gate.float().contiguous().numpy(),
        ape.detach().float().contiguous().numpy(),
        pos.to(torch.int64).contiguous().numpy(),
        slots.to(torch.int64).contiguous().numpy(),
        pending_kv.numpy(),
        pending_score.numpy(),
        prev_kv.numpy() if prev_kv is not None else unused,
        prev_score.numpy() if prev_score is not None else unused,
        overlap,
        pooled.numpy(),
    )
    return pooled
