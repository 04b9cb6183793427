"""mHC's Sinkhorn rounds on the CPU, compiled by numba: the torch rounds' arithmetic (hc.sinkhorn_rounds), bit
for bit, in one call.

On the CPU the 20 rounds of a [N, 4, 4] fp32 matrix are ~120 tiny ops: ~100 us in numpy (the per-call cost
of a ufunc, not arithmetic), ~2 us here at one row and ~10 us at 16, for each of a step's 2 sites a layer.
The same IEEE fp32 operations in the same order as torch: each column (row) sum adds its 4 terms left to right
(as torch's CPU sum does for 4 terms: tests/unit/test_hc_sinkhorn.py), then eps; every entry is divided by
its sum. numba compiles without fast-math, and there is no product that a compiler could fuse.

numba compiles on the first use (~0.3-0.5 s) and keeps the machine code in its cache beside this file
(`cache=True`) for the next process; model loading calls `compiled` so that no step pays it. Where numba
cannot compile, the torch rounds run instead (logged).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from dsv4serve.model.numba_loops import compile_loop

HC = 4  # DeepSeek-V4's hc_mult: the order of 4-term sums is the one checked against torch's


def rounds_loop(comb: np.ndarray, n_iters: int, eps: np.float32) -> None:  # pragma: no cover (runs compiled)
    """In place on comb [N, 4, 4] float32 (C-contiguous): a column round, then (n_iters - 1) row + column
    rounds, as hc.sinkhorn_rounds."""
    for r in range(comb.shape[0]):
        c = comb[r]
        for it in range(max(n_iters, 1)):  # torch's rounds: a column round even for n_iters < 1
            if it > 0:
                for i in range(HC):
                    s = c[i, 0] + c[i, 1]
                    s = s + c[i, 2]
                    s = s + c[i, 3]
                    s = s + eps
                    for k in range(HC):
                        c[i, k] = c[i, k] / s
            for k in range(HC):
                s = c[0, k] + c[1, k]
                s = s + c[2, k]
                s = s + c[3, k]
                s = s + eps
                for i in range(HC):
                    c[i, k] = c[i, k] / s


WHAT = "mHC Sinkhorn rounds"  # its name in numba_loops' log and doctor's line


@functools.cache
def compiled() -> Callable[[np.ndarray, int, np.float32], None] | None:
    """The compiled rounds, compiled (or loaded from numba's cache) on the first call; None when numba cannot
    compile them on this machine (logged once): hc.sinkhorn then runs torch's rounds, the same values."""
    return compile_loop(
        rounds_loop, (np.full((1, HC, HC), 0.25, np.float32), 1, np.float32(1e-6)), WHAT, "torch's rounds run"
    )


def supports(comb: np.ndarray) -> bool:
    """Whether `sinkhorn_rounds_cpu` takes this array: [N, 4, 4] float32, C-contiguous."""
    return comb.dtype == np.float32 and comb.shape[1:] == (HC, HC) and comb.flags.c_contiguous


def sinkhorn_rounds_cpu(comb: np.ndarray, n_iters: int, eps: float) -> bool:
    """hc.sinkhorn_rounds in place on comb [N, 4, 4] float32 (`supports`), in one compiled call; False (comb
    untouched) when the rounds could not be compiled here."""
    if not supports(comb):
        raise ValueError(f"the compiled rounds take [N, {HC}, {HC}] contiguous float32, not {comb.dtype} {comb.shape}")
    rounds = compiled()
    if rounds is None:
        return False
    rounds(comb, n_iters, np.float32(eps))
    return True
