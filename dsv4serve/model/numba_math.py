"""Math the CPU's compiled loops share (model/moe_cpu.py, model/compressor_cpu.py), written so that LLVM vectorizes
the loops that call it: libm's scalar exp, called element by element, was ~40% of the routed experts' call.

`exp_inplace` computes exp in fp64 as p(r) * 2^k: k = rint(x / ln 2), r = x - k ln 2 with ln 2 in two parts (fdlibm's
split: k * LN2_HI is exact for |k| < 2^20), p the Taylor polynomial of degree 13 on |r| <= ln 2 / 2 (its remainder
below 2^-57 there), 2^k made from its exponent bits. Within a few fp64 ulp of exp: the loops that use it round
fp64 results to fp32 (the torch path's `numerics.in_fp64`), where that difference shows only on a value within a
few fp64 ulp of a tie between two fp32 values (about one in 2^25); their tests check 2^20 values and the edges
bit for bit against torch.
"""

from __future__ import annotations

import math

import numpy as np

LOG2E = 1.4426950408889634
LN2_HI = 6.93147180369123816490e-01  # ln 2 = LN2_HI + LN2_LO (fdlibm)
LN2_LO = 1.90821492927058770002e-10
EXP_TAYLOR = np.array([1.0 / math.factorial(j) for j in range(14)])  # exp's Taylor coefficients, degree 13
ONE_BITS = 0x3FF << 52  # 1.0 in fp64
EXP_MIN, EXP_MAX = -745.0, 710.0  # below: exp underflows past fp64's subnormals (returned 0); above: inf


def exp_inplace(x: np.ndarray, s64: np.ndarray) -> None:  # pragma: no cover (runs compiled)
    """x [n] float64 -> exp(x) in place. s64: float64 scratch of n values (its int64 view holds 2^k's bits).
    Below EXP_MIN the result is +0.0 (fp64's subnormals are not made: a caller adding it to 1 or to a sum of
    larger terms sees no difference), NaN stays NaN."""
    k64 = s64.view(np.int64)
    for i in range(x.shape[0]):
        v = x[i]
        c = min(max(v, EXP_MIN), EXP_MAX)
        k = np.rint(c * LOG2E)
        r = (c - k * LN2_HI) - k * LN2_LO
        p = EXP_TAYLOR[13]
        for j in range(12, -1, -1):
            p = p * r + EXP_TAYLOR[j]
        nan = v != v  # selected, not branched (the loop vectorizes): NaN stays NaN, times 1.0
        x[i] = v if nan else p
        k64[i] = ONE_BITS if nan else min(max(np.int64(k) + 1023, 0), 2047) << 52  # 2^k (0: +0.0, 2047: inf)
    for i in range(x.shape[0]):
        x[i] = x[i] * s64[i]
