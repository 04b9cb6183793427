"""Grouped MXFP4 expert GEMMs for the routed experts (reference: `fp4_moe_ref`), in Triton: the kernel
and its launcher `fp4_moe_gemm`. The layer around them (align, gate/up, down, combine) is `fp4_moe_layer`.

The two GEMMs, per 16-route block of one expert:
  - GATE_UP: per (block, 128 I channels) x is quantized to FP8 in the K loop (QUANT_A: the
    reference's act_quant, exactly, fp4_moe_tiles.py), gate = x @ W1[e]^T and up = x @ W3[e]^T, each
    rounded to bf16, clamped SwiGLU (gate <= limit, |up| <= limit), times the routing weight, rounded
    to bf16; the epilogue quantizes that to FP8 itself (QUANT_OUT: the 128-wide tile is one whole
    activation block of each row) -> act e4m3 [T*k, I] + fp32 scales [T*k, ceil(I/128)].
  - down: per (block, D tile) y = act @ W2[e]^T rounded to bf16 -> [T*k, D].

Two weight sources (`slots`, `fp4_moe_layer.ExpertSlots`): the GEMM kernel reads expert e from the device slots when
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

The late-scale form (LoopForm.late_scale) takes the per-weight arithmetic out of the K loop: dequantizing
costs ~16 instructions a weight in the joined form's sm_90 loop (the decode GEMMs are bound by them, not
by HBM: bench/RESULTS.md), while an e2m1 code's bits moved into fp16's fields are the code's value times
2^-14, exactly (e2m1's subnormal 0.5 lands on fp16's subnormal 2^-15). So per 32 channels (one weight
scale) it takes one fp16 dot of those unscaled weights with the activations' e4m3 grid values (exact in
fp16), multiplies each group's fp32 sums by its weight scale and a trip's by the activation scale x 2^14
(powers of two: exact). The products are the same exact products; only the order of the fp32 sums changes.

A tile is computed transposed, out^T = W @ A^T: the dequantized weight tile is the dot's left
operand, so the warps split its rows instead of each holding all of it, and on Hopper a 16-route
decode block is the N side of a 64-row wgmma. On mma.sync GPUs (sm_120) the right operand
[BLOCK_K, BLOCK_M] is held whole by every warp, so 64-row blocks take BLOCK_K 64 (`pick_block_k`;
at 128 they spill); the gate/up form, with two accumulators and two weight tiles, takes 64 (32 for
64-row blocks on sm_120). The wrapper sets EVEN_K when K is a multiple of BLOCK_K, dropping the K masks.
K (D for GATE_UP, I for the down GEMM) must be a multiple of 32; N is free.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_kernels.fp4_moe_choices import (
    LoopForm,
    _num_warps,
)
from dsv4_kernels.fp4_moe_tiles import (
    E2M1_IN_FP16,
    _act_block_scale,
    _act_group,
    _act_operands,
    _epilogue,
    _fp4_dot,
    _late_scale_group,
    _load_fp4_raw,
)
from dsv4_kernels.outputs import output_buffer
from dsv4_kernels.split_k import _split_arrive, _split_sum, split_counters, unsplit_args

GATE_UP_BLOCK_N = 128  # one whole FP8 activation block of act per tile: the epilogue quantizes it

__all__ = ["GATE_UP_BLOCK_N", "LoopForm", "fp4_moe_gemm", "interpreting", "store_dtype"]


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
    part_ptr,
    count_ptr,
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
    stride_ps,
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
    EVEN_ODD: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1,
    LATE_SCALE: tl.constexpr = False,
):
    """One (expert block of BLOCK_M routes, BLOCK_N output columns[, K split]) tile, computed transposed
    ([BLOCK_N, BLOCK_M], see the module doc). A row = route // A_ROW_DIV (the token for GATE_UP, the
    route itself for the down GEMM). BLOCK_K divides 128. SLOTS: the expert's weights come from the
    sw* slots when slot_of_expert[expert] >= 0 (same per-expert strides), else from w*. The K-loop forms
    (fp4_moe.LoopForm): EVEN_ODD, the even and odd K of each tile as two dots (no join); PREFETCH, the next
    tile's bytes loaded before this tile is decoded; SPLIT_K > 1, program axis 2 takes K / SPLIT_K, stores
    its fp32 sums into part_ptr ([SPLIT_K, routes, N (, N more for up)]) and the tile's last split to arrive
    (count_ptr: one counter a tile) adds them and finishes the tile (split_k.py); LATE_SCALE, per 32 channels
    one dot of the weights decoded without their scale (e2m1 bits moved into fp16 by two shifts and two masks
    per pair of weights, the packed bytes read as 4-byte words) and the activations' e4m3 grid values, both
    in one permuted K order, whose sums then take both scales (fp4_moe_tiles._late_scale_group).
    Every form's products are exact and only the fp32 order of the sums differs."""
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
    w_off = src * stride_we + offs_n[:, None] * stride_wn + offs_kp[None, :]
    if EVEN_ODD:  # one scale byte per packed byte (a repeated address: one transaction per 16 bytes)
        ws_off = src * stride_wse + offs_n[:, None] * stride_wsn + (offs_kp // 16)[None, :]
    else:
        ws_off = src * stride_wse + offs_n[:, None] * stride_wsn + tl.arange(0, BLOCK_K // 32)[None, :]
    k_lo = 0
    k_hi = K
    if SPLIT_K > 1:
        k_lo = tl.program_id(2) * (K // SPLIT_K)
        k_hi = k_lo + K // SPLIT_K
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if LATE_SCALE:  # per 32 channels: the unscaled weights' dot, then both scales on its sums
        for k0 in range(k_lo, k_hi, BLOCK_K):
            a_sc, a_inv = _act_block_scale(a_ptr, a_scale_ptr, a_rows, row_ok, k0, K, stride_am, stride_asm, QUANT_A)
            factor = a_sc * E2M1_IN_FP16  # the trip's activation block scale, taken once by its sums
            trip = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            trip3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for g in tl.static_range(BLOCK_K // 32):
                a_g = _act_group(
                    a_ptr, a_rows, row_ok, k0 + 32 * g, K, stride_am, a_inv, QUANT_A, EVEN_K, ROUND_BITS, DOT_FP32
                )
                trip = _late_scale_group(
                    w_base, ws_base, src, stride_we, stride_wse, offs_n, n_ok, stride_wn, stride_wsn, k0 + 32 * g, K,
                    a_g, trip, EVEN_K, DOT_FP32,
                )  # fmt: skip
                if GATE_UP:
                    trip3 = _late_scale_group(
                        w3_base, w3s_base, src, stride_we, stride_wse, offs_n, n_ok, stride_wn, stride_wsn,
                        k0 + 32 * g, K, a_g, trip3, EVEN_K, DOT_FP32,
                    )  # fmt: skip
            acc = acc + trip * factor[None, :]
            if GATE_UP:
                acc3 = acc3 + trip3 * factor[None, :]
    else:
        nw, nws = _load_fp4_raw(w_base, ws_base, w_off, ws_off, n_ok, offs_kp, k_lo, K, PREFETCH, EVEN_K, EVEN_ODD)
        nu, nus = nw, nws
        if GATE_UP:
            nu, nus = _load_fp4_raw(
                w3_base, w3s_base, w_off, ws_off, n_ok, offs_kp, k_lo, K, PREFETCH, EVEN_K, EVEN_ODD
            )
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if PREFETCH:  # this tile's bytes came with the previous step; the next tile's go out now
                cw, cws, cu, cus = nw, nws, nu, nus
                more = k0 + BLOCK_K < k_hi
                nw, nws = _load_fp4_raw(
                    w_base, ws_base, w_off, ws_off, n_ok, offs_kp, k0 + BLOCK_K, K, more, EVEN_K, EVEN_ODD
                )
                if GATE_UP:
                    nu, nus = _load_fp4_raw(
                        w3_base, w3s_base, w_off, ws_off, n_ok, offs_kp, k0 + BLOCK_K, K, more, EVEN_K, EVEN_ODD
                    )
            else:  # up's bytes are loaded after gate's dot (below): fewer registers live at once
                cw, cws = _load_fp4_raw(w_base, ws_base, w_off, ws_off, n_ok, offs_kp, k0, K, True, EVEN_K, EVEN_ODD)
            a0, a1 = _act_operands(
                a_ptr, a_scale_ptr, a_rows, row_ok, k0, K, stride_am, stride_asm,
                QUANT_A, BLOCK_K, EVEN_K, ROUND_BITS, EVEN_ODD, DOT_FP32,
            )  # fmt: skip
            acc = _fp4_dot(cw, cws, a0, a1, acc, EVEN_ODD, DOT_FP32)
            if GATE_UP:
                if not PREFETCH:
                    cu, cus = _load_fp4_raw(
                        w3_base, w3s_base, w_off, ws_off, n_ok, offs_kp, k0, K, True, EVEN_K, EVEN_ODD
                    )
                acc3 = _fp4_dot(cu, cus, a0, a1, acc3, EVEN_ODD, DOT_FP32)
    if SPLIT_K > 1:  # store this split's sums; the tile's last split to arrive adds them all and finishes
        p_ptrs = part_ptr + routes.to(tl.int64)[None, :] * (2 * N if GATE_UP else N) + offs_n[:, None]
        p_mask = n_ok[:, None] & row_ok[None, :]
        tl.store(p_ptrs + tl.program_id(2) * stride_ps, acc, mask=p_mask)
        if GATE_UP:  # up's sums beside gate's, in the same row of part
            tl.store(p_ptrs + tl.program_id(2) * stride_ps + N, acc3, mask=p_mask)
        if _split_arrive(count_ptr, pid_b * tl.num_programs(1) + pid_n, SPLIT_K):
            acc = _split_sum(p_ptrs, p_mask, stride_ps, SPLIT_K)
            if GATE_UP:
                acc3 = _split_sum(p_ptrs + N, p_mask, stride_ps, SPLIT_K)
            _epilogue(
                acc, acc3, routes, row_ok, offs_n, n_ok, pid_n, out_ptr, out_scale_ptr, topk_weight_ptr, limit,
                stride_om, stride_osm, GATE_UP, QUANT_OUT, ROUND_BITS,
            )  # fmt: skip
    else:
        _epilogue(
            acc, acc3, routes, row_ok, offs_n, n_ok, pid_n, out_ptr, out_scale_ptr, topk_weight_ptr, limit,
            stride_om, stride_osm, GATE_UP, QUANT_OUT, ROUND_BITS,
        )  # fmt: skip


def interpreting() -> bool:
    """True when @triton.jit builds interpreter functions (TRITON_INTERPRET=1 at import time)."""
    return not isinstance(fp4_moe_gemm_kernel, triton.runtime.JITFunction)


def store_dtype() -> torch.dtype:
    """What the kernel stores unquantized: bf16 on a GPU, fp32 (holding bf16 values) under the interpreter."""
    return torch.float32 if interpreting() else torch.bfloat16


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
    loop: LoopForm | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One grouped GEMM launch. `a`: e4m3 [rows, K] with fp32 `a_scale` [rows, ceil(K/128)], or bf16 /
    fp32 with a_scale None (quantized in the kernel); w packed [E, N, K/2], w_scale e8m0 [E, N, K/32].
    With w3 given, the gate/up form (topk_weights fp32 [num_routes] required). Returns [num_routes, N]
    (bf16 values; fp32 storage when interpreting), or with `quant_out` (gate/up, block_n 128) the FP8
    pair (e4m3 [num_routes, N], fp32 [num_routes, ceil(N/128)]). `out` / `out_scale` (row strides
    free) receive the stores. `slots` (w, w_scale, w3, w3_scale [S, ...], as the weights) with
    `slot_of_expert` [E] int32: the second weight source (module doc). `num_warps` / `num_stages`: Triton's
    launch options instead of LAUNCH_OPTIONS' and Triton's default; `loop`: the K loop's form (default: the
    joined tile, one pass; bench/gpu_fp4_sweep.py times the choices, `fp4_moe` takes the card's tuned ones)."""
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
    loop = loop or LoopForm()
    if loop.late_scale and any(t.data_ptr() % 4 for t in (w, w3, sources[0], sources[2])):
        raise ValueError("the late-scale loop reads the packed weights as 4-byte words: they must be 4-byte aligned")
    split = loop.split_k > 1
    if split and k % (loop.split_k * block_k):
        raise ValueError(f"split_k {loop.split_k} x block_k {block_k} must divide K={k}")
    part, counters = unsplit_args(a.device)
    if split:  # gate's and up's sums side by side in a route's row
        part = torch.empty((loop.split_k, num_routes, 2 * n if gate_up else n), dtype=torch.float32, device=a.device)
        counters = split_counters(len(expert_ids) * triton.cdiv(n, block_n), a.device)
    grid = (len(expert_ids), triton.cdiv(n, block_n), loop.split_k)
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
        part,
        counters,
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
        part.stride(0),
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
        EVEN_ODD=loop.even_odd,
        PREFETCH=loop.prefetch,
        SPLIT_K=loop.split_k,
        LATE_SCALE=loop.late_scale,
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
