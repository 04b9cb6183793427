"""Grouped MXFP4 expert GEMMs for the routed experts (reference: `fp4_moe_ref`), in Triton.

Flow (`fp4_moe`), tokens T, top-k k, experts E, model dim D, expert inter dim I:
  1. `moe_align`: the T*k slots (flat = token * k + j) sorted by expert and padded per expert to a
     multiple of BLOCK_M (pad id = T*k); one expert id per block (-1 for padding blocks that fill a
     fixed-size grid; experts with no tokens get no block).
  2. act_quant(x) in torch: e4m3 [T, D] + fp32 pow2 scales [T, ceil(D/128)].
  3. kernel, GATE_UP=True: per (block, I tile) gate = x @ W1[e]^T and up = x @ W3[e]^T, each rounded
     to bf16, clamped SwiGLU (gate <= limit, |up| <= limit), times the routing weight, rounded to bf16
     -> act [T*k, I] (row = slot).
  4. act_quant(act) in torch (not yet fused: it needs a whole 128-channel row of act).
  5. kernel, GATE_UP=False: per (block, D tile) y = act @ W2[e]^T rounded to bf16 -> [T*k, D].
  6. out[t] = sum_j y[t*k + j] in fp32 (torch); the caller adds the shared expert.

Weights stay packed e2m1 (uint8/int8 [E, N, K/2], low nibble = even K) with e8m0 scales
[E, N, K/32] and are dequantized in registers: the code and the scale byte (loaded once per 32 K and
broadcast) are assembled into fp32 bits, exact, then cast to bf16 (exact too: at most 2 significant
bits) and interleaved back into K order for a bf16 tensor-core dot with fp32 accumulation; the FP8
activations are dequantized with their per-128 scale the same way (e4m3 times a power of two is
exact in bf16). So every product is exact and only the fp32 summation order differs from the
reference. Hopper has no FP4 MMA (this is the upcast path); bf16 roundings use an explicit
round-to-nearest-even bit trick so the interpreter (which truncates fp32->bf16 casts) and the GPU
round alike. Under the interpreter tiles are fp32 (DOT_FP32) and the outputs fp32 holding bf16
values; a GPU build uses bf16 operands and bf16 outputs.

A tile is computed transposed, out^T = W @ A^T: the dequantized weight tile is the dot's left
operand, so the warps split its rows instead of each holding all of it, and on Hopper a 16-slot
decode block is the N side of a 64-row wgmma. On mma.sync GPUs (sm_120) the right operand
[BLOCK_K, BLOCK_M] is held whole by every warp, so 64-row blocks take BLOCK_K 64 (`pick_block_k`);
at 128 they spill. The wrapper sets EVEN_K when K is a multiple of BLOCK_K, dropping the K masks.
K (D for GATE_UP, I for the down GEMM) must be a multiple of 32; N is free.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_kernels.fp8_gemm_ref import act_quant_fp8_ref
from dsv4_kernels.outputs import output_buffer


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
def _load_fp4_tile(w_ptrs, ws_ptrs, w_mask, ws_mask, DOT_FP32: tl.constexpr):
    """Packed [BN, BK/2] bytes and their [BN, BK/32] scale bytes -> the dequantized [BN, BK] tile
    (low nibble = even K). Each scale byte is loaded once and broadcast over its 16 packed bytes."""
    packed = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.int32) & 0xFF
    s_raw = tl.load(ws_ptrs, mask=ws_mask, other=0).to(tl.int32) & 0xFF
    scale = (s_raw << 23).to(tl.float32, bitcast=True)  # 2^(byte-127)
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (scale.shape[0], scale.shape[1], 16)), packed.shape)
    w = tl.join(_dequant_e2m1(packed & 0xF, scale), _dequant_e2m1(packed >> 4, scale))
    w = tl.reshape(w, (packed.shape[0], 2 * packed.shape[1]))
    if not DOT_FP32:
        w = w.to(tl.bfloat16)
    return w


@triton.jit
def fp4_moe_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    w3_ptr,
    w3_scale_ptr,
    out_ptr,
    topk_weight_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_slots,
    N,
    K,
    limit,
    stride_am,
    stride_asm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_om,
    A_ROW_DIV: tl.constexpr,
    GATE_UP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One (expert block of BLOCK_M slots, BLOCK_N output columns) tile, computed transposed
    ([BLOCK_N, BLOCK_M], see the module doc). A row = slot // A_ROW_DIV (the token for GATE_UP, the
    slot itself for the down GEMM). BLOCK_K divides 128. EVEN_K (K a multiple of BLOCK_K) drops the
    K masks."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_b)
    if expert < 0:
        return
    slots = tl.load(sorted_ids_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = slots < num_slots
    a_rows = tl.where(row_ok, slots, 0) // A_ROW_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_kp = tl.arange(0, BLOCK_K // 2)  # packed byte index in the tile
    offs_ks = tl.arange(0, BLOCK_K // 32)  # scale index in the tile
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_off = expert.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_kp[None, :]
    ws_off = expert.to(tl.int64) * stride_wse + offs_n[:, None] * stride_wsn + offs_ks[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a_mask = row_ok[:, None]
        w_mask = n_ok[:, None]
        ws_mask = n_ok[:, None]
        if not EVEN_K:
            a_mask = a_mask & (offs_k < K - k0)[None, :]
            w_mask = w_mask & (offs_kp < (K - k0) // 2)[None, :]
            ws_mask = ws_mask & (offs_ks < (K - k0) // 32)[None, :]
        a = tl.load(a_ptrs + k0, mask=a_mask, other=0.0).to(tl.float32)
        a_s = tl.load(a_scale_ptr + a_rows * stride_asm + k0 // 128, mask=row_ok, other=0.0)
        a = a * a_s[:, None]  # exact
        if not DOT_FP32:
            a = a.to(tl.bfloat16)
        a = tl.trans(a)  # [BK, BM]
        w = _load_fp4_tile(w_ptr + w_off + k0 // 2, w_scale_ptr + ws_off + k0 // 32, w_mask, ws_mask, DOT_FP32)
        acc = tl.dot(w, a, acc)
        if GATE_UP:
            u = _load_fp4_tile(w3_ptr + w_off + k0 // 2, w3_scale_ptr + ws_off + k0 // 32, w_mask, ws_mask, DOT_FP32)
            acc3 = tl.dot(u, a, acc3)
    out = _round_bf16(acc)  # [BN, BM]
    if GATE_UP:
        up = _round_bf16(acc3)
        if limit > 0:
            out = tl.minimum(out, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        route_w = tl.load(topk_weight_ptr + slots, mask=row_ok, other=0.0)
        out = _round_bf16(route_w[None, :] * (out / (1.0 + tl.exp(-out)) * up))
    o_ptrs = out_ptr + slots.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & row_ok[None, :])


def interpreting() -> bool:
    """True when @triton.jit builds interpreter functions (TRITON_INTERPRET=1 at import time)."""
    return not isinstance(fp4_moe_gemm_kernel, triton.runtime.JITFunction)


def store_dtype() -> torch.dtype:
    """What the kernel stores: bf16 on a GPU, fp32 (holding bf16 values) under the interpreter."""
    return torch.float32 if interpreting() else torch.bfloat16


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, num_blocks: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted slot ids int32 [B * block_m], expert id per block int32 [B]).

    Slots of one expert are contiguous (in slot order) and padded to a multiple of block_m with the
    id T*k; experts without tokens get no block. `num_blocks` pads the block list with expert id -1
    (blocks the kernel skips) to a fixed count, e.g. the bound cdiv(T*k, block_m) + min(T*k, E), for
    a grid that does not depend on the routing; it must be at least the count needed.
    """
    flat = topk_ids.flatten().to(torch.int64)
    num_slots = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    needed = int(padded.sum()) // block_m
    total = needed if num_blocks is None else num_blocks
    if total < needed:
        raise ValueError(f"num_blocks={num_blocks} is below the {needed} blocks these ids need")
    sorted_ids = torch.full((total * block_m,), num_slots, dtype=torch.int32, device=topk_ids.device)
    expert_ids = torch.full((total,), -1, dtype=torch.int32, device=topk_ids.device)
    starts = torch.cumsum(padded, 0) - padded
    offset = 0
    for e in torch.nonzero(counts).flatten().tolist():
        c, s = int(counts[e]), int(starts[e])
        sorted_ids[s : s + c] = order[offset : offset + c].to(torch.int32)
        expert_ids[s // block_m : (s + int(padded[e])) // block_m] = e
        offset += c
    return sorted_ids, expert_ids


def _u8(t: torch.Tensor) -> torch.Tensor:
    """Packed codes (int8/uint8) or e8m0 scales (float8_e8m0fnu/uint8) as raw bytes."""
    if t.dtype not in (torch.int8, torch.uint8, torch.float8_e8m0fnu):
        raise TypeError(f"FP4 weights and scales are bytes (int8/uint8/float8_e8m0fnu), got {t.dtype}")
    return t.contiguous().view(torch.uint8)


def fp4_moe_gemm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_slots: int,
    a_row_div: int,
    w3: torch.Tensor | None = None,
    w3_scale: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    limit: float = 0.0,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 128,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One grouped GEMM launch. a_q e4m3 [rows, K], a_scale fp32 [rows, ceil(K/128)]; w packed
    [E, N, K/2], w_scale e8m0 [E, N, K/32]; returns [num_slots, N] (bf16 values; fp32 storage when
    interpreting). With w3 given, the gate/up form (topk_weights fp32 [num_slots] required).
    `out` ([num_slots, N], row stride free, dtype `store_dtype()`) receives the stores."""
    e_, n, half_k = w.shape
    k = a_q.shape[1]
    if k % 32 or half_k * 2 != k or tuple(w_scale.shape) != (e_, n, k // 32):
        raise ValueError(f"FP4 weights [{e_}, {n}, {half_k}] / scales {tuple(w_scale.shape)} do not fit K={k}")
    if 128 % block_k or block_k % 32 or len(sorted_ids) != len(expert_ids) * block_m:
        raise ValueError("block_k must divide 128 and be a multiple of 32; sorted_ids must fill the blocks")
    gate_up = w3 is not None
    a_q, a_scale = a_q.contiguous(), a_scale.float().contiguous()
    w, w_scale = _u8(w), _u8(w_scale)
    w3, w3_scale = (_u8(w3), _u8(w3_scale)) if gate_up else (w, w_scale)
    if gate_up and (w3.stride() != w.stride() or w3_scale.stride() != w_scale.stride()):
        raise ValueError("w1 and w3 must share one layout")
    route_w = topk_weights.float().contiguous().flatten() if gate_up else a_scale
    out = output_buffer(out, (num_slots, n), store_dtype(), a_q.device)
    grid = (len(expert_ids), triton.cdiv(n, block_n))
    fp4_moe_gemm_kernel[grid](
        a_q,
        a_scale,
        w,
        w_scale,
        w3,
        w3_scale,
        out,
        route_w,
        sorted_ids,
        expert_ids,
        num_slots,
        n,
        k,
        float(limit),
        a_q.stride(0),
        a_scale.stride(0),
        w.stride(0),
        w.stride(1),
        w_scale.stride(0),
        w_scale.stride(1),
        out.stride(0),
        A_ROW_DIV=a_row_div,
        GATE_UP=gate_up,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        DOT_FP32=interpreting(),
    )
    return out


def pick_block_m(num_slots: int, num_experts: int) -> int:
    """Decode (a few slots per expert) takes the smallest dot tile, 16; prefill 64."""
    return 16 if num_slots <= 4 * num_experts else 64


def pick_block_k(block_m: int) -> int:
    """128 (one activation scale block per step) for decode blocks; 64 for 64-row blocks, whose
    [BLOCK_K, BLOCK_M] activation operand each warp holds whole on mma.sync GPUs: at 128 it spills."""
    return 128 if block_m < 64 else 64


def fp4_moe(
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w3: torch.Tensor,
    w3_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    limit: float,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int | None = None,
    num_blocks: int | None = None,
    outs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [T, D] bf16, W1/W3 [E, I, D/2] + [E, I, D/32], W2 [E, D, I/2] + [E, D, I/32], topk [T, k]
    (weights fp32, already route-scaled) -> routed-expert sum fp32 [T, D] (module contract above).
    `outs`: optional (act [T*k, I], y [T*k, D]) buffers for the two launches."""
    t, k = topk_ids.shape
    num_slots = t * k
    bm = block_m or pick_block_m(num_slots, w1.shape[0])
    bk = block_k or pick_block_k(bm)
    sorted_ids, expert_ids = moe_align(topk_ids, w1.shape[0], bm, num_blocks)
    x_q, x_s = act_quant_fp8_ref(x)
    act_out, y_out = outs or (None, None)
    act = fp4_moe_gemm(
        x_q,
        x_s,
        w1,
        w1_scale,
        sorted_ids,
        expert_ids,
        num_slots,
        k,
        w3=w3,
        w3_scale=w3_scale,
        topk_weights=topk_weights,
        limit=limit,
        block_m=bm,
        block_n=block_n,
        block_k=bk,
        out=act_out,
    )
    act_q, act_s = act_quant_fp8_ref(act)
    y = fp4_moe_gemm(
        act_q,
        act_s,
        w2,
        w2_scale,
        sorted_ids,
        expert_ids,
        num_slots,
        1,
        block_m=bm,
        block_n=block_n,
        block_k=bk,
        out=y_out,
    )
    return y.float().view(t, k, -1).sum(dim=1)


_SIG = {
    "a_ptr": "*fp8e4nv",
    "a_scale_ptr": "*fp32",
    "w_ptr": "*u8",
    "w_scale_ptr": "*u8",
    "w3_ptr": "*u8",
    "w3_scale_ptr": "*u8",
    "out_ptr": "*bf16",
    "topk_weight_ptr": "*fp32",
    "sorted_ids_ptr": "*i32",
    "expert_ids_ptr": "*i32",
    "num_slots": "i32",
    "N": "i32",
    "K": "i32",
    "limit": "fp32",
    "stride_am": "i32",
    "stride_asm": "i32",
    "stride_we": "i32",
    "stride_wn": "i32",
    "stride_wse": "i32",
    "stride_wsn": "i32",
    "stride_om": "i32",
    "A_ROW_DIV": "constexpr",
    "GATE_UP": "constexpr",
    "BLOCK_M": "constexpr",
    "BLOCK_N": "constexpr",
    "BLOCK_K": "constexpr",
    "EVEN_K": "constexpr",
    "DOT_FP32": "constexpr",
}
# multiples of 16 at DeepSeek-V4-Flash's dims (registry.py; D=4096, I=2048): N, K, the activation,
# weight and output strides and the scale strides K/128 and K/32; not the slot count
ALIGNED_INTS = ("N", "K", "stride_am", "stride_asm", "stride_we", "stride_wn", "stride_wse", "stride_wsn", "stride_om")
_GPU = {"EVEN_K": True, "DOT_FP32": False}

# (config name, signature, constexprs) for the CPU compile checks (tests/kernels/test_compile.py)
COMPILE_CONFIGS = (
    ("gate_up_decode", _SIG, {**_GPU, "A_ROW_DIV": 6, "GATE_UP": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}),
    ("gate_up_prefill", _SIG, {**_GPU, "A_ROW_DIV": 6, "GATE_UP": True, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}),
    ("down_decode", _SIG, {**_GPU, "A_ROW_DIV": 1, "GATE_UP": False, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128}),
    ("down_prefill", _SIG, {**_GPU, "A_ROW_DIV": 1, "GATE_UP": False, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}),
)
