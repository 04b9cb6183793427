"""Grouped MXFP4 expert GEMMs for the routed experts (reference: `fp4_moe_ref`), in Triton.

Flow (`fp4_moe`), tokens T, top-k k, experts E, model dim D, expert inter dim I; four launches, no
host sync, a grid that depends on (T, k, E) only:
  1. `moe_align` (moe_align.py, one program): the T*k routes (flat = token * k + j) sorted by expert
     and padded per expert to a multiple of BLOCK_M (pad id T*k); one expert id per block, -1 for the
     blocks past the used ones (a fixed count: cdiv(T*k, BLOCK_M) + min(T*k, E)).
  2. kernel, GATE_UP: per (block, 128 I channels) x is quantized to FP8 in the K loop (QUANT_A: the
     reference's act_quant, exactly, fp4_moe_tiles.py), gate = x @ W1[e]^T and up = x @ W3[e]^T, each
     rounded to bf16, clamped SwiGLU (gate <= limit, |up| <= limit), times the routing weight, rounded
     to bf16; the epilogue quantizes that to FP8 itself (QUANT_OUT: the 128-wide tile is one whole
     activation block of each row) -> act e4m3 [T*k, I] + fp32 scales [T*k, ceil(I/128)].
  3. kernel, down: per (block, D tile) y = act @ W2[e]^T rounded to bf16 -> [T*k, D].
  4. out[t] = sum_j y[t*k + j] in fp32: one torch reduction. Fusing it into the down kernel would
     need atomic adds, whose order (and so the fp32 sum) changes from run to run on a GPU.

Two weight sources (`ExpertSlots`): the GEMM kernel reads expert e from the device slots when
slot_of_expert[e] >= 0 (slots + slot * stride), else from the stacked [E, ...] tensors passed as the
weights (the host bank: on a GPU a pinned host tensor, read in place over PCIe through unified
virtual addressing). The choice is one scalar branch per block between two pointer arguments of one
type and layout, which both the compiler (an scf.if yielding the bases) and the interpreter (plain
Python) take. Without slots the stacked tensors are the resident experts.

Weights stay packed e2m1 (uint8/int8 [E, N, K/2], low nibble = even K) with e8m0 scales
[E, N, K/32] and are dequantized in registers (exact), then cast to bf16 (exact too) for a bf16
tensor-core dot with fp32 accumulation; the FP8 activations are dequantized with their per-128 scale
the same way (e4m3 times a power of two is exact in bf16). So every product is exact and only the
fp32 summation order differs from the reference. Hopper has no FP4 MMA (this is the upcast path);
bf16 roundings use an explicit round-to-nearest-even bit trick so the interpreter (which truncates
fp32->bf16 casts) and the GPU round alike. Under the interpreter tiles are fp32 (DOT_FP32) and the
down GEMM stores fp32 holding bf16 values; a GPU build uses bf16 operands and bf16 outputs.

A tile is computed transposed, out^T = W @ A^T: the dequantized weight tile is the dot's left
operand, so the warps split its rows instead of each holding all of it, and on Hopper a 16-route
decode block is the N side of a 64-row wgmma. On mma.sync GPUs (sm_120) the right operand
[BLOCK_K, BLOCK_M] is held whole by every warp, so 64-row blocks take BLOCK_K 64 (`pick_block_k`;
at 128 they spill); the gate/up form, with two accumulators and two weight tiles, takes 64 (32 for
64-row blocks on sm_120). The wrapper sets EVEN_K when K is a multiple of BLOCK_K, dropping the K masks.
K (D for GATE_UP, I for the down GEMM) must be a multiple of 32; N is free.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4_kernels.fp4_moe_tiles import _act_tile, _load_fp4_tile, _quantize_rows, _round_bf16
from dsv4_kernels.moe_align import align_blocks, moe_align
from dsv4_kernels.outputs import output_buffer

GATE_UP_BLOCK_N = 128  # one whole FP8 activation block of act per tile: the epilogue quantizes it

__all__ = ["ExpertSlots", "align_blocks", "fp4_moe", "fp4_moe_gemm", "moe_align", "store_dtype"]


@triton.jit
def fp4_moe_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    w3_ptr,
    w3_scale_ptr,
    sw_ptr,
    sw_scale_ptr,
    sw3_ptr,
    sw3_scale_ptr,
    slot_of_expert_ptr,
    out_ptr,
    out_scale_ptr,
    topk_weight_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_routes,
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
    stride_osm,
    A_ROW_DIV: tl.constexpr,
    GATE_UP: tl.constexpr,
    QUANT_A: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    ROUND_BITS: tl.constexpr,
):
    """One (expert block of BLOCK_M routes, BLOCK_N output columns) tile, computed transposed
    ([BLOCK_N, BLOCK_M], see the module doc). A row = route // A_ROW_DIV (the token for GATE_UP, the
    route itself for the down GEMM). BLOCK_K divides 128. SLOTS: the expert's weights come from the
    sw* slots when slot_of_expert[expert] >= 0 (same per-expert strides), else from w*."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_b)
    if expert < 0:
        return
    src = expert.to(tl.int64)
    w_base, ws_base, w3_base, w3s_base = w_ptr, w_scale_ptr, w3_ptr, w3_scale_ptr
    if SLOTS:
        slot = tl.load(slot_of_expert_ptr + expert)
        if slot >= 0:
            src = slot.to(tl.int64)
            w_base, ws_base, w3_base, w3s_base = sw_ptr, sw_scale_ptr, sw3_ptr, sw3_scale_ptr
    routes = tl.load(sorted_ids_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = routes < num_routes
    a_rows = tl.where(row_ok, routes, 0) // A_ROW_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_kp = tl.arange(0, BLOCK_K // 2)  # packed byte index in the tile
    offs_ks = tl.arange(0, BLOCK_K // 32)  # scale index in the tile
    w_off = src * stride_we + offs_n[:, None] * stride_wn + offs_kp[None, :]
    ws_off = src * stride_wse + offs_n[:, None] * stride_wsn + offs_ks[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_mask = n_ok[:, None]
        ws_mask = n_ok[:, None]
        if not EVEN_K:
            w_mask = w_mask & (offs_kp < (K - k0) // 2)[None, :]
            ws_mask = ws_mask & (offs_ks < (K - k0) // 32)[None, :]
        a = _act_tile(
            a_ptr, a_scale_ptr, a_rows, row_ok, k0, K, stride_am, stride_asm, QUANT_A, BLOCK_K, EVEN_K, ROUND_BITS
        )
        if not DOT_FP32:
            a = a.to(tl.bfloat16)
        a = tl.trans(a)  # [BK, BM]
        w = _load_fp4_tile(w_base + w_off + k0 // 2, ws_base + ws_off + k0 // 32, w_mask, ws_mask, DOT_FP32)
        acc = tl.dot(w, a, acc)
        if GATE_UP:
            u = _load_fp4_tile(w3_base + w_off + k0 // 2, w3s_base + ws_off + k0 // 32, w_mask, ws_mask, DOT_FP32)
            acc3 = tl.dot(u, a, acc3)
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


def interpreting() -> bool:
    """True when @triton.jit builds interpreter functions (TRITON_INTERPRET=1 at import time)."""
    return not isinstance(fp4_moe_gemm_kernel, triton.runtime.JITFunction)


def store_dtype() -> torch.dtype:
    """What the kernel stores unquantized: bf16 on a GPU, fp32 (holding bf16 values) under the interpreter."""
    return torch.float32 if interpreting() else torch.bfloat16


@dataclass(frozen=True)
class ExpertSlots:
    """A second weight source: device slots holding some experts, stacked like the weights ([S, ...] per
    part, in FP4_PARTS order: w1, w1_scale, w3, w3_scale, w2, w2_scale), and which expert is where."""

    slot_of_expert: torch.Tensor  # [E] int32, -1: not in a slot (read from the stacked weights)
    parts: tuple[torch.Tensor, ...]  # the six [S, N, K/2] / [S, N, K/32] tensors


def _u8(t: torch.Tensor) -> torch.Tensor:
    """Packed codes (int8/uint8) or e8m0 scales (float8_e8m0fnu/uint8) as raw bytes."""
    if t.dtype not in (torch.int8, torch.uint8, torch.float8_e8m0fnu):
        raise TypeError(f"FP4 weights and scales are bytes (int8/uint8/float8_e8m0fnu), got {t.dtype}")
    return t.contiguous().view(torch.uint8)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape[1:] == b.shape[1:] and a.stride() == b.stride()


def fp4_moe_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_routes: int,
    a_row_div: int,
    w3: torch.Tensor | None = None,
    w3_scale: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    limit: float = 0.0,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 128,
    out: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    quant_out: bool = False,
    slots: tuple[torch.Tensor, ...] | None = None,  # (w, w_scale) or, gate/up, (w1, w1_scale, w3, w3_scale)
    slot_of_expert: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One grouped GEMM launch. `a`: e4m3 [rows, K] with fp32 `a_scale` [rows, ceil(K/128)], or bf16 /
    fp32 with a_scale None (quantized in the kernel); w packed [E, N, K/2], w_scale e8m0 [E, N, K/32].
    With w3 given, the gate/up form (topk_weights fp32 [num_routes] required). Returns [num_routes, N]
    (bf16 values; fp32 storage when interpreting), or with `quant_out` (gate/up, block_n 128) the FP8
    pair (e4m3 [num_routes, N], fp32 [num_routes, ceil(N/128)]). `out` / `out_scale` (row strides
    free) receive the stores. `slots` (w, w_scale, w3, w3_scale [S, ...], as the weights) with
    `slot_of_expert` [E] int32: the second weight source (module doc). `num_warps` / `num_stages`: Triton's
    launch options instead of LAUNCH_OPTIONS' and Triton's default (bench/gpu_fp4_sweep.py times the choices)."""
    e_, n, half_k = w.shape
    k = a.shape[1]
    if k % 32 or half_k * 2 != k or tuple(w_scale.shape) != (e_, n, k // 32):
        raise ValueError(f"FP4 weights [{e_}, {n}, {half_k}] / scales {tuple(w_scale.shape)} do not fit K={k}")
    if 128 % block_k or block_k % 32 or len(sorted_ids) != len(expert_ids) * block_m:
        raise ValueError("block_k must divide 128 and be a multiple of 32; sorted_ids must fill the blocks")
    gate_up = w3 is not None
    if quant_out and not (gate_up and block_n == GATE_UP_BLOCK_N):
        raise ValueError(f"quant_out is the gate/up epilogue with block_n {GATE_UP_BLOCK_N}")
    a = a if a.stride(-1) == 1 else a.contiguous()
    quant_a = a_scale is None
    a_scale = a if a_scale is None else a_scale.float().contiguous()  # QUANT_A: a pointer never read
    w, w_scale = _u8(w), _u8(w_scale)
    if w3 is None:
        w3, w3_scale, route_w = w, w_scale, a_scale  # never read outside the gate/up form
    elif w3_scale is None or topk_weights is None:
        raise ValueError("the gate/up form (w3 given) needs w3_scale and topk_weights")
    else:
        w3, w3_scale = _u8(w3), _u8(w3_scale)
        route_w = topk_weights.float().contiguous().flatten()
    if gate_up and not (_same_layout(w3, w) and _same_layout(w3_scale, w_scale)):
        raise ValueError("w1 and w3 must share one layout")
    sources = _slot_sources(slots, slot_of_expert, (w, w_scale, w3, w3_scale), gate_up, e_)
    if quant_out:
        out = output_buffer(out, (num_routes, n), torch.float8_e4m3fn, a.device)
        out_scale = output_buffer(out_scale, (num_routes, triton.cdiv(n, 128)), torch.float32, a.device)
    else:
        out = output_buffer(out, (num_routes, n), store_dtype(), a.device)
        out_scale = out  # never written
    grid = (len(expert_ids), triton.cdiv(n, block_n))
    fp4_moe_gemm_kernel[grid](
        a,
        a_scale,
        w,
        w_scale,
        w3,
        w3_scale,
        *sources,
        out,
        out_scale,
        route_w,
        sorted_ids,
        expert_ids,
        num_routes,
        n,
        k,
        float(limit),
        a.stride(0),
        0 if quant_a else a_scale.stride(0),
        w.stride(0),
        w.stride(1),
        w_scale.stride(0),
        w_scale.stride(1),
        out.stride(0),
        out_scale.stride(0),
        A_ROW_DIV=a_row_div,
        GATE_UP=gate_up,
        QUANT_A=quant_a,
        QUANT_OUT=quant_out,
        SLOTS=slots is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=k % block_k == 0,
        DOT_FP32=interpreting(),
        ROUND_BITS=interpreting(),
        num_warps=num_warps or _num_warps(gate_up, block_m),
        **({"num_stages": num_stages} if num_stages else {}),
    )
    return (out, out_scale) if quant_out else out


def _slot_sources(slots, slot_of_expert, weights: tuple[torch.Tensor, ...], gate_up: bool, num_experts: int):
    """(sw, sw_scale, sw3, sw3_scale, slot_of_expert) launch arguments: the slots, checked to share the
    weights' per-expert layout, or the weights themselves (never read without SLOTS)."""
    if slots is None:
        return (*weights, weights[0])
    if slot_of_expert is None or slot_of_expert.dtype != torch.int32 or slot_of_expert.shape != (num_experts,):
        raise ValueError(f"slots need slot_of_expert int32 [{num_experts}]")
    sw, sws = _u8(slots[0]), _u8(slots[1])
    sw3, sws3 = (_u8(slots[2]), _u8(slots[3])) if gate_up else (sw, sws)
    for s, ref in zip((sw, sws, sw3, sws3), weights):
        if not _same_layout(s, ref):
            raise ValueError(f"slots {tuple(s.shape)} must be laid out as the weights {tuple(ref.shape)}")
    return sw, sws, sw3, sws3, slot_of_expert


def pick_block_m(num_routes: int, num_experts: int) -> int:
    """Decode (a few routes per expert) takes the smallest dot tile, 16; prefill 64."""
    return 16 if num_routes <= 4 * num_experts else 64


def pick_block_k(block_m: int, gate_up: bool = False, device: torch.device | None = None) -> int:
    """The down GEMM: 128 (one activation scale block per step) for decode blocks, 64 for 64-row blocks,
    whose [BLOCK_K, BLOCK_M] activation operand each warp holds whole on mma.sync GPUs (at 128 it spills).
    The gate/up form holds two [128, BLOCK_M] fp32 accumulators and two weight tiles: 64, and 32 for
    64-row blocks on GPUs without wgmma (Hopper's wgmma reads that operand from shared memory)."""
    if not gate_up:
        return 128 if block_m < 64 else 64
    return 32 if block_m >= 64 and not _has_wgmma(device) else 64


def _has_wgmma(device: torch.device | None) -> bool:
    """True on sm_90 / sm_100 (and under the interpreter, which has no arch: the tests take the sm_90 tiles)."""
    if device is None or device.type != "cuda":
        return True
    return _sm_major(device.index if device.index is not None else torch.cuda.current_device()) in (9, 10)


@functools.cache
def _sm_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def _num_warps(gate_up: bool, block_m: int) -> int:
    """LAUNCH_OPTIONS below: 8 for the gate/up tiles (two weight tiles dequantized a step: at batch-1 decode on
    an H200, bench/gpu_fp4_sweep.py, 8 warps took 183 us where 4 took 258, the best of BLOCK_K 32 / 64 / 128
    and 2-4 stages; the 64-row prefill tile holds two [128, 64] fp32 accumulators), 4 for the down GEMM
    (8 were slower there at every tile)."""
    return 8 if gate_up else 4


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
    outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    slots: ExpertSlots | None = None,
    usage: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, D] bf16 (or fp32), W1/W3 [E, I, D/2] + [E, I, D/32], W2 [E, D, I/2] + [E, D, I/32], topk [T, k]
    (weights fp32, already route-scaled) -> routed-expert sum fp32 [T, D] (module contract above).
    `outs`: optional (act e4m3 [T*k, I], act scales fp32 [T*k, ceil(I/128)], y [T*k, D]) buffers;
    `block_n`: the down GEMM's N tile. `slots`: experts read from device slots instead (module doc);
    `usage` int64 [E + 1] (needs `slots`): the expert-slot cache's record (moe_align.py)."""
    t, k = topk_ids.shape
    num_routes = t * k
    bm = block_m or pick_block_m(num_routes, w1.shape[0])
    bk_up = block_k or pick_block_k(bm, True, x.device)
    bk_down = block_k or pick_block_k(bm)
    slot_map = slots.slot_of_expert if slots is not None else None
    if usage is not None and slots is None:
        raise ValueError("usage records which experts came from slots: it needs slots")
    sorted_ids, expert_ids = moe_align(topk_ids, w1.shape[0], bm, usage, slot_map if usage is not None else None)
    act_q, act_s, y_out = outs or (None, None, None)
    act_q, act_s = fp4_moe_gemm(
        x,
        None,
        w1,
        w1_scale,
        sorted_ids,
        expert_ids,
        num_routes,
        k,
        w3=w3,
        w3_scale=w3_scale,
        topk_weights=topk_weights,
        limit=limit,
        block_m=bm,
        block_n=GATE_UP_BLOCK_N,
        block_k=bk_up,
        out=act_q,
        out_scale=act_s,
        quant_out=True,
        slots=slots.parts[:4] if slots is not None else None,
        slot_of_expert=slot_map,
    )
    y = fp4_moe_gemm(
        act_q,
        act_s,
        w2,
        w2_scale,
        sorted_ids,
        expert_ids,
        num_routes,
        1,
        block_m=bm,
        block_n=block_n,
        block_k=bk_down,
        out=y_out,
        slots=slots.parts[4:] if slots is not None else None,
        slot_of_expert=slot_map,
    )
    assert isinstance(y, torch.Tensor)  # without quant_out the GEMM returns one tensor, not a pair
    return torch.sum(y.view(t, k, -1), dim=1, dtype=torch.float32)


_SIG = {
    "a_ptr": "*fp8e4nv",
    "a_scale_ptr": "*fp32",
    "w_ptr": "*u8",
    "w_scale_ptr": "*u8",
    "w3_ptr": "*u8",
    "w3_scale_ptr": "*u8",
    "sw_ptr": "*u8",
    "sw_scale_ptr": "*u8",
    "sw3_ptr": "*u8",
    "sw3_scale_ptr": "*u8",
    "slot_of_expert_ptr": "*i32",
    "out_ptr": "*bf16",
    "out_scale_ptr": "*bf16",
    "topk_weight_ptr": "*fp32",
    "sorted_ids_ptr": "*i32",
    "expert_ids_ptr": "*i32",
    "num_routes": "i32",
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
    "stride_osm": "i32",
    "A_ROW_DIV": "constexpr",
    "GATE_UP": "constexpr",
    "QUANT_A": "constexpr",
    "QUANT_OUT": "constexpr",
    "SLOTS": "constexpr",
    "BLOCK_M": "constexpr",
    "BLOCK_N": "constexpr",
    "BLOCK_K": "constexpr",
    "EVEN_K": "constexpr",
    "DOT_FP32": "constexpr",
    "ROUND_BITS": "constexpr",
}
# what the model launches: gate/up reads bf16 x (a_scale_ptr: x's own pointer, unread) and stores e4m3 act
# with fp32 scales; the down GEMM reads those and stores bf16 (out_scale_ptr: its own output, unread)
_GATE_UP_SIG = {**_SIG, "a_ptr": "*bf16", "a_scale_ptr": "*bf16", "out_ptr": "*fp8e4nv", "out_scale_ptr": "*fp32"}
# multiples of 16 at DeepSeek-V4-Flash's dims (registry.py; D=4096, I=2048): N, K, the weight strides
# and the scale strides K/32, the row strides of x / act (K) and of the down output (D); not the route
# count, nor the activation-scale strides K/128 (16 for D, but 16 also divides I/128 = 16: kept out, as
# the scale row strides of a tiny model are not)
ALIGNED_INTS = ("N", "K", "stride_am", "stride_we", "stride_wn", "stride_wse", "stride_wsn", "stride_om")
_GPU = {"EVEN_K": True, "DOT_FP32": False, "ROUND_BITS": False}
_GATE_UP = {**_GPU, "A_ROW_DIV": 6, "GATE_UP": True, "QUANT_A": True, "QUANT_OUT": True, "BLOCK_N": 128}
_DOWN = {**_GPU, "A_ROW_DIV": 1, "GATE_UP": False, "QUANT_A": False, "QUANT_OUT": False, "BLOCK_N": 64}

# (config name, signature, constexprs) for the CPU compile checks (tests/kernels/test_compile.py): the
# resident experts and the expert-slot cache's two sources (SLOTS), decode and prefill tiles; the 64-row
# gate/up tile takes BLOCK_K 64 where wgmma runs (sm_90) and 32 elsewhere (pick_block_k)
_PHASES = {
    "gate_up": (("decode", 16, 64), ("prefill", 64, 64), ("prefill_bk32", 64, 32)),
    "down": (("decode", 16, 128), ("prefill", 64, 64)),
}
COMPILE_CONFIGS = tuple(
    (f"{form}_{phase}{'_slots' if slots else ''}", sig, {**base, "SLOTS": slots, "BLOCK_M": bm, "BLOCK_K": bk})
    for form, sig, base in (("gate_up", _GATE_UP_SIG, _GATE_UP), ("down", _SIG, _DOWN))
    for phase, bm, bk in _PHASES[form]
    for slots in (False, True)
)
LAUNCH_OPTIONS = {
    name: {"num_warps": _num_warps(bool(cx["GATE_UP"]), cx["BLOCK_M"])} for name, _, cx in COMPILE_CONFIGS
}
LAUNCH_ARCHS = {
    **{name: (90,) for name, _, _ in COMPILE_CONFIGS if name.startswith("gate_up_prefill") and "bk32" not in name},
    **{name: (120,) for name, _, _ in COMPILE_CONFIGS if "bk32" in name},
}
