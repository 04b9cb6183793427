"""FP8 block-scaled projection (DeepSeek's `act_quant` + `fp8_gemm`, dsv4-model.md §2.10, §3.3) in Triton,
the activation quantization fused into the GEMM's prologue: one launch per projection.

Contract (reference: `fp8_gemm_ref.fp8_linear_ref`, and `fp8_gemm_ref` for the pre-quantized form):
  x        [M, K]   bf16 or fp32, row-major (K contiguous): the activations, quantized here
  b        [N, K]   float8_e4m3fn, row-major: the weight as the checkpoint stores it
  b_scale  [ceil(N/128), ceil(K/128)] e8m0 (float8_e8m0fnu or uint8), one per 128x128 block
  out      [M, N]   bf16 = sum_kb (q_kb @ b_kb^T) * s[:, kb] * b_scale[n // 128, kb], fp32 accumulation,
                    where (q, s) = act_quant_fp8_ref(x): e4m3 per token per 128 K, s a power of two
The pre-quantized form (`fp8_gemm`: e4m3 a [M, K] and fp32 a_scale [M, ceil(K/128)] from the caller)
is the same kernel with QUANT_A off.

BLOCK_K is 128, the scale block: each K step loads one [BM, 128] activation tile, quantizes it (per-row
amax floored at 1e-4; scale 2^ceil(log2(amax / 448)); q = e4m3(x / scale), round to nearest even) and
runs one tensor-core product of two fp8 tiles, promoted into the fp32 accumulator with its two scales
(DeepGEMM's scheme). The bytes are the reference's, by exact methods only:
- the scale comes from amax's bits: amax = m 2^E (m in [1, 2)) needs 2^(E-8) when m <= 1.75 (448 =
  1.75 2^8), else 2^(E-7). No log2 nor division (Triton's fp32 `/` is `div.full.f32`, approximate).
  torch rounds amax / 448 to fp32 first, which never lands on a power of two from above: the fp32
  amax next above 448 2^e is 2^-23 / 1.75 above it, relatively, more than the half ulp (2^-24) that
  would round the quotient down to 2^e. So both pick the same power (tested at those neighbours).
- x / scale is x times the exact power of two 1 / scale; it needs no clamp: |x| <= amax <= 448 scale.
- e4m3 rounding: on a GPU the fp32 -> e4m3 cast is `cvt.rn.satfinite.e4m3x2.f32` (PTX: round to
  nearest even), torch's rounding. The interpreter emulates that cast with bit code that rounds half
  up and loses the carry into the exponent, so there (ROUND_BITS) the value is first rounded to the
  e4m3 grid (ties to even) with an fp32 add / subtract of 2^(E+20), |v| in [2^E, 2^(E+1)),
  whose ulp is the e4m3 quantum at |v| (2^-9 in e4m3's subnormal range), and the cast is then exact.

Every N-tile program re-quantizes the same [BM, K] rows. In decode (M <= 32) that is free: the
projection is bound by reading the weight, and the activation rows (at most 32 x 8 KB) stay in L2; it
saves the separate quantization (~17 torch launches) and a round trip of x through memory. In a
large prefill it is ALU work per (row block, N tile) beside the fp8 MMA, the price of one launch.

M, N, K need not be multiples of any block (masked loads read zeros, which also pad the last partial
activation block, as the reference pads); the wrapper sets EVEN_K when K is a multiple of 128 (every
model K), which drops the K masks from the loop. e8m0 bytes are decoded by placing them in the fp32
exponent field (exact; byte 0 decodes to 0 instead of 2^-127 and 255 to inf instead of NaN; neither
occurs in a checkpoint).

Under the Triton interpreter the kernel stores fp32 and the wrapper rounds to bf16 with torch (the
interpreter truncates fp32->bf16 stores); a GPU build stores bf16 directly.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dsv4_kernels import tuning
from dsv4_kernels.fp4_moe_tiles import _pow2_scale, _round_bf16, _round_to_e4m3  # the FP8 quantizer's parts
from dsv4_kernels.fp8_gemm_ref import FP8_AMAX_FLOOR, FP8_BLOCK
from dsv4_kernels.outputs import as_gpu_stored, output_buffer
from dsv4_kernels.split_k import _split_arrive, _split_sum, k_splits_allowed, split_counters, unsplit_args
from dsv4_kernels.token_ops_tiles import _inv_rms_of_sum

AMAX_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)


def interpreting() -> bool:
    """True when @triton.jit builds interpreter functions (TRITON_INTERPRET=1 at import time)."""
    return not isinstance(fp8_gemm_kernel, triton.runtime.JITFunction)


@triton.jit
def _a_tile(
    a_ptrs,
    a_mask,
    a_scale_ptrs,
    mask_m,
    w_ptrs,
    w_mask,
    inv_rms,
    K_AXIS: tl.constexpr,
    QUANT_A: tl.constexpr,
    ROUND_BITS: tl.constexpr,
    NORM: tl.constexpr,
):
    """One K block of A as an e4m3 tile (K along K_AXIS) and its per-row fp32 scales [BM]: quantized here
    from bf16 / fp32 (QUANT_A; a_scale_ptrs unused), else loaded as the caller quantized them. NORM (QUANT_A
    only): the loaded rows are first RMS-normed as token_ops.rms_norm stores them, w * (x * inv_rms) rounded to
    bf16 (w_ptrs: this block's norm weights; inv_rms [BM] from `_row_inv_rms`)."""
    if QUANT_A:
        x = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32)  # fp32 first (the interpreter's bf16 rule)
        if NORM:
            w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
            x = _round_bf16(tl.expand_dims(w, 1 - K_AXIS) * (x * tl.expand_dims(inv_rms, K_AXIS)))
        amax = tl.maximum(tl.max(tl.abs(x), axis=K_AXIS), AMAX_FLOOR)
        scale, inv_scale = _pow2_scale(amax)
        v = x * tl.expand_dims(inv_scale, K_AXIS)  # |v| <= 448 by the choice of scale
        if ROUND_BITS:
            v = _round_to_e4m3(v)
        return v.to(tl.float8e4nv), scale
    else:
        return tl.load(a_ptrs, mask=a_mask, other=0.0), tl.load(a_scale_ptrs, mask=mask_m, other=0.0)


@triton.jit
def _row_inv_rms(a_rows, mask_m, offs_k, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, K_AXIS: tl.constexpr):
    """[BM] 1 / sqrt(mean(x^2) + eps) of the rows whose first K block a_rows points at (K along K_AXIS), summed
    block by block: token_ops' norm factor (`_inv_rms_of_sum`) but for the order of the squares' sum."""
    sum_sq = tl.zeros((BLOCK_M,), tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        if K_AXIS == 0:
            mask = mask_m[None, :] & k_ok[:, None]
        else:
            mask = mask_m[:, None] & k_ok[None, :]
        x = tl.load(a_rows + kb * BLOCK_K, mask=mask, other=0.0).to(tl.float32)
        sum_sq += tl.sum(x * x, axis=K_AXIS)
    return _inv_rms_of_sum(sum_sq, K, eps)


@triton.jit
def fp8_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_cm,
    norm_ptr,
    norm_eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    EVEN_K: tl.constexpr,
    QUANT_A: tl.constexpr,
    ROUND_BITS: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,
    NORM: tl.constexpr = False,
):
    """One [BLOCK_M, BLOCK_N] output tile. SWAP_AB computes its transpose, b_tile @ a_tile^T, so that
    N fills the 64-row side of a Hopper wgmma when M is a decode batch (M < 64). EVEN_K (K a multiple
    of BLOCK_K) drops the K masks, so the tile loads are masked along M / N only. QUANT_A: a_ptr holds
    bf16 / fp32 activations quantized in the loop (a_scale_ptr unused), else e4m3 with fp32 scales.
    SPLIT_K > 1 (SWAP_AB only: decode): program axis 2 walks K / SPLIT_K of the K blocks, and the tile's last
    split to arrive adds the fp32 parts (part_ptr [SPLIT_K, M, N]; count_ptr one counter a tile: split_k.py).
    NORM (QUANT_A): A is RMS-normed on the way in (norm_ptr [K] its weight, norm_eps; both unread without NORM):
    each program first sums its rows' squares over all of K (a decode row is a few KB, in L2), then normalizes
    each block it loads."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_scale_ptrs = a_scale_ptr + offs_m * stride_asm  # the pre-quantized form's; QUANT_A passes a's pointer
    b_scale_ptrs = b_scale_ptr + (offs_n // BLOCK_K) * stride_bsn
    if SWAP_AB:
        kb_lo = 0
        kb_hi = tl.cdiv(K, BLOCK_K)
        if SPLIT_K > 1:  # the wrapper makes SPLIT_K divide the K blocks
            kb_lo = tl.program_id(2) * (kb_hi // SPLIT_K)
            kb_hi = kb_lo + kb_hi // SPLIT_K
        a_rows = a_ptr + offs_m[None, :] * stride_am + offs_k[:, None]  # [BK, BM], K-major
        inv_rms = tl.zeros((BLOCK_M,), tl.float32)
        if NORM:
            inv_rms = _row_inv_rms(a_rows, mask_m, offs_k, K, norm_eps, BLOCK_M, BLOCK_K, 0)
        a_ptrs = a_rows + kb_lo * BLOCK_K
        b_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :] + kb_lo * BLOCK_K  # [BN, BK]
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kb in range(kb_lo, kb_hi):
            a_mask = mask_m[None, :]
            b_mask = mask_n[:, None]
            k_ok = offs_k < K - kb * BLOCK_K  # the norm weights' mask too
            if not EVEN_K:
                a_mask = a_mask & k_ok[:, None]
                b_mask = b_mask & k_ok[None, :]
            w_ptrs = norm_ptr + kb * BLOCK_K + offs_k
            a, a_s = _a_tile(
                a_ptrs, a_mask, a_scale_ptrs + kb, mask_m, w_ptrs, k_ok, inv_rms, 0, QUANT_A, ROUND_BITS, NORM
            )
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
            b_s_raw = tl.load(b_scale_ptrs + kb, mask=mask_n, other=0)
            b_s = (b_s_raw.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(byte-127), exact
            acc_t += tl.dot(b, a) * b_s[:, None] * a_s[None, :]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        c_ptrs = c_ptr + offs_m.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]  # M x N may pass 2^31
        c_mask = mask_n[:, None] & mask_m[None, :]
        if SPLIT_K > 1:
            p_ptrs = part_ptr + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
            tl.store(p_ptrs + tl.program_id(2).to(tl.int64) * M * N, acc_t, mask=c_mask)
            if _split_arrive(count_ptr, pid_m * tl.num_programs(1) + pid_n, SPLIT_K):
                acc_t = _split_sum(p_ptrs, c_mask, M * N, SPLIT_K)
                tl.store(c_ptrs, acc_t.to(c_ptr.dtype.element_ty), mask=c_mask)
        else:
            tl.store(c_ptrs, acc_t.to(c_ptr.dtype.element_ty), mask=c_mask)
    else:
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
        inv_rms = tl.zeros((BLOCK_M,), tl.float32)
        if NORM:
            inv_rms = _row_inv_rms(a_ptrs, mask_m, offs_k, K, norm_eps, BLOCK_M, BLOCK_K, 1)
        b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BK, BN], K-major (B^T view)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            a_mask = mask_m[:, None]
            b_mask = mask_n[None, :]
            k_ok = offs_k < K - kb * BLOCK_K  # the norm weights' mask too
            if not EVEN_K:
                a_mask = a_mask & k_ok[None, :]
                b_mask = b_mask & k_ok[:, None]
            w_ptrs = norm_ptr + kb * BLOCK_K + offs_k
            a, a_s = _a_tile(
                a_ptrs, a_mask, a_scale_ptrs + kb, mask_m, w_ptrs, k_ok, inv_rms, 1, QUANT_A, ROUND_BITS, NORM
            )
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
            b_s_raw = tl.load(b_scale_ptrs + kb, mask=mask_n, other=0)
            b_s = (b_s_raw.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def store_dtype() -> torch.dtype:
    """What the kernel stores: bf16 on a GPU, fp32 under the interpreter (see the module doc)."""
    return torch.float32 if interpreting() else torch.bfloat16


def pick_blocks(m: int) -> tuple[int, int, bool]:
    """(BLOCK_M, BLOCK_N, SWAP_AB). Decode batches (M <= 32) take the smallest M tile a tensor-core
    dot accepts (16) and swap A and B, so the 128-wide N tile is the wgmma's 64-row side; prefill
    uses 64 x 128 tiles."""
    if m <= 32:
        return (16 if m <= 16 else 32), 128, True
    return 64, 128, False


def num_warps(device: torch.device, swap_ab: bool) -> int:
    """4, or 8 for the unswapped (prefill) tile on a GPU without wgmma (sm_80/89/120): there the MMA
    operands and the fp32 accumulator all live in registers, and with the activation tile in fp32 for
    its quantization 4 warps spill (255 registers a thread on sm_120)."""
    if swap_ab or device.type != "cuda":
        return 4
    return 4 if _sm_major(device.index if device.index is not None else torch.cuda.current_device()) in (9, 10) else 8


def pick_split_k(m: int, n: int, k: int, device: torch.device, parts: tuple[int, ...] = ()) -> int:
    """The K split of a decode (swapped-tile) launch of [m, k] x [n, k]^T: what bench/gpu_fp8_sweep.py measured
    fastest on this card for this weight shape (tuning.py), when it divides the K blocks; else 1. `parts`: the
    row counts of weights stacked into this one (dsv4serve/model/joined_fp8.py); until the joined shape is
    measured, the largest split its parts were tuned to (inferred: the same K, more N tiles)."""
    if not k_splits_allowed():
        return 1
    split = tuning.lookup(device, "fp8_gemm", f"{n}x{k}", size=m)
    if split is None and parts:
        split = max(tuning.lookup(device, "fp8_gemm", f"{p}x{k}", size=m) or 1 for p in parts)
    split = split or 1
    return split if (-(-k // FP8_BLOCK)) % split == 0 else 1


@functools.cache
def _sm_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def _check_weight(b: torch.Tensor, b_scale: torch.Tensor, k: int) -> None:
    n = b.shape[0]
    if b.dtype != torch.float8_e4m3fn or b.dim() != 2 or b.shape[1] != k:
        raise ValueError(f"need an e4m3 weight [N, {k}], got {b.dtype} {tuple(b.shape)}")
    if tuple(b_scale.shape) != (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)):
        raise ValueError(f"weight scale shape {tuple(b_scale.shape)} does not fit N={n} K={k}")
    if b_scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"weight scales must be e8m0 (float8_e8m0fnu or uint8 bytes), got {b_scale.dtype}")


def _launch(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    blocks: tuple[int, int, bool] | None,
    out: torch.Tensor | None,
    split_k: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    parts: tuple[int, ...] = (),
    norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """The one kernel launch of both forms; a_scale None: `a` is bf16 / fp32 and quantized in the kernel.
    `split_k` None: `pick_split_k`'s (decode tiles only; `parts` as there). `out_dtype` fp32: the fp32
    accumulator stored as it is (a row-parallel rank's partial, cast after the sum over ranks), else bf16.
    `norm` (weight [K], eps), fused form only: A is RMS-normed in the kernel first (`fp8_linear`)."""
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bf16 or fp32, got {out_dtype}")
    m, k = a.shape
    n = b.shape[0]
    quant_a = a_scale is None
    a = a if a.stride(-1) == 1 else a.contiguous()  # any row stride; K must be contiguous
    b = b.contiguous()
    b_scale = b_scale.contiguous().view(torch.uint8)
    if a_scale is None:
        a_scale = a  # never read (QUANT_A); a pointer of the right kind for the signature
    bm, bn, swap_ab = blocks or pick_blocks(m)
    fp32_out = out_dtype == torch.float32
    out = output_buffer(out, (m, n), torch.float32 if fp32_out else store_dtype(), a.device)
    k_blocks = -(-k // FP8_BLOCK)
    tiles = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    if split_k is None:
        split_k = pick_split_k(m, n, k, a.device, parts) if swap_ab else 1
    if split_k > 1 and (not swap_ab or k_blocks % split_k):
        raise ValueError(f"split_k {split_k} needs the swapped (decode) tile and must divide the {k_blocks} K blocks")
    split = split_k > 1
    part, counters = unsplit_args(a.device)
    if split:
        part = torch.empty((split_k, m, n), dtype=torch.float32, device=a.device)
        counters = split_counters(tiles[0] * tiles[1], a.device)
    norm_w, norm_eps = (b_scale, 0.0) if norm is None else norm  # without NORM: a pointer never read
    fp8_gemm_kernel[(tiles[0], tiles[1], split_k)](
        a,
        a_scale,
        b,
        b_scale,
        out,
        part,
        counters,
        m,
        n,
        k,
        a.stride(0),
        0 if quant_a else a_scale.stride(0),
        b.stride(0),
        b_scale.stride(0),
        out.stride(0),
        norm_w,
        norm_eps,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=FP8_BLOCK,
        SWAP_AB=swap_ab,
        EVEN_K=k % FP8_BLOCK == 0,
        QUANT_A=quant_a,
        ROUND_BITS=quant_a and interpreting(),
        SPLIT_K=split_k,
        NORM=norm is not None,
        num_warps=num_warps(a.device, swap_ab),
    )
    return out if fp32_out else as_gpu_stored(out)


def fp8_linear(
    x: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    blocks: tuple[int, int, bool] | None = None,
    out: torch.Tensor | None = None,
    split_k: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    parts: tuple[int, ...] = (),
    norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """x [M, K] bf16 / fp32 -> bf16 [M, N]: the whole FP8 projection (`numerics.linear` with fp8_act) in
    one launch; the kernel quantizes x (idempotent: an input quantized before gives the same bytes).
    `out` ([M, N], row stride free, dtype `store_dtype()`, fp32 with out_dtype fp32) receives the kernel's
    stores; `split_k` the decode tile's K split instead of `pick_split_k`'s (bench/gpu_fp8_sweep.py times
    them); `out_dtype` fp32: the accumulator unrounded (`_launch`); `parts`: b stacks weights of these
    row counts (`pick_split_k`). `norm` (weight [K], eps): the projection of RMSNorm(x) as token_ops.rms_norm
    stores it for bf16 x (w * (x * r) rounded to bf16), the norm applied in the kernel and never stored: one
    launch for both (the attention's q_norm before wq_b); only the squares' summation order differs."""
    if x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 2:
        raise TypeError(f"fp8_linear takes bf16 or fp32 activations [M, K], got {x.dtype} {tuple(x.shape)}")
    _check_weight(b, b_scale, x.shape[1])
    if norm is not None and (x.dtype != torch.bfloat16 or tuple(norm[0].shape) != (x.shape[1],)):
        raise ValueError(
            f"a fused norm takes bf16 x and a [{x.shape[1]}] weight, got {x.dtype}, {tuple(norm[0].shape)}"
        )
    if norm is not None:
        norm = (norm[0].contiguous(), float(norm[1]))
    return _launch(x, None, b, b_scale, blocks, out, split_k, out_dtype, parts, norm)


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    blocks: tuple[int, int, bool] | None = None,
    out: torch.Tensor | None = None,
    split_k: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The pre-quantized form: a e4m3 [M, K] with fp32 scales [M, ceil(K/128)] (as `act_quant_fp8_ref`
    makes them) -> bf16 [M, N]. `blocks`, `out`, `split_k` and `out_dtype` as in `fp8_linear`."""
    m, k = a.shape
    if a.dtype != torch.float8_e4m3fn:
        raise ValueError(f"need e4m3 activations [M, K], got {a.dtype}")
    _check_weight(b, b_scale, k)
    if tuple(a_scale.shape) != (m, -(-k // FP8_BLOCK)):
        raise ValueError(f"activation scale shape {tuple(a_scale.shape)} does not fit M={m} K={k}")
    return _launch(a, a_scale.float().contiguous(), b, b_scale, blocks, out, split_k, out_dtype)


_SIGNATURE = {
    "a_ptr": "*fp8e4nv",
    "a_scale_ptr": "*fp32",
    "b_ptr": "*fp8e4nv",
    "b_scale_ptr": "*u8",
    "c_ptr": "*bf16",
    "part_ptr": "*fp32",
    "count_ptr": "*i32",
    "M": "i32",
    "N": "i32",
    "K": "i32",
    "stride_am": "i32",
    "stride_asm": "i32",
    "stride_bn": "i32",
    "stride_bsn": "i32",
    "stride_cm": "i32",
    "norm_ptr": "*fp32",
    "norm_eps": "fp32",
    "BLOCK_M": "constexpr",
    "BLOCK_N": "constexpr",
    "BLOCK_K": "constexpr",
    "SWAP_AB": "constexpr",
    "EVEN_K": "constexpr",
    "QUANT_A": "constexpr",
    "ROUND_BITS": "constexpr",
    "SPLIT_K": "constexpr",
    "NORM": "constexpr",
}
# what the model launches (fp8_linear on the bf16 compute dtype): a_scale_ptr is a's own pointer, unread
COMPILE_SIGNATURE = {**_SIGNATURE, "a_ptr": "*bf16", "a_scale_ptr": "*bf16"}
PREQUANT_SIGNATURE = _SIGNATURE
# multiples of 16 at DeepSeek-V4-Flash's dims (registry.py): N and K of every FP8 projection and the
# row strides that equal them; not M, nor the scale strides ceil(K/128) (8 for K=1024)
ALIGNED_INTS = ("N", "K", "stride_am", "stride_bn", "stride_cm")

# (config name, signature, constexprs) for the CPU compile checks (tests/kernels/test_compile.py)
_K = {"BLOCK_K": 128, "EVEN_K": True, "ROUND_BITS": False, "SPLIT_K": 1, "NORM": False}  # every model K: 128s
_FUSED, _PREQUANT = {**_K, "QUANT_A": True}, {**_K, "QUANT_A": False}
_PREFILL, _DECODE = {"BLOCK_M": 64, "BLOCK_N": 128, "SWAP_AB": False}, {"BLOCK_M": 16, "BLOCK_N": 128, "SWAP_AB": True}
COMPILE_CONFIGS = (
    ("prefill", COMPILE_SIGNATURE, {**_FUSED, **_PREFILL}),
    ("prefill_w8", COMPILE_SIGNATURE, {**_FUSED, **_PREFILL}),
    ("decode", COMPILE_SIGNATURE, {**_FUSED, **_DECODE}),
    ("decode_noswap", COMPILE_SIGNATURE, {**_FUSED, **_DECODE, "SWAP_AB": False}),
    ("prefill_prequant", PREQUANT_SIGNATURE, {**_PREQUANT, **_PREFILL}),
    ("prefill_prequant_w8", PREQUANT_SIGNATURE, {**_PREQUANT, **_PREFILL}),
    ("decode_prequant", PREQUANT_SIGNATURE, {**_PREQUANT, **_DECODE}),
    # the K split decode projections take (tuned/NVIDIA_H200.json: 2-16; one build per value, 8 checked here)
    ("decode_split8", COMPILE_SIGNATURE, {**_FUSED, **_DECODE, "SPLIT_K": 8}),
    # q_norm in wq_b's prologue (the attention's and the indexer's): decode unsplit and split, and prefill
    ("decode_norm", COMPILE_SIGNATURE, {**_FUSED, **_DECODE, "NORM": True}),
    ("decode_norm_split4", COMPILE_SIGNATURE, {**_FUSED, **_DECODE, "NORM": True, "SPLIT_K": 4}),
    ("prefill_norm", COMPILE_SIGNATURE, {**_FUSED, **_PREFILL, "NORM": True}),
    ("prefill_norm_w8", COMPILE_SIGNATURE, {**_FUSED, **_PREFILL, "NORM": True}),
)
# `num_warps`: the prefill tile launches with 4 warps on sm_90 and 8 on sm_120; the pre-quantized
# form's wrapper launches it the same way (only the fused form is measured to need 8: see num_warps)
LAUNCH_OPTIONS = {
    "prefill_w8": {"num_warps": 8},
    "prefill_prequant_w8": {"num_warps": 8},
    "prefill_norm_w8": {"num_warps": 8},
}
LAUNCH_ARCHS = {
    "prefill": (90,),
    "prefill_w8": (120,),
    "prefill_prequant": (90,),
    "prefill_prequant_w8": (120,),
    "prefill_norm": (90,),
    "prefill_norm_w8": (120,),
}
