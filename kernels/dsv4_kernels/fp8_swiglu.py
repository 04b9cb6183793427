"""The shared expert with FP8 weights (dsv4-model.md §2.8) in two launches (reference:
`fp8_swiglu_ref.shared_expert_ref`):

  1. `fp8_swiglu_kernel`: gate = x W1^T and up = x W3^T in one pass over x, the clamped SwiGLU in the
     epilogue, and its FP8 quantization: -> act e4m3 [M, I] + fp32 scales [M, ceil(I/128)];
  2. the w2 projection: `fp8_gemm.fp8_gemm` on that pre-quantized pair -> bf16 [M, D].

Launch 1 is the FP8 GEMM of fp8_gemm.py (its prologue quantizes x per token per 128 channels in the K
loop, `_a_tile`; the same tile shapes, the same SWAP_AB for decode batches) with two weights: each
program holds the same 128 output channels n of W1 and of W3 (two accumulators, one activation tile),
which is what the epilogue needs, gate and up of the same channels side by side. Reading rows n of
two [I, D] tensors is reading rows n and I + n of their concatenation, so W1 and W3 stay as the
checkpoint (or `Linear.pack_fp8`) holds them: no packed copy, nothing to prepare.

The epilogue is `Expert.forward`'s arithmetic exactly: gate and up rounded to bf16 (the projections'
outputs), gate <= limit and |up| <= limit, silu(gate) in fp64 rounded to fp32 (the reference's
`in_fp64`; the libdevice exp on a GPU, a few hundred elements a program) times up in fp32, rounded to
bf16 (the w2 input in the compute dtype), then quantized per 128 channels as the w2 GEMM's prologue
would (`fp4_moe_tiles._quantize_rows`: the 128-wide N tile is one whole activation block of each
row). Given equal gate / up sums, act is bitwise the reference's; the GEMMs differ from it only by
fp32 summation order (fp8_gemm.py), and a one-ulp change of gate or up can move an act value by one
bf16 ulp, and so its e4m3 rounding, at most 2^-4 of that one element.

bf16 roundings use the bit method of fp4_moe_tiles (`_round_bf16`, ties to even) in both builds (the
interpreter truncates fp32->bf16 casts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_kernels import tuning
from dsv4_kernels.fp4_moe_tiles import _quantize_rows, _round_bf16
from dsv4_kernels.fp8_gemm import _a_tile, _sm_major, fp8_gemm, interpreting, pick_blocks
from dsv4_kernels.fp8_gemm_ref import FP8_BLOCK
from dsv4_kernels.outputs import output_buffer
from dsv4_kernels.split_k import (
    _split_arrive,
    _split_sum,
    k_splits_allowed,
    split_counters,
    split_to_fill,
    unsplit_args,
)


@triton.jit
def _swiglu_quant(acc1, acc3, limit, n_ok, N_AXIS: tl.constexpr, ROUND_BITS: tl.constexpr):
    """fp32 gate / up sums (channels along N_AXIS) -> (e4m3 grid values fp32, per-row fp32 scale)."""
    gate = _round_bf16(acc1)
    up = _round_bf16(acc3)
    if limit > 0:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    g64 = gate.to(tl.float64)
    act = _round_bf16((g64 / (1.0 + tl.exp(-g64))).to(tl.float32) * up)
    return _quantize_rows(tl.where(tl.expand_dims(n_ok, 1 - N_AXIS), act, 0.0), N_AXIS, ROUND_BITS)


@triton.jit
def fp8_swiglu_kernel(
    a_ptr,
    w1_ptr,
    w1_scale_ptr,
    w3_ptr,
    w3_scale_ptr,
    q_ptr,
    q_scale_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    limit,
    stride_am,
    stride_wn,
    stride_wsn,
    stride_qm,
    stride_qsm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    EVEN_K: tl.constexpr,
    ROUND_BITS: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,
):
    """One [BLOCK_M rows, 128 channels] tile of act (W1 and W3 share strides). SWAP_AB computes the
    transposed tile (W @ x^T: the channels fill the wgmma's 64-row side for a decode batch). SPLIT_K > 1
    (SWAP_AB only: decode) splits the K blocks over program axis 2; each split stores its gate and up fp32
    sums side by side (part_ptr [SPLIT_K, M, 2N]) and the tile's last split to arrive adds them in split
    order and runs the epilogue (count_ptr: one counter a tile, split_k.py)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    ws_off = (offs_n // BLOCK_K) * stride_wsn
    if SWAP_AB:
        a_ptrs = a_ptr + offs_m[None, :] * stride_am + offs_k[:, None]  # [BK, BM]
        w_off = offs_n[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
        acc1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
        w_off = offs_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN], K-major
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb_lo = 0
    kb_hi = tl.cdiv(K, BLOCK_K)
    if SPLIT_K > 1:  # the wrapper makes SPLIT_K divide the K blocks
        kb_lo = tl.program_id(2) * (kb_hi // SPLIT_K)
        kb_hi = kb_lo + kb_hi // SPLIT_K
        a_ptrs += kb_lo * BLOCK_K
    for kb in range(kb_lo, kb_hi):
        k_ok = offs_k < K - kb * BLOCK_K
        if SWAP_AB:
            a_mask = mask_m[None, :] if EVEN_K else mask_m[None, :] & k_ok[:, None]
            w_mask = mask_n[:, None] if EVEN_K else mask_n[:, None] & k_ok[None, :]
        else:
            a_mask = mask_m[:, None] if EVEN_K else mask_m[:, None] & k_ok[None, :]
            w_mask = mask_n[None, :] if EVEN_K else mask_n[None, :] & k_ok[:, None]
        a, a_s = _a_tile(
            a_ptrs, a_mask, a_ptrs, mask_m, a_ptrs, a_mask, mask_m, 0 if SWAP_AB else 1, True, ROUND_BITS, False
        )
        b1 = tl.load(w1_ptr + w_off + kb * BLOCK_K, mask=w_mask, other=0.0)
        b3 = tl.load(w3_ptr + w_off + kb * BLOCK_K, mask=w_mask, other=0.0)
        s1 = (tl.load(w1_scale_ptr + ws_off + kb, mask=mask_n, other=0).to(tl.int32) << 23).to(tl.float32, bitcast=True)
        s3 = (tl.load(w3_scale_ptr + ws_off + kb, mask=mask_n, other=0).to(tl.int32) << 23).to(tl.float32, bitcast=True)
        if SWAP_AB:
            acc1 += tl.dot(b1, a) * s1[:, None] * a_s[None, :]
            acc3 += tl.dot(b3, a) * s3[:, None] * a_s[None, :]
        else:
            acc1 += tl.dot(a, b1) * a_s[:, None] * s1[None, :]
            acc3 += tl.dot(a, b3) * a_s[:, None] * s3[None, :]
        a_ptrs += BLOCK_K
    rows = offs_m.to(tl.int64)
    if SWAP_AB:
        q_mask = mask_n[:, None] & mask_m[None, :]
        if SPLIT_K > 1:  # this split's sums stored; the tile's last split to arrive adds them all and finishes
            p_ptrs = part_ptr + (offs_m[None, :] * (2 * N) + offs_n[:, None])  # int32 offsets: M x 2N is small
            p_split = tl.program_id(2).to(tl.int64) * M * (2 * N)
            tl.store(p_ptrs + p_split, acc1, mask=q_mask)
            tl.store(p_ptrs + p_split + N, acc3, mask=q_mask)
            if _split_arrive(count_ptr, pid_m * tl.num_programs(1) + pid_n, SPLIT_K):
                acc1 = _split_sum(p_ptrs, q_mask, M * (2 * N), SPLIT_K)
                acc3 = _split_sum(p_ptrs + N, q_mask, M * (2 * N), SPLIT_K)
                _store_act(acc1, acc3, limit, rows, offs_n, mask_m, mask_n, pid_n, q_ptr, q_scale_ptr, stride_qm,
                           stride_qsm, True, ROUND_BITS)  # fmt: skip
        else:
            _store_act(acc1, acc3, limit, rows, offs_n, mask_m, mask_n, pid_n, q_ptr, q_scale_ptr, stride_qm,
                       stride_qsm, True, ROUND_BITS)  # fmt: skip
    else:
        _store_act(acc1, acc3, limit, rows, offs_n, mask_m, mask_n, pid_n, q_ptr, q_scale_ptr, stride_qm,
                   stride_qsm, False, ROUND_BITS)  # fmt: skip


@triton.jit
def _store_act(
    acc1, acc3, limit, rows, offs_n, mask_m, mask_n, pid_n, q_ptr, q_scale_ptr, stride_qm, stride_qsm,
    SWAP_AB: tl.constexpr, ROUND_BITS: tl.constexpr,
):  # fmt: skip
    """The epilogue: gate / up sums -> act's e4m3 values and per-row scale, stored (SWAP_AB: channels x rows)."""
    if SWAP_AB:
        q, scale = _swiglu_quant(acc1, acc3, limit, mask_n, 0, ROUND_BITS)
        q_ptrs = q_ptr + rows[None, :] * stride_qm + offs_n[:, None]
        q_mask = mask_n[:, None] & mask_m[None, :]
    else:
        q, scale = _swiglu_quant(acc1, acc3, limit, mask_n, 1, ROUND_BITS)
        q_ptrs = q_ptr + rows[:, None] * stride_qm + offs_n[None, :]
        q_mask = mask_m[:, None] & mask_n[None, :]
    tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_scale_ptr + rows * stride_qsm + pid_n, scale, mask=mask_m)


def launch_options(device: torch.device, swap_ab: bool) -> dict[str, int]:
    """num_warps: 4 for the transposed decode tile; 8 for the 64-row prefill tile, whose two [64, 128]
    fp32 accumulators alone are 128 registers a thread at 4 warps. num_stages: Triton's default (3),
    but 2 for the prefill tile on a GPU with 99 KB of shared memory a block (sm_89 / sm_120: three
    stages of one activation and two weight tiles take 104 KB there)."""
    if swap_ab:
        return {"num_warps": 4}
    if device.type == "cuda" and _sm_major(device.index or 0) not in (9, 10):  # a tensor's device has its index
        return {"num_warps": 8, "num_stages": 2}
    return {"num_warps": 8}


def _check_fp8(w: torch.Tensor, w_scale: torch.Tensor, k: int) -> None:
    n = w.shape[0]
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2 or w.shape[1] != k or w.stride(-1) != 1:
        raise ValueError(f"need an e4m3 weight [N, {k}] with unit last stride, got {w.dtype} {tuple(w.shape)}")
    if tuple(w_scale.shape) != (triton.cdiv(n, FP8_BLOCK), triton.cdiv(k, FP8_BLOCK)):
        raise ValueError(f"weight scale shape {tuple(w_scale.shape)} does not fit N={n} K={k}")


def pick_split_k(m: int, n: int, k: int, device: torch.device) -> int:
    """The K split of a decode (swapped-tile) launch: the card's tuned choice for this weight shape (tuning.py,
    "fp8_swiglu"), else on CUDA the built-in rule head_logits takes too (split_k.split_to_fill: about 128
    programs, split at most 8, dividing the K blocks); 1 off CUDA (the interpreter) and for prefill tiles. It depends on
    the weight shape only, not on the decode batch, so every decode bucket sums in one order."""
    k_blocks = -(-k // FP8_BLOCK)
    if not pick_blocks(m)[2] or not k_splits_allowed():
        return 1
    tuned = tuning.lookup(device, "fp8_swiglu", f"{n}x{k}", size=m)
    if tuned:
        return tuned if k_blocks % tuned == 0 else 1
    return split_to_fill(-(-n // pick_blocks(m)[1]), k_blocks) if device.type == "cuda" else 1


def fp8_swiglu(
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w3: torch.Tensor,
    w3_scale: torch.Tensor,
    limit: float,
    outs: tuple[torch.Tensor, torch.Tensor] | None = None,
    split_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, D] bf16 / fp32, W1 / W3 e4m3 [I, D] with e8m0 [ceil(I/128), ceil(D/128)] -> (act e4m3 [M, I],
    fp32 scales [M, ceil(I/128)]) in one launch. `outs`: buffers for the two (row strides free). `split_k`:
    the decode tile's K split (default `pick_split_k`)."""
    m, k = x.shape
    n = w1.shape[0]
    if x.dtype not in (torch.bfloat16, torch.float32) or x.stride(-1) != 1:
        raise TypeError(f"fp8_swiglu takes bf16 / fp32 activations [M, K], unit last stride, got {x.dtype}")
    _check_fp8(w1, w1_scale, k)
    _check_fp8(w3, w3_scale, k)
    if w1.shape != w3.shape or w1.stride() != w3.stride():
        raise ValueError("W1 and W3 must share one shape and layout")
    w1_scale, w3_scale = w1_scale.contiguous().view(torch.uint8), w3_scale.contiguous().view(torch.uint8)
    q = output_buffer(outs[0] if outs else None, (m, n), torch.float8_e4m3fn, x.device)
    q_scale = output_buffer(outs[1] if outs else None, (m, triton.cdiv(n, FP8_BLOCK)), torch.float32, x.device)
    bm, bn, swap_ab = pick_blocks(m)
    split_k = pick_split_k(m, n, k, x.device) if split_k is None else split_k
    k_blocks = triton.cdiv(k, FP8_BLOCK)
    if split_k > 1 and (not swap_ab or k_blocks % split_k):
        raise ValueError(f"split_k {split_k} needs the decode tile and must divide the {k_blocks} K blocks")
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split_k)
    part, counters = unsplit_args(x.device)
    if split_k > 1:  # gate's and up's sums side by side in a row
        part = torch.empty((split_k, m, 2 * n), dtype=torch.float32, device=x.device)
        counters = split_counters(grid[0] * grid[1], x.device)
    fp8_swiglu_kernel[grid](
        x, w1, w1_scale, w3, w3_scale, q, q_scale, part, counters, m, n, k, float(limit),
        x.stride(0), w1.stride(0), w1_scale.stride(0), q.stride(0), q_scale.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=FP8_BLOCK, SWAP_AB=swap_ab, EVEN_K=k % FP8_BLOCK == 0,
        ROUND_BITS=interpreting(), SPLIT_K=split_k, **launch_options(x.device, swap_ab),
    )  # fmt: skip
    return q, q_scale


def shared_expert(
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w3: torch.Tensor,
    w3_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    limit: float,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x [M, D] bf16 -> bf16 [M, D]: the whole shared expert in two launches (module doc). `out_dtype` fp32:
    w2's accumulator unrounded (a row-parallel rank's partial: fp8_gemm)."""
    q, q_scale = fp8_swiglu(x, w1, w1_scale, w3, w3_scale, limit)
    return fp8_gemm(q, q_scale, w2, w2_scale, out_dtype=out_dtype)


_SIGNATURE = {
    "a_ptr": "*bf16", "w1_ptr": "*fp8e4nv", "w1_scale_ptr": "*u8", "w3_ptr": "*fp8e4nv", "w3_scale_ptr": "*u8",
    "q_ptr": "*fp8e4nv", "q_scale_ptr": "*fp32", "part_ptr": "*fp32", "count_ptr": "*i32",
    "M": "i32", "N": "i32", "K": "i32", "limit": "fp32",
    "stride_am": "i32", "stride_wn": "i32", "stride_wsn": "i32", "stride_qm": "i32", "stride_qsm": "i32",
    **{c: "constexpr" for c in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SWAP_AB", "EVEN_K", "ROUND_BITS", "SPLIT_K")},
}  # fmt: skip
# multiples of 16 at DeepSeek-V4-Flash's shared expert (D = 4096, I = 2048): N, K, the row strides that
# equal them, and the scale row strides D / 128 = 32 and I / 128 = 16; not M
ALIGNED_INTS = ("N", "K", "stride_am", "stride_wn", "stride_wsn", "stride_qm", "stride_qsm")
_GPU = {"BLOCK_N": 128, "BLOCK_K": 128, "EVEN_K": True, "ROUND_BITS": False, "SPLIT_K": 1}
COMPILE_CONFIGS = (
    ("decode", _SIGNATURE, {**_GPU, "BLOCK_M": 16, "SWAP_AB": True}),
    ("decode_split8", _SIGNATURE, {**_GPU, "BLOCK_M": 16, "SWAP_AB": True, "SPLIT_K": 8}),
    ("prefill", _SIGNATURE, {**_GPU, "BLOCK_M": 64, "SWAP_AB": False}),
    ("prefill_s2", _SIGNATURE, {**_GPU, "BLOCK_M": 64, "SWAP_AB": False}),
)
LAUNCH_OPTIONS = {
    "decode": {"num_warps": 4},
    "decode_split8": {"num_warps": 4},
    "prefill": {"num_warps": 8},
    "prefill_s2": {"num_warps": 8, "num_stages": 2},
}
LAUNCH_ARCHS = {"prefill": (90,), "prefill_s2": (120,)}
