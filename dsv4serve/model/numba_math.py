"""Math the CPU's compiled loops share (model/moe_cpu.py, model/compressor_cpu.py, model/fp8_cpu.py).

`fp8_quant_dequant_row` is numerics.fp8_quant_dequant on one row, bit for bit (tests/unit/test_moe_cpu.py, edges,
ties, subnormal codes, NaN and inf): per block the ue8m0 scale from the block's amax (floored, over the e4m3
maximum, rounded up to a power of two on its bits), each value divided (exact), clamped, rounded to e4m3 to
nearest even (3 mantissa bits on the bits; below 2^-6 multiples of 2^-9, by adding and taking away 2^14, whose fp32
ulp is 2^-9) and multiplied back. NaN propagates as torch's amax and clamp propagate it.

`exp_inplace` is written so that LLVM vectorizes the loops that call it: libm's scalar exp, called element by
element, was ~40% of the routed experts' call.

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


E4M3_MIN_NORMAL_BITS = 0x3C800000  # 2^-6 in fp32: below it e4m3 values are multiples of 2^-9 (subnormals)
SUBNORMAL_SHIFTER = np.float32(2.0**14)  # (a + 2^14) - 2^14 rounds 0 <= a < 2^-6 to a multiple of 2^-9, to even


def fp8_quant_dequant_row(
    v: np.ndarray, block: int, floor: np.float32, fp8_max: np.float32, scratch: np.ndarray
) -> None:  # pragma: no cover (runs compiled)
    """v [K] float32 in place: numerics.fp8_quant_dequant over blocks of `block` (a partial last block its own),
    amax floored at `floor`, e4m3's maximum `fp8_max`. scratch: one float32 (its uint32 view makes the scale)."""
    su = scratch.view(np.uint32)
    u = v.view(np.uint32)
    for b0 in range(0, v.shape[0], block):
        b1 = min(b0 + block, v.shape[0])
        amax = np.float32(0.0)
        for i in range(b0, b1):
            a = abs(v[i])
            if a > amax or a != a:  # NaN sticks (a comparison with NaN is false)
                amax = a
        scratch[0] = (floor if amax < floor else amax) / fp8_max  # NaN passes, as clamp_min's
        su[0] = (su[0] + np.uint32(0x7FFFFF)) & np.uint32(0xFF800000)  # the power of two at or above
        scale = scratch[0]
        for i in range(b0, b1):
            q = v[i] / scale  # exact: a power of two
            q = fp8_max if q > fp8_max else q  # NaN passes, as torch's clamp
            v[i] = -fp8_max if q < -fp8_max else q
        for i in range(b0, b1):  # to e4m3, to nearest even
            b = u[i]
            magnitude = b & np.uint32(0x7FFFFFFF)
            if magnitude < np.uint32(E4M3_MIN_NORMAL_BITS):  # subnormal: multiples of 2^-9
                v[i] = (abs(v[i]) + SUBNORMAL_SHIFTER) - SUBNORMAL_SHIFTER
                u[i] = u[i] | (b & np.uint32(0x80000000))
            elif magnitude <= np.uint32(0x7F800000):  # 3 mantissa bits (NaN is left as it is)
                u[i] = (b + np.uint32(0x7FFFF) + ((b >> np.uint32(20)) & np.uint32(1))) & np.uint32(0xFFF00000)
        for i in range(b0, b1):
            v[i] = v[i] * scale


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
