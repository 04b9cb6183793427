"""@triton.jit helpers of the mHC kernel (hc_mix.py, whose module doc has the contract and the layout): the
mixes' columns and sums (one launch, or split K: the partial sums and their fixed-order total), the Sinkhorn
rounds, the collapse to x, the pre / head form and the post form.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4_kernels.fp4_moe_tiles import _round_bf16  # the one bf16 rounding every kernel uses
from dsv4_kernels.token_ops_tiles import _inv_rms_of_sum  # token_ops' rms_norm factor, summed tile by tile here

SPLIT_CHUNK = 16  # partial rows PHASE 2 adds per step
_SPLIT_CHUNK = tl.constexpr(SPLIT_CHUNK)  # the kernels' view of it


@triton.jit
def _mix_columns(HC: tl.constexpr, HCP: tl.constexpr, MODE: tl.constexpr):
    """The fn row behind each of the 2 HCP^2 accumulator columns, and whether there is one. Column
    (half, r, k): half 0 is comb logit (r, k), fn row 2 HC + r HC + k; half 1 row r = 0 is pre k (fn
    row k), r = 1 post k (fn row HC + k). The head has the pre columns only."""
    c = tl.arange(0, 2 * HCP * HCP)
    half = c // (HCP * HCP)
    r = (c // HCP) % HCP
    k = c % HCP
    row = tl.where(half == 0, 2 * HC + r * HC + k, r * HC + k)
    if MODE == 0:
        ok = (k < HC) & (((half == 0) & (r < HC)) | ((half == 1) & (r < 2)))
    else:
        ok = (k < HC) & (half == 1) & (r == 0)
    return row, ok


@triton.jit
def _mix_sums(
    h_ptr, fn_ptr, offs_n, n_ok, D, stride_hn, HC, HCP, MODE, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT
):
    """Over the flat rows (K = HC * D) of BLOCK_N tokens: (fn . flat(h) [BLOCK_N, 2 HCP^2], sum of
    squares [BLOCK_N]), both fp32."""
    K = HC * D
    row, col_ok = _mix_columns(HC, HCP, MODE)
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + offs_n.to(tl.int64)[:, None] * stride_hn + offs_k[None, :]  # [BN, BK]
    f_ptrs = fn_ptr + row[None, :] * K + offs_k[:, None]  # [BK, columns]: fn^T
    acc = tl.zeros((BLOCK_N, 2 * HCP * HCP), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        h = tl.load(h_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        f = tl.load(f_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        hf = h.to(tl.float32)
        sumsq += tl.sum(hf * hf, axis=1)
        if DOT == 2:  # bf16 h: fn = hi + mid + lo exactly, each part times h exact in the fp32 sum
            hi = f.to(tl.bfloat16)
            rest = f - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(h, lo, acc)  # the smallest part first
            acc = tl.dot(h, mid, acc)
            acc = tl.dot(h, hi, acc)
        elif DOT == 1:
            acc = tl.dot(hf, f, acc, input_precision="ieee")
        else:  # one token: the fp32 products on the FMA units
            acc += tl.sum(hf[:, :, None] * f[None, :, :], axis=1)
    return acc, sumsq


@triton.jit
def _partial_sums(
    h_ptr, fn_ptr, part_ptr, N, D, stride_hn, stride_qn, HC, HCP, MODE,
    BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """PHASE 1, program (token block b, split s): the mixes and the sums of squares of BLOCK_N tokens over
    the flat-row values s SPLIT_K .. (s + 1) SPLIT_K - 1 -> part[n, s, :2 HCP^2] and part[n, s, 2 HCP^2]
    (on the FMA units: a GPU runs one token a program; the interpreter's blocks of 16 save Python time)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    s = tl.program_id(1)
    K = HC * D
    row, col_ok = _mix_columns(HC, HCP, MODE)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, 2 * HCP * HCP), dtype=tl.float32)
    sq = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for i in tl.static_range(SPLIT_K // BLOCK_K):
        kk = s * SPLIT_K + i * BLOCK_K + offs_k
        k_ok = kk < K
        h = tl.load(h_ptr + n64[:, None] * stride_hn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        h = h.to(tl.float32)
        f = tl.load(fn_ptr + row[None, :] * K + kk[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(h[:, :, None] * f[None, :, :], axis=1)
        sq += h * h
    base = part_ptr + n64[:, None] * stride_qn + s * (2 * HCP * HCP + 1)  # [BN, 1]
    tl.store(base + tl.arange(0, 2 * HCP * HCP)[None, :], acc, mask=n_ok[:, None])
    tl.store(base + 2 * HCP * HCP, tl.sum(sq, axis=1)[:, None], mask=n_ok[:, None])


@triton.jit
def _sum_partials(part_ptr, offs_n, n_ok, stride_qn, n_splits, HCP, BLOCK_N: tl.constexpr, SPLIT_CHUNK: tl.constexpr):
    """PHASE 2: the partial rows of the program's tokens summed split by split (a fixed order) ->
    (mixes [BLOCK_N, 2 HCP^2], sum of squares [BLOCK_N])."""
    cols = tl.arange(0, 2 * HCP * HCP)
    offs_s = tl.arange(0, SPLIT_CHUNK)
    n64 = offs_n.to(tl.int64)
    acc = tl.zeros((BLOCK_N, 2 * HCP * HCP), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s0 in range(0, n_splits, SPLIT_CHUNK):
        s_ok = offs_s < n_splits - s0
        rows = part_ptr + n64[:, None] * stride_qn + (s0 + offs_s)[None, :] * (2 * HCP * HCP + 1)  # [BN, SC]
        ok = n_ok[:, None] & s_ok[None, :]
        acc += tl.sum(tl.load(rows[:, :, None] + cols[None, None, :], mask=ok[:, :, None], other=0.0), axis=1)
        sumsq += tl.sum(tl.load(rows + 2 * HCP * HCP, mask=ok, other=0.0), axis=1)
    return acc, sumsq


@triton.jit
def _sinkhorn(logits, valid, n_iters, eps):
    """[BN, HCP, HCP] logits (entries outside `valid` ignored, returned 0): a softmax over each row,
    + eps, a column normalization, then n_iters - 1 rounds of row and column normalization."""
    z = tl.where(valid, logits, float("-inf"))
    top = tl.max(z, axis=2)
    top = tl.where(top == float("-inf"), 0.0, top)  # a padding row
    e = tl.exp(z - top[:, :, None])
    total = tl.sum(e, axis=2)
    total = tl.where(total > 0.0, total, 1.0)
    comb = tl.where(valid, e / total[:, :, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    for _ in range(n_iters - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    return comb


@triton.jit
def _collapsed(pre, h_ptrs, rows_ok, d_ok, d0, x_ptr, ROUND_BF16):
    """x = sum_k pre[n, k] h[n, k] over one [BN, BD] tile of channels, as x's dtype stores it (fp32 values)."""
    h = tl.load(h_ptrs + d0, mask=rows_ok & d_ok[None, None, :], other=0.0).to(tl.float32)
    x = tl.sum(h * pre[:, :, None], axis=1)  # [BN, BD]
    if ROUND_BF16:
        x = _round_bf16(x)
    return x.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _collapse(
    pre, offs_n, n_ok, h_ptr, x_ptr, nw_ptr, D, stride_hn, stride_xn, x_eps, HC, HCP, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, ROUND_BF16, NORM: tl.constexpr,
):  # fmt: skip
    """x[n] = sum_k pre[n, k] h[n, k] for the program's tokens, BLOCK_D channels at a time. NORM: the sub-layer's
    RMSNorm follows in the same program (the module doc's fused form): a first pass sums the squares of x as
    stored, a second recomputes x (the same bits) and stores nw * (x * r), r = 1 / sqrt(mean(x^2) + x_eps), as
    token_ops' rms_norm computes it (only the order of the squares' sum differs)."""
    k = tl.arange(0, HCP)
    offs_d = tl.arange(0, BLOCK_D)
    n64 = offs_n.to(tl.int64)
    h_ptrs = h_ptr + n64[:, None, None] * stride_hn + k[None, :, None] * D + offs_d[None, None, :]
    rows_ok = n_ok[:, None, None] & (k < HC)[None, :, None]
    x_ptrs = x_ptr + n64[:, None] * stride_xn + offs_d[None, :]
    if NORM:
        sumsq = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            x = _collapsed(pre, h_ptrs, rows_ok, offs_d < D - d0, d0, x_ptr, ROUND_BF16)
            sumsq += tl.sum(x * x, axis=1)
        r = _inv_rms_of_sum(sumsq, D, x_eps)
        for d0 in range(0, D, BLOCK_D):
            d_ok = offs_d < D - d0
            w = tl.load(nw_ptr + d0 + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            y = w[None, :] * (_collapsed(pre, h_ptrs, rows_ok, d_ok, d0, x_ptr, ROUND_BF16) * r[:, None])
            if ROUND_BF16:
                y = _round_bf16(y)
            tl.store(x_ptrs + d0, y.to(x_ptr.dtype.element_ty), mask=n_ok[:, None] & d_ok[None, :])
    else:
        for d0 in range(0, D, BLOCK_D):
            d_ok = offs_d < D - d0
            x = _collapsed(pre, h_ptrs, rows_ok, d_ok, d0, x_ptr, ROUND_BF16)
            tl.store(x_ptrs + d0, x.to(x_ptr.dtype.element_ty), mask=n_ok[:, None] & d_ok[None, :])


@triton.jit
def _pre_or_head(
    h_ptr, fn_ptr, scale_ptr, base_ptr, x_ptr, post_ptr, comb_ptr, part_ptr, nw_ptr,
    N, D, stride_hn, stride_xn, stride_pn, stride_cn, stride_cj, stride_qn, n_splits, n_iters, hc_eps, norm_eps,
    x_eps, HC, HCP, MODE, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, DOT, ROUND_BF16, PHASE,
    NORM: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if PHASE == 2:
        acc, sumsq = _sum_partials(part_ptr, offs_n, n_ok, stride_qn, n_splits, HCP, BLOCK_N, _SPLIT_CHUNK)
    else:
        acc, sumsq = _mix_sums(h_ptr, fn_ptr, offs_n, n_ok, D, stride_hn, HC, HCP, MODE, BLOCK_N, BLOCK_K, DOT)
    rho = tl.math.rsqrt(sumsq / (HC * D) + norm_eps)
    m = tl.reshape(acc * rho[:, None], (BLOCK_N, 2, HCP, HCP))
    half = tl.arange(0, 2)[None, :, None, None]
    pre_post = tl.sum(tl.where(half == 1, m, 0.0), axis=1)  # [BN, HCP, HCP]: row 0 pre, row 1 post
    r = tl.arange(0, HCP)[None, :, None]
    k = tl.arange(0, HCP)
    k_ok = k < HC
    pre_m = tl.sum(tl.where(r == 0, pre_post, 0.0), axis=1)  # [BN, HCP]
    pre_base = tl.load(base_ptr + k, mask=k_ok, other=0.0)
    pre = tl.where(k_ok[None, :], tl.sigmoid(pre_m * tl.load(scale_ptr) + pre_base[None, :]) + hc_eps, 0.0)
    _collapse(
        pre, offs_n, n_ok, h_ptr, x_ptr, nw_ptr, D, stride_hn, stride_xn, x_eps, HC, HCP, BLOCK_N, BLOCK_D, ROUND_BF16,
        NORM,
    )  # fmt: skip
    if MODE == 0:
        post_m = tl.sum(tl.where(r == 1, pre_post, 0.0), axis=1)
        post_base = tl.load(base_ptr + HC + k, mask=k_ok, other=0.0)
        post = 2.0 * tl.sigmoid(post_m * tl.load(scale_ptr + 1) + post_base[None, :])
        n64 = offs_n.to(tl.int64)
        tl.store(post_ptr + n64[:, None] * stride_pn + k[None, :], post, mask=n_ok[:, None] & k_ok[None, :])
        j3 = r
        k3 = k[None, None, :]
        valid = (j3 < HC) & (k3 < HC)  # [1, HCP, HCP]
        comb_base = tl.load(base_ptr + 2 * HC + j3 * HC + k3, mask=valid, other=0.0)
        comb_m = tl.sum(tl.where(half == 0, m, 0.0), axis=1)
        comb = _sinkhorn(comb_m * tl.load(scale_ptr + 2) + comb_base, valid, n_iters, hc_eps)
        c_ptrs = comb_ptr + n64[:, None, None] * stride_cn + j3 * stride_cj + k3
        tl.store(c_ptrs, comb, mask=n_ok[:, None, None] & valid)


@triton.jit
def _post_rows(N, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """A post program's tokens and channels: (n [BLOCK_N] int64, in range, offs_d [BLOCK_D], in range), the
    BLOCK_N tokens from program_id(0) * BLOCK_N (out-of-range ones read token 0, masked), BLOCK_D channels
    from program_id(1) * BLOCK_D."""
    t = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = t < N
    n = tl.where(t_ok, t, 0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    return n, t_ok, offs_d, offs_d < D


@triton.jit
def _post_tile(
    x, n, t_ok, offs_d, d_ok, h_ptr, post_ptr, comb_ptr, new_ptr,
    D, stride_hn, stride_pn, stride_cn, stride_cj, stride_yn, stride_yk,
    HC, HCP, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_BF16,
):  # fmt: skip
    """Stores new[n, :, offs_d] = post * x + comb^T h for the sub-layer output tile x [BLOCK_N, BLOCK_D] fp32
    (every value its own token's: no sum across tokens)."""
    k = tl.arange(0, HCP)
    k_ok = k < HC
    td_ok = t_ok[:, None] & d_ok[None, :]  # [BLOCK_N, BLOCK_D]
    tk_ok = t_ok[:, None] & k_ok[None, :]  # [BLOCK_N, HCP]
    mixed = tl.zeros((BLOCK_N, HCP, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(HC):  # comb is applied transposed: row j of comb weighs stream j
        h_j = tl.load(h_ptr + n[:, None] * stride_hn + j * D + offs_d[None, :], mask=td_ok, other=0.0).to(tl.float32)
        comb_j = tl.load(comb_ptr + n[:, None] * stride_cn + j * stride_cj + k[None, :], mask=tk_ok, other=0.0)
        mixed += comb_j[:, :, None] * h_j[:, None, :]
    post = tl.load(post_ptr + n[:, None] * stride_pn + k[None, :], mask=tk_ok, other=0.0)
    new = post[:, :, None] * x[:, None, :] + mixed
    if ROUND_BF16:
        new = _round_bf16(new)
    y_ptrs = new_ptr + n[:, None, None] * stride_yn + k[None, :, None] * stride_yk + offs_d[None, None, :]
    tl.store(y_ptrs, new.to(new_ptr.dtype.element_ty), mask=tk_ok[:, :, None] & d_ok[None, None, :])


@triton.jit
def _post(
    x_ptr, h_ptr, post_ptr, comb_ptr, new_ptr,
    N, D, stride_hn, stride_xn, stride_pn, stride_cn, stride_cj, stride_yn, stride_yk,
    HC, HCP, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_BF16,
):  # fmt: skip
    """new[n, :, d0:d0 + BLOCK_D] for the BLOCK_N tokens n from program_id(0) * BLOCK_N, d0 = program_id(1) *
    BLOCK_D: a [BLOCK_N, HCP, BLOCK_D] tile, every value its own token's (elementwise: no sum across tokens)."""
    n, t_ok, offs_d, d_ok = _post_rows(N, D, BLOCK_N, BLOCK_D)
    x = tl.load(x_ptr + n[:, None] * stride_xn + offs_d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    _post_tile(
        x.to(tl.float32), n, t_ok, offs_d, d_ok, h_ptr, post_ptr, comb_ptr, new_ptr,
        D, stride_hn, stride_pn, stride_cn, stride_cj, stride_yn, stride_yk, HC, HCP, BLOCK_N, BLOCK_D, ROUND_BF16,
    )  # fmt: skip
