"""@triton.jit helpers of the per-token chains (token_ops.py): each works on a [BLOCK_H, BLOCK_D] fp32 tile,
one row a head (or a token), and reproduces one step of the torch reference (token_ops_ref.py).

- `_inv_rms`: 1 / sqrt(sum(x^2) / D + eps) with a correctly rounded sqrt and divide (torch's CPU rsqrt);
  only the sum's order differs from torch's.
- `_angles` / `_rotate`: RoPE on interleaved pairs of the trailing channels; cos / sin loaded from tables or
  evaluated from fp32 angles (libdevice cosf / sinf on a GPU, numpy's fp32 cos / sin under the interpreter).
- `_fp8_blocks` / `_fp4_blocks`: quantize-dequantize per block with ue8m0 scales, by bits (no hardware
  cast, which the interpreter rounds differently): the scale from amax's bits (amax = m 2^E, m in [1, 2):
  FP8 2^(E-8) when m <= 1.75 else 2^(E-7); FP4 2^(E-2) when m <= 1.5 else 2^(E-1); torch's fp32
  amax / max never lands on a power of two from above), v / s as a product with the exact 1 / s, and the
  rounding to the e4m3 / e2m1 grid by an fp32 add / subtract of a power of two whose ulp is the grid's
  quantum at |v| (ties to even, as torch's cast and `formats.round_e2m1`).
- `_hadamard`: the orthonormal Walsh-Hadamard butterflies in the reference's stage order (exact same sums).
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4_kernels.fp4_moe_tiles import _pow2_scale, _round_bf16, _round_to_e4m3
from dsv4_kernels.fp8_gemm_ref import FP8_AMAX_FLOOR
from dsv4_kernels.token_ops_ref import FP4_AMAX_FLOOR

FP8_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)
FP4_FLOOR = tl.constexpr(FP4_AMAX_FLOOR)

__all__ = [
    "_angles", "_fp4_blocks", "_fp8_blocks", "_hadamard", "_inv_rms", "_inv_rms_of_sum", "_rotate", "_round_bf16",
]  # fmt: skip


@triton.jit
def _inv_rms(x, D: tl.constexpr, eps):
    """x [BH, BD] fp32 (zeros past D) -> [BH] 1 / sqrt(mean(x^2) + eps)."""
    return _inv_rms_of_sum(tl.sum(x * x, axis=1), D, eps)


@triton.jit
def _inv_rms_of_sum(sum_sq, D, eps):
    """Rows' sums of squares over D channels -> 1 / sqrt(sum_sq / D + eps), the divide and sqrt correctly rounded
    (a caller summing a row tile by tile, as hc_mix's fused norm does, shares the rest of `_inv_rms`)."""
    mean_sq = tl.div_rn(sum_sq, D * 1.0)
    return tl.div_rn(tl.full(mean_sq.shape, 1.0, tl.float32), tl.sqrt_rn(mean_sq + eps))


@triton.jit
def _angles(
    rows,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    freq_ptr,
    stride_cs,
    window,
    D: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FROM_POSITIONS: tl.constexpr,
    INVERSE: tl.constexpr,
):
    """cos, sin [BR, BLOCK_D / 2] of the table rows (token indices) `rows` [BR] for pair i (channels 2i, 2i + 1),
    and the mask [BLOCK_D / 2] of the rotated pairs: the trailing ROPE_DIM / 2 pairs of the D channels (cos 1,
    sin 0 elsewhere). Every element is its row's own: a row's values never depend on the rows beside it."""
    pair = tl.arange(0, BLOCK_D // 2)
    j = pair - (D - ROPE_DIM) // 2  # index into the rope frequencies
    rotated = (j >= 0) & (pair < D // 2)
    j = tl.where(rotated, j, 0)
    if FROM_POSITIONS:
        pos = tl.load(pos_ptr + rows)
        pos = (pos // window) * window  # a compressor entry rotates at its window's first position
        angle = pos.to(tl.float32)[:, None] * tl.load(freq_ptr + j, mask=rotated, other=0.0)[None, :]
        cos = tl.where(rotated[None, :], tl.cos(angle), 1.0)
        sin = tl.where(rotated[None, :], tl.sin(angle), 0.0)
    else:
        at = rows.to(tl.int64)[:, None] * stride_cs + j[None, :]
        cos = tl.load(cos_ptr + at, mask=rotated[None, :], other=1.0)
        sin = tl.load(sin_ptr + at, mask=rotated[None, :], other=0.0)
    if INVERSE:
        sin = -sin
    return cos, sin, rotated


@triton.jit
def _rotate(x, cos, sin, rotated, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_BF16: tl.constexpr):
    """x [BH, BD]: pairs (x[2i], x[2i+1]) with rotated[i] become (e c - o s, e s + o c) (cos / sin [BH, BD / 2],
    `_angles`), rounded to bf16 when ROUND_BF16; the other pairs stay as they are (bit for bit)."""
    even, odd = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_D // 2, 2)))
    new_even = even * cos - odd * sin
    new_odd = even * sin + odd * cos
    if ROUND_BF16:
        new_even, new_odd = _round_bf16(new_even), _round_bf16(new_odd)
    keep = rotated[None, :]
    return tl.reshape(tl.join(tl.where(keep, new_even, even), tl.where(keep, new_odd, odd)), (BLOCK_H, BLOCK_D))


@triton.jit
def _fp8_blocks(x, LIMIT: tl.constexpr, QB: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """e4m3 quantize-dequantize of channels < LIMIT in blocks of QB (a partial last block on its own);
    channels >= LIMIT are returned unchanged."""
    inside = (tl.arange(0, BLOCK_D) < LIMIT)[None, :]
    blocks = tl.reshape(tl.where(inside, x, 0.0), (BLOCK_H, BLOCK_D // QB, QB))
    amax = tl.maximum(tl.max(tl.abs(blocks), axis=2), FP8_FLOOR)
    scale, inv_scale = _pow2_scale(amax)
    v = tl.minimum(tl.maximum(blocks * inv_scale[:, :, None], -448.0), 448.0)
    q = tl.reshape(_round_to_e4m3(v) * scale[:, :, None], (BLOCK_H, BLOCK_D))
    return tl.where(inside, q, x)


@triton.jit
def _round_e2m1(v):
    """fp32 v (|v| <= 6) -> the nearest e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6), ties to even, sign kept."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    # 2^(E+22) for |v| in [2^E, 2^(E+1)), E >= 0 (below 1 the quantum stays 0.5): its ulp is 2^(E-1)
    magic = (tl.maximum(mag & 0x7F800000, 127 << 23) + (22 << 23)).to(tl.float32, bitcast=True)
    rounded = (mag.to(tl.float32, bitcast=True) + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | (bits ^ mag)).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_blocks(x, LIMIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """e2m1 quantize-dequantize of channels < LIMIT in blocks of 32 (ue8m0 scales, amax floor 6 * 2^-126)."""
    inside = (tl.arange(0, BLOCK_D) < LIMIT)[None, :]
    blocks = tl.reshape(tl.where(inside, x, 0.0), (BLOCK_H, BLOCK_D // 32, 32))
    amax = tl.maximum(tl.max(tl.abs(blocks), axis=2), FP4_FLOOR)
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) - 2 + ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)  # 0x400000: mantissa of 1.5
    scale = (biased << 23).to(tl.float32, bitcast=True)
    inv_scale = ((254 - biased) << 23).to(tl.float32, bitcast=True)
    v = tl.minimum(tl.maximum(blocks * inv_scale[:, :, None], -6.0), 6.0)
    q = tl.reshape(_round_e2m1(v) * scale[:, :, None], (BLOCK_H, BLOCK_D))
    return tl.where(inside, q, x)


@triton.jit
def _hadamard(x, scale, STAGES: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """x [BH, BD] -> the Walsh-Hadamard transform of each row's first 2^STAGES channels, times `scale`
    (channels past them, zeros, stay zeros): stage h turns the pairs (i, i + h) of each block of 2h into
    (a + b, a - b), in the reference's order, so every sum is the reference's."""
    for stage in tl.static_range(STAGES):
        quad = tl.reshape(x, (BLOCK_H, BLOCK_D // (2 << stage), 2, 1 << stage))  # h = 2^stage
        quad = tl.permute(quad, (0, 1, 3, 2))
        a, b = tl.split(quad)  # [BH, BD / 2h, h]: the first and second halves of each block
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BLOCK_H, BLOCK_D))
    return x * scale
