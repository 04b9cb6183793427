"""The orthonormal Walsh-Hadamard transform on the CPU in fp32, compiled by numba: numerics.hadamard's
arithmetic, bit for bit, in one call.

With the QAT simulation on, the indexer's queries and its compressor's entries go through a 128-point
transform before their FP4 rounding (~7 calls a dsv4-tiny decode step). As torch ops that is 7 butterfly
stages of ~5 ops each: ~100 us a call at one row, the cost of the calls rather than of the adds. Here: the
same butterflies (a + b and a - b of the same pairs, stage by stage), then the same product by n^-0.5 rounded
to fp32, in a few microseconds. Where numba cannot compile, numerics.hadamard keeps its torch ops (logged).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from dsv4serve.model.numba_loops import compile_loop


def _transform(y: np.ndarray, scale: np.float32) -> None:  # pragma: no cover (runs compiled)
    """In place on y [rows, n] float32 (n a power of two): butterflies (i, i + h) inside blocks of 2h for
    h = 1, 2, 4, ..., n / 2, then y * scale."""
    rows, n = y.shape
    for r in range(rows):
        v = y[r]
        h = 1
        while h < n:
            for start in range(0, n, 2 * h):
                for i in range(start, start + h):
                    a = v[i]
                    b = v[i + h]
                    v[i] = a + b
                    v[i + h] = a - b
            h *= 2
        for i in range(n):
            v[i] = v[i] * scale


WHAT = "Hadamard transform"  # its name in numba_loops' log and doctor's line


@functools.cache
def compiled() -> Callable[[np.ndarray, np.float32], None] | None:
    """The compiled transform (compiled or loaded from numba's cache on the first call); None where numba cannot
    compile it (logged once)."""
    return compile_loop(_transform, (np.ones((1, 2), np.float32), np.float32(0.5)), WHAT, "torch's ops run")


def hadamard_cpu(y: np.ndarray) -> bool:
    """The orthonormal transform over the last dim, in place on y [rows, n] float32 (C-contiguous, n a power of
    two); False (y untouched) where it could not be compiled."""
    if y.dtype != np.float32 or y.ndim != 2 or not y.flags.c_contiguous:
        raise ValueError(f"the compiled transform takes [rows, n] contiguous float32, not {y.dtype} {y.shape}")
    transform = compiled()
    if transform is None:
        return False
    transform(y, np.float32(y.shape[1] ** -0.5))
    return True
