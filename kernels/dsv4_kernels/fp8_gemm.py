"""FP8 block-scaled GEMM (DeepSeek's `fp8_gemm`, dsv4-model.md §2.10, §3.3) in Triton.

Contract (reference: `fp8_gemm_ref.fp8_gemm_ref`):
  a        [M, K]   float8_e4m3fn, row-major (K contiguous): activations quantized per token per 128 K
  a_scale  [M, ceil(K/128)] fp32 (contiguous), powers of two
  b        [N, K]   float8_e4m3fn, row-major: the weight as the checkpoint stores it
  b_scale  [ceil(N/128), ceil(K/128)] e8m0 (float8_e8m0fnu or uint8), one per 128x128 block
  out      [M, N]   bf16 = sum_kb (a_kb @ b_kb^T) * a_scale[:, kb] * b_scale[n // 128, kb], fp32 accumulation

BLOCK_K is 128, the scale block: each K step is one tensor-core product of two fp8 tiles, promoted
into the fp32 accumulator with its two scales (DeepGEMM's scheme). M, N, K need not be multiples of
any block (masked loads read zeros there); the wrapper sets EVEN_K when K is a multiple of 128 (every
model K), which drops the K masks from the loop. e8m0 bytes are decoded by placing them in the fp32
exponent field (exact; byte 0 decodes to 0 instead of 2^-127 and 255 to inf instead of NaN; neither
occurs in a checkpoint).

Under the Triton interpreter the kernel stores fp32 and the wrapper rounds to bf16 with torch (the
interpreter truncates fp32->bf16 stores); a GPU build stores bf16 directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_kernels.fp8_gemm_ref import FP8_BLOCK, act_quant_fp8_ref
from dsv4_kernels.outputs import output_buffer


def interpreting() -> bool:
    """True when @triton.jit builds interpreter functions (TRITON_INTERPRET=1 at import time)."""
    return not isinstance(fp8_gemm_kernel, triton.runtime.JITFunction)


@triton.jit
def fp8_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile. SWAP_AB computes its transpose, b_tile @ a_tile^T, so that
    N fills the 64-row side of a Hopper wgmma when M is a decode batch (M < 64). EVEN_K (K a multiple
    of BLOCK_K) drops the K masks, so the tile loads are masked along M / N only."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_scale_ptrs = a_scale_ptr + offs_m * stride_asm
    b_scale_ptrs = b_scale_ptr + (offs_n // BLOCK_K) * stride_bsn
    if SWAP_AB:
        a_ptrs = a_ptr + offs_m[None, :] * stride_am + offs_k[:, None]  # [BK, BM], K-major
        b_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :]  # [BN, BK]
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            a_mask = mask_m[None, :]
            b_mask = mask_n[:, None]
            if not EVEN_K:
                k_ok = offs_k < K - kb * BLOCK_K
                a_mask = a_mask & k_ok[:, None]
                b_mask = b_mask & k_ok[None, :]
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
            a_s = tl.load(a_scale_ptrs + kb, mask=mask_m, other=0.0)
            b_s_raw = tl.load(b_scale_ptrs + kb, mask=mask_n, other=0)
            b_s = (b_s_raw.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(byte-127), exact
            acc_t += tl.dot(b, a) * b_s[:, None] * a_s[None, :]
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        c_ptrs = c_ptr + offs_m.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]  # M x N may pass 2^31
        tl.store(c_ptrs, acc_t.to(c_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])
    else:
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
        b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BK, BN], K-major (B^T view)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            a_mask = mask_m[:, None]
            b_mask = mask_n[None, :]
            if not EVEN_K:
                k_ok = offs_k < K - kb * BLOCK_K
                a_mask = a_mask & k_ok[None, :]
                b_mask = b_mask & k_ok[:, None]
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
            a_s = tl.load(a_scale_ptrs + kb, mask=mask_m, other=0.0)
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


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    blocks: tuple[int, int, bool] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See the module contract. Returns bf16 [M, N]. `out` ([M, N], row stride free, dtype
    `store_dtype()`) receives the kernel's stores (tests pass a NaN-poisoned view)."""
    m, k = a.shape
    n, kb_ = b.shape
    nkb = -(-k // FP8_BLOCK)
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn or kb_ != k:
        raise ValueError(f"need e4m3 a [M, K] and b [N, K], got {a.dtype} {tuple(a.shape)}, {b.dtype} {tuple(b.shape)}")
    if tuple(a_scale.shape) != (m, nkb) or tuple(b_scale.shape) != (-(-n // FP8_BLOCK), nkb):
        raise ValueError(f"scale shapes {tuple(a_scale.shape)}, {tuple(b_scale.shape)} do not fit M={m} N={n} K={k}")
    if b_scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise TypeError(f"weight scales must be e8m0 (float8_e8m0fnu or uint8 bytes), got {b_scale.dtype}")
    a, b = a.contiguous(), b.contiguous()
    a_scale = a_scale.float().contiguous()
    b_scale = b_scale.contiguous().view(torch.uint8)
    bm, bn, swap_ab = blocks or pick_blocks(m)
    out = output_buffer(out, (m, n), store_dtype(), a.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    fp8_gemm_kernel[grid](
        a,
        a_scale,
        b,
        b_scale,
        out,
        m,
        n,
        k,
        a.stride(0),
        a_scale.stride(0),
        b.stride(0),
        b_scale.stride(0),
        out.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=FP8_BLOCK,
        SWAP_AB=swap_ab,
        EVEN_K=k % FP8_BLOCK == 0,
    )
    return out.to(torch.bfloat16)


def act_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K/128)]): the per-token, per-128 activation
    quantization, in torch (the same function as the reference: it is a cheap elementwise pass)."""
    return act_quant_fp8_ref(x)


def fp8_linear(x: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp32) -> bf16 [M, N]: act quantization + FP8 GEMM, as `numerics.linear`."""
    q, s = act_quant_fp8(x)
    return fp8_gemm(q, s, b, b_scale)


COMPILE_SIGNATURE = {
    "a_ptr": "*fp8e4nv",
    "a_scale_ptr": "*fp32",
    "b_ptr": "*fp8e4nv",
    "b_scale_ptr": "*u8",
    "c_ptr": "*bf16",
    "M": "i32",
    "N": "i32",
    "K": "i32",
    "stride_am": "i32",
    "stride_asm": "i32",
    "stride_bn": "i32",
    "stride_bsn": "i32",
    "stride_cm": "i32",
    "BLOCK_M": "constexpr",
    "BLOCK_N": "constexpr",
    "BLOCK_K": "constexpr",
    "SWAP_AB": "constexpr",
    "EVEN_K": "constexpr",
}
# multiples of 16 at DeepSeek-V4-Flash's dims (registry.py): N and K of every FP8 projection and the
# row strides that equal them; not M, nor the scale strides ceil(K/128) (8 for K=1024)
ALIGNED_INTS = ("N", "K", "stride_am", "stride_bn", "stride_cm")

# (config name, signature, constexprs) for the CPU compile checks (tests/kernels/test_compile.py)
_K = {"BLOCK_K": 128, "EVEN_K": True}  # every model K is a multiple of 128
COMPILE_CONFIGS = (
    ("prefill", COMPILE_SIGNATURE, {**_K, "BLOCK_M": 64, "BLOCK_N": 128, "SWAP_AB": False}),
    ("decode", COMPILE_SIGNATURE, {**_K, "BLOCK_M": 16, "BLOCK_N": 128, "SWAP_AB": True}),
    ("decode_noswap", COMPILE_SIGNATURE, {**_K, "BLOCK_M": 16, "BLOCK_N": 128, "SWAP_AB": False}),
)
