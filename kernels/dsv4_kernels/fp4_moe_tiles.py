"""@triton.jit helpers of the grouped MXFP4 expert GEMM (fp4_moe.py): exact tile arithmetic.

- `_round_bf16`: fp32 -> nearest bf16 value (ties to even) by bits: the interpreter truncates
  fp32->bf16 casts, so both builds round this way.
- `_dequant_e2m1`, `_load_fp4_raw`, `_decode_fp4_joined` / `_decode_fp4_halves`: packed e2m1 codes and their
  e8m0 scale bytes, loaded, then decoded as one tile or its even / odd K halves -> exact fp32
  values (bf16 on a GPU: at most 2 significant bits, exact too).
- `_e2m1_pair_bits`, `_halves_fp16`, `_decode_fp4_words`, `_act_block_scale`, `_act_group`, `_late_scale_group`:
  the late-scale K loop (fp4_moe.py's doc): unscaled fp16 weights decoded from 4-byte words and e4m3 grid values
  per 32 channels, both in the K order that lets a word's codes land in a thread's operand registers as pairs,
  the two scales applied to the dot's sums.
- `_pow2_scale` / `_round_to_e4m3` / `_quantize_rows`: the FP8 activation quantization of
  `fp8_gemm_ref.act_quant_fp8_ref` (per row per 128 channels, scale 2^ceil(log2(max(amax, 1e-4) / 448)),
  q = e4m3(v / scale), ties to even), reproduced exactly: the scale from amax's bits (amax = m 2^E,
  m in [1, 2): 2^(E-8) when m <= 1.75, else 2^(E-7); torch's fp32 amax / 448 never lands on a power
  of two from above, see fp8_gemm.py), v / scale as a product with the exact power 1 / scale, and
  the e4m3 rounding by the hardware cast on a GPU (cvt.rn.satfinite) or, under the interpreter, whose
  fp32->e4m3 cast rounds half up (ROUND_BITS), by an fp32 add / subtract of 2^(E+20), whose ulp is the
  e4m3 quantum at |v|. fp8_gemm.py, fp8_swiglu.py and token_ops_tiles.py call these: one definition.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4_kernels.fp8_gemm_ref import FP8_AMAX_FLOOR

AMAX_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)
# an e2m1 code's exponent and mantissa bits placed at fp16's read 2^-14 of its value (0.5: the subnormal 2^-15)
E2M1_IN_FP16 = tl.constexpr(16384.0)


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still fp32 (finite inputs)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dequant_e2m1(codes, scale):
    """e2m1 codes (int32, 0..15) times fp32 scales -> fp32 values, exact."""
    exp = (codes >> 1) & 3
    man = codes & 1
    mag = tl.where(exp == 0, man * (126 << 23), ((exp + 126) << 23) | (man << 22))  # 0, .5 | 1..6
    bits = mag | ((codes & 8) << 28)  # sign bit 3 -> bit 31
    return bits.to(tl.float32, bitcast=True) * scale


@triton.jit
def _load_fp4_raw(
    w_ptr, ws_ptr, w_off, ws_off, n_ok, offs_kp, k0, K, live, EVEN_K: tl.constexpr, PER_BYTE: tl.constexpr
):
    """The packed bytes [BN, BK/2] of the K tile at k0 and its scale bytes (ws_off: [BN, BK/32] offsets, or
    with PER_BYTE [BN, BK/2], one scale per packed byte, as the even / odd form takes them), loaded, not yet
    decoded; `live` (a scalar) False loads nothing (zeros: the prefetch past the last tile)."""
    w_mask = n_ok[:, None] & live
    ws_mask = w_mask
    if not EVEN_K:
        w_mask = w_mask & (offs_kp < (K - k0) // 2)[None, :]
        if PER_BYTE:
            ws_mask = w_mask
        else:
            ws_mask = ws_mask & (tl.arange(0, offs_kp.shape[0] // 16) < (K - k0) // 32)[None, :]
    packed = tl.load(w_ptr + w_off + k0 // 2, mask=w_mask, other=0)
    s_raw = tl.load(ws_ptr + ws_off + k0 // 32, mask=ws_mask, other=0)
    return packed, s_raw


@triton.jit
def _decode_fp4_joined(packed, s_raw, DOT_FP32: tl.constexpr):
    """Packed [BN, BK/2] bytes and their [BN, BK/32] scale bytes -> the dequantized [BN, BK] tile
    (low nibble = even K). Each scale byte is loaded once and broadcast over its 16 packed bytes."""
    packed = packed.to(tl.int32) & 0xFF
    scale = ((s_raw.to(tl.int32) & 0xFF) << 23).to(tl.float32, bitcast=True)  # 2^(byte-127)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (scale.shape[0], scale.shape[1], 16)), packed.shape)
    w = tl.join(_dequant_e2m1(packed & 0xF, scale), _dequant_e2m1(packed >> 4, scale))
    w = tl.reshape(w, (packed.shape[0], 2 * packed.shape[1]))
    if not DOT_FP32:
        w = w.to(tl.bfloat16)
    return w


@triton.jit
def _decode_fp4_halves(packed, s_raw, DOT_FP32: tl.constexpr):
    """Packed [BN, BK/2] bytes and one scale byte per packed byte [BN, BK/2] -> (even K, odd K) tiles
    [BN, BK/2], dequantized: the two nibbles each become a dot operand as loaded, no join or reshape."""
    packed = packed.to(tl.int32) & 0xFF
    scale = ((s_raw.to(tl.int32) & 0xFF) << 23).to(tl.float32, bitcast=True)
    lo = _dequant_e2m1(packed & 0xF, scale)
    hi = _dequant_e2m1(packed >> 4, scale)
    if not DOT_FP32:
        lo = lo.to(tl.bfloat16)
        hi = hi.to(tl.bfloat16)
    return lo, hi


@triton.jit
def _e2m1_pair_bits(words, A: tl.constexpr):
    """uint32 words of 8 e2m1 codes (code j in bits 4j..4j+3) -> uint32 holding the fp16 bits of codes A (low
    half) and A + 4 (high half), each its value x 2^-14, exact: a code's sign, exponent and mantissa bits moved
    to fp16's (e2m1's subnormal 0.5 lands on fp16's subnormal 2^-15: every code scales alike). Codes A and
    A + 4 sit 16 bits apart, as the two halves do, so one shift places both: mantissa and exponent (bits 0-2
    of a code) at fp16 bits 9-11, sign (bit 3) at bit 15; two shifts and two masks a pair."""
    if A < 3:
        mag, sign = words << (9 - 4 * A), words << (12 - 4 * A)
    else:  # code 3's bits sit above fp16's: shift right (sign bit 15 already in place)
        mag, sign = words >> 3, words
    return (mag & 0x0E000E00) | (sign & 0x80008000)


@triton.jit
def _halves_fp16(pair):
    """uint32 -> (its low, its high) 16 bits as fp16."""
    lo = (pair & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (pair >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _decode_fp4_words(words, DOT_FP32: tl.constexpr):
    """[BN, 4] uint32 words (one 32-channel group a row: code j of word q is channel 8q + j) -> [BN, 32] fp16
    (fp32 with DOT_FP32), each weight's e2m1 value x 2^-14 without its scale (LATE_SCALE), in a permuted K
    order: position 8a + 2q + t holds channel 8q + a + 4t, so that the pairs of K positions a thread holds in
    the dot's operand are the fp16 pairs one word decodes to, with no shuffle (`_act_group` puts the
    activations in the same order; the dot's sum takes any order of K that both operands share)."""
    words = words.to(tl.uint32, bitcast=True)  # logical shifts
    p0 = _halves_fp16(_e2m1_pair_bits(words, 0))  # [BN, 4 (q), 2 (t)]: codes (0, 4) of each word
    p1 = _halves_fp16(_e2m1_pair_bits(words, 1))
    p2 = _halves_fp16(_e2m1_pair_bits(words, 2))
    p3 = _halves_fp16(_e2m1_pair_bits(words, 3))
    w = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [BN, q, t, s1, s2]: code a + 4t, a = 2 s1 + s2
    w = tl.reshape(tl.permute(w, (0, 3, 4, 1, 2)), (words.shape[0], 32))  # position 16 s1 + 8 s2 + 2 q + t
    if DOT_FP32:
        w = w.to(tl.float32)
    return w


@triton.jit
def _pow2_scale(amax):
    """amax fp32 (floored, so normal) -> (s, 1 / s), s = 2^ceil(log2(amax / 448)), from amax's bits."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # 0x600000: mantissa of 1.75
    return (biased << 23).to(tl.float32, bitcast=True), ((254 - biased) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_e4m3(v):
    """fp32 v (|v| <= 448) -> the nearest e4m3 value, ties to even, still fp32."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    # 2^(E+20) for |v| in [2^E, 2^(E+1)), E >= -6 (e4m3's smallest normal exponent): its ulp is 2^(E-3)
    magic = (tl.maximum(mag & 0x7F800000, 121 << 23) + (20 << 23)).to(tl.float32, bitcast=True)
    rounded = (mag.to(tl.float32, bitcast=True) + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | (bits ^ mag)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows(x, AXIS: tl.constexpr, ROUND_BITS: tl.constexpr):
    """x fp32 with one 128-channel block along AXIS (zeros where masked) -> (e4m3 grid values of
    x / scale, fp32 [other axis], scale fp32 [other axis])."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=AXIS), AMAX_FLOOR)
    scale, inv_scale = _pow2_scale(amax)
    v = x * tl.expand_dims(inv_scale, AXIS)  # |v| <= 448 by the choice of scale: no clamp needed
    if ROUND_BITS:
        v = _round_to_e4m3(v)
    else:
        v = v.to(tl.float8e4nv).to(tl.float32)
    return v, scale


@triton.jit
def _block_pow2_scale(a_ptr, a_rows, row_ok, k0, K, stride_am):
    """act_quant's scale (and its inverse) for the rows' 128-channel block holding k0, from the block's amax:
    all 128 channels loaded (x is small and L2-resident), fp32 [BM] each."""
    offs_b = (k0 // 128) * 128 + tl.arange(0, 128)
    blk = tl.load(
        a_ptr + a_rows[:, None] * stride_am + offs_b[None, :],
        mask=row_ok[:, None] & (offs_b < K)[None, :],
        other=0.0,
    )
    amax = tl.maximum(tl.max(tl.abs(blk.to(tl.float32)), axis=1), AMAX_FLOOR)
    return _pow2_scale(amax)


@triton.jit
def _act_tile(
    a_ptr,
    a_scale_ptr,
    a_rows,
    row_ok,
    k0,
    K,
    stride_am,
    stride_asm,
    QUANT_A: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    ROUND_BITS: tl.constexpr,
    STEP: tl.constexpr = 1,
    PHASE: tl.constexpr = 0,
):
    """The activation rows' K tile at k0, dequantized (exact fp32): [BM, BLOCK_K], or with STEP 2 its even
    (PHASE 0) or odd (PHASE 1) columns [BM, BLOCK_K / 2]; e4m3 times its loaded per-128 scale, or (QUANT_A)
    bf16 / fp32 quantized here over the 128-channel block holding the tile."""
    offs_k = k0 + PHASE + STEP * tl.arange(0, BLOCK_K // STEP)
    mask = row_ok[:, None]
    if not EVEN_K:
        mask = mask & (offs_k < K)[None, :]
    a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    if QUANT_A:
        if STEP == 1 and BLOCK_K == 128:  # the tile is the whole block
            q, scale = _quantize_rows(a, 1, ROUND_BITS)
        else:  # the block's amax needs all of its 128 channels
            scale, inv_scale = _block_pow2_scale(a_ptr, a_rows, row_ok, k0, K, stride_am)
            q = a * inv_scale[:, None]
            if ROUND_BITS:
                q = _round_to_e4m3(q)
            else:
                q = q.to(tl.float8e4nv).to(tl.float32)
        return q * scale[:, None]  # exact
    else:
        a_s = tl.load(a_scale_ptr + a_rows * stride_asm + k0 // 128, mask=row_ok, other=0.0)
        return a * a_s[:, None]  # exact


@triton.jit
def _epilogue(
    acc,
    acc3,
    routes,
    row_ok,
    offs_n,
    n_ok,
    pid_n,
    out_ptr,
    out_scale_ptr,
    topk_weight_ptr,
    limit,
    stride_om,
    stride_osm,
    GATE_UP: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    ROUND_BITS: tl.constexpr,
):
    """The tile's sums [BN, BM] (gate and up for GATE_UP) -> bf16 (SwiGLU, routing weight, FP8) stored."""
    out = _round_bf16(acc)  # [BN, BM]
    if GATE_UP:
        up = _round_bf16(acc3)
        if limit > 0:
            out = tl.minimum(out, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        route_w = tl.load(topk_weight_ptr + routes, mask=row_ok, other=0.0)
        out = _round_bf16(route_w[None, :] * (out / (1.0 + tl.exp(-out)) * up))
    o_ptrs = out_ptr + routes.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    o_mask = n_ok[:, None] & row_ok[None, :]
    if QUANT_OUT:  # this tile is the whole 128-channel block pid_n of each route's act row
        q, scale = _quantize_rows(tl.where(n_ok[:, None], out, 0.0), 0, ROUND_BITS)
        tl.store(o_ptrs, q.to(out_ptr.dtype.element_ty), mask=o_mask)
        tl.store(out_scale_ptr + routes.to(tl.int64) * stride_osm + pid_n, scale, mask=row_ok)
    else:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _act_operands(
    a_ptr,
    a_scale_ptr,
    a_rows,
    row_ok,
    k0,
    K,
    stride_am,
    stride_asm,
    QUANT_A: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    ROUND_BITS: tl.constexpr,
    EVEN_ODD: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """The activations' K tile at k0 as the dot's right operand(s), transposed: [BK, BM] (and the same again,
    unused), or with EVEN_ODD its even and odd K columns, [BK/2, BM] each."""
    if EVEN_ODD:
        a0 = _act_tile(
            a_ptr, a_scale_ptr, a_rows, row_ok, k0, K, stride_am, stride_asm, QUANT_A, BLOCK_K, EVEN_K, ROUND_BITS, 2, 0
        )
        a1 = _act_tile(
            a_ptr, a_scale_ptr, a_rows, row_ok, k0, K, stride_am, stride_asm, QUANT_A, BLOCK_K, EVEN_K, ROUND_BITS, 2, 1
        )
    else:
        a0 = _act_tile(
            a_ptr, a_scale_ptr, a_rows, row_ok, k0, K, stride_am, stride_asm, QUANT_A, BLOCK_K, EVEN_K, ROUND_BITS
        )
        a1 = a0
    if not DOT_FP32:
        a0 = a0.to(tl.bfloat16)
        a1 = a1.to(tl.bfloat16)
    return tl.trans(a0), tl.trans(a1)


@triton.jit
def _fp4_dot(packed, s_raw, a0, a1, acc, EVEN_ODD: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + the decoded weight tile @ the activations: one dot on the joined tile, or two on its halves."""
    if EVEN_ODD:
        lo, hi = _decode_fp4_halves(packed, s_raw, DOT_FP32)
        acc = tl.dot(lo, a0, acc)
        acc = tl.dot(hi, a1, acc)
    else:
        acc = tl.dot(_decode_fp4_joined(packed, s_raw, DOT_FP32), a0, acc)
    return acc


@triton.jit
def _act_block_scale(a_ptr, a_scale_ptr, a_rows, row_ok, k0, K, stride_am, stride_asm, QUANT_A: tl.constexpr):
    """The activation rows' scale for the 128-channel block holding k0 and its inverse, fp32 [BM] each: loaded,
    or (QUANT_A) from the block's amax as act_quant chooses it."""
    if QUANT_A:
        scale, inv_scale = _block_pow2_scale(a_ptr, a_rows, row_ok, k0, K, stride_am)
    else:
        scale = tl.load(a_scale_ptr + a_rows * stride_asm + k0 // 128, mask=row_ok, other=0.0)
        inv_scale = scale  # unused: the stored activations are e4m3 grid values already
    return scale, inv_scale


@triton.jit
def _act_group(
    a_ptr, a_rows, row_ok, kg, K, stride_am, inv_scale,
    QUANT_A: tl.constexpr, EVEN_K: tl.constexpr, ROUND_BITS: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """The activations' 32 channels at kg as e4m3 grid values (their block scale not applied: LATE_SCALE),
    transposed for the dot: [32, BM] fp16 (exact: e4m3 values fit fp16), fp32 with DOT_FP32."""
    offs_k = kg + tl.arange(0, 32)
    mask = row_ok[:, None]
    if not EVEN_K:
        mask = mask & (offs_k < K)[None, :]
    a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=mask, other=0.0)
    if QUANT_A:
        q = a.to(tl.float32) * inv_scale[:, None]  # |q| <= 448 by the choice of scale
        if ROUND_BITS:
            q = _round_to_e4m3(q)
        else:
            q = q.to(tl.float8e4nv)
    else:
        q = a
    q = q.to(tl.float32) if DOT_FP32 else q.to(tl.float16)
    # channel 8 w + 4 t + a -> K position 8 a + 2 w + t (`_decode_fp4_words`' order)
    q = tl.reshape(tl.permute(tl.reshape(q, (q.shape[0], 4, 2, 4)), (0, 3, 1, 2)), (q.shape[0], 32))
    return tl.trans(q)


@triton.jit
def _late_scale_group(
    w_base, ws_base, src, stride_we, stride_wse, offs_n, n_ok, stride_wn, stride_wsn, kg, K, a_g, trip,
    EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """trip + (the 32-channel weight group at kg, decoded without its scale) @ a_g, times the weight scale of each
    row: exact products, an exact power-of-two scaling, one fp32 add per output. The K loop multiplies a trip's
    sums by the activations' block scale x 2^14 once (one 128-channel block a trip)."""
    live = n_ok
    if not EVEN_K:
        live = live & (kg < K)
    words_base = (w_base + src * stride_we).to(tl.pointer_type(tl.uint32))  # 4-byte aligned: fp4_moe.py checks
    words = tl.load(
        words_base + offs_n[:, None] * (stride_wn // 4) + kg // 8 + tl.arange(0, 4)[None, :],
        mask=live[:, None],
        other=0,
    )
    s_raw = tl.load(ws_base + src * stride_wse + offs_n * stride_wsn + kg // 32, mask=live, other=0)
    w_scale = ((s_raw.to(tl.int32) & 0xFF) << 23).to(tl.float32, bitcast=True)  # 2^(byte-127)
    part = tl.dot(_decode_fp4_words(words, DOT_FP32), a_g)
    return trip + part * w_scale[:, None]
