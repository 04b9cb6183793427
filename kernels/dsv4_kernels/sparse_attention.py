"""Paged sparse attention with an attention sink (dsv4-model.md §2.3, §2.6) in Triton: one kernel
for decode and chunked prefill (reference and layout: `sparse_attention_ref`).

One program = one query token x BLOCK_H heads (x one key split). K = V is a single head shared by
all heads, so the heads of a token are the rows of one tensor-core tile: at BLOCK_H = 64 every key
byte a token needs is read once per program, whatever the number of heads, and [64, D] @ [D, BLOCK_N]
fills a Hopper wgmma. Tokens are not tiled together: a CSA token's 512 compressed keys are its own.

The program walks its token's virtual key list in BLOCK_N blocks: slots [0, n_win) are the window
positions max(0, t-W+1) .. t (from `new_kv` when >= start_pos, else the ring), the following slots
the compressed entries (CSA: topk_idx columns; HCA: entries 0 .. (t+1)//ratio - 1), each gathered
through the block table. An invalid slot (-1 index or page, entry not visible) is masked.
The softmax is online in base 2; the sink starts the running max and sum (m = sink, l = 1), so it
joins only the denominator and no row is ever all -inf.

Split-K (decode with few tokens): the grid's third axis cuts each token's key blocks into
`num_splits` contiguous ranges; PHASE 1 writes each split's unnormalized (acc, m, l) to fp32
workspaces (only split 0 carries the sink) and a second launch of the same kernel with PHASE 2
merges them. PHASE 0 writes the normalized output directly (one split; the prefill form).

Dtypes: on a GPU q / new_kv / swa_kv / comp_kv are bf16, the dots take bf16 operands with fp32
accumulation (the probabilities are rounded to bf16 for the P @ V dot) and the output is bf16.
Under the interpreter (DOT_FP32) tiles are upcast to fp32 after loading and the output is fp32.

The program's steps (key gather, online softmax, split merge) are in sparse_attention_tiles.py; the launch
shapes, the split count and the compile-check configurations in sparse_attention_launch.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_kernels.outputs import output_buffer
from dsv4_kernels.sparse_attention_launch import (
    ALIGNED_INTS,
    COMPILE_CONFIGS,
    LAUNCH_ARCHS,
    LAUNCH_OPTIONS,
    launch_shape,
    pick_num_splits,
)
from dsv4_kernels.sparse_attention_tiles import _combine_splits, _key_rows, _online_softmax_step

# the compile configs are re-exported: registry.py reads them, and the kernel, from this module
__all__ = [
    "ALIGNED_INTS",
    "COMPILE_CONFIGS",
    "LAUNCH_ARCHS",
    "LAUNCH_OPTIONS",
    "interpreting",
    "paged_sparse_attention",
    "paged_sparse_attention_kernel",
    "store_dtype",
]

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """True when @triton.jit builds interpreter functions (TRITON_INTERPRET=1 at import time)."""
    return not isinstance(paged_sparse_attention_kernel, triton.runtime.JITFunction)


@triton.jit
def paged_sparse_attention_kernel(
    q_ptr,
    new_kv_ptr,
    swa_kv_ptr,
    comp_kv_ptr,
    block_table_ptr,
    topk_ptr,
    cu_seqlens_ptr,
    start_pos_ptr,
    seq_slot_ptr,
    row_req_ptr,
    sink_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    scale_log2,
    num_heads,
    num_rows,
    ratio,
    num_topk,
    num_splits,
    stride_qn,
    stride_qh,
    stride_new,
    stride_swa_slot,
    stride_swa_pos,
    stride_comp_page,
    stride_comp_entry,
    stride_bt,
    stride_topk,
    stride_on,
    stride_oh,
    WINDOW: tl.constexpr,
    ENTRIES_PER_PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    COMP_MODE: tl.constexpr,
    PHASE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Grid (query rows, head groups, splits). COMP_MODE: 0 window only, 1 CSA (topk_idx), 2 HCA (all
    visible). PHASE: 0 one split, normalized output; 1 this split's partials; 2 merge the partials."""
    n = tl.program_id(0)
    split = tl.program_id(2)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_d = tl.arange(0, HEAD_DIM)
    out_rows = out_ptr + n.to(tl.int64) * stride_on + offs_h * stride_oh
    if PHASE == 2:
        _combine_splits(
            n,
            offs_h,
            mask_h,
            out_rows,
            part_acc_ptr,
            part_ml_ptr,
            num_heads,
            num_rows,
            num_splits,
            HEAD_DIM,
            BLOCK_H,
            min(HEAD_DIM, 128),
        )
    else:
        b = tl.load(row_req_ptr + n)
        sp = tl.load(start_pos_ptr + b)
        t = sp + n - tl.load(cu_seqlens_ptr + b)  # the row's absolute position
        seq = tl.load(seq_slot_ptr + b)
        n_win = tl.minimum(t + 1, WINDOW)
        n_visible = (t + 1) // ratio
        if COMP_MODE == 1:
            n_comp = num_topk
        elif COMP_MODE == 2:
            n_comp = n_visible
        else:
            n_comp = 0
        num_blocks = tl.cdiv(n_win + n_comp, BLOCK_N)
        per_split = tl.cdiv(num_blocks, num_splits)
        blk_lo = split * per_split
        blk_hi = tl.minimum(num_blocks, blk_lo + per_split)

        q = tl.load(
            q_ptr + n.to(tl.int64) * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None],
            other=0.0,
        )  # [BLOCK_H, D]
        if DOT_FP32:
            q = q.to(tl.float32)
        sink = tl.load(sink_ptr + offs_h, mask=mask_h, other=0.0) * 1.4426950408889634  # LOG2E: log2 units
        m_i = tl.where(split == 0, sink, -1.0e30)  # only split 0 carries the sink
        l_i = tl.where(split == 0, 1.0, 0.0) + tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        for blk in range(blk_lo, blk_hi):
            slot = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            ptrs, valid = _key_rows(
                slot,
                n,
                b,
                t,
                sp,
                seq,
                n_win,
                n_comp,
                n_visible,
                new_kv_ptr,
                swa_kv_ptr,
                comp_kv_ptr,
                block_table_ptr,
                topk_ptr,
                stride_new,
                stride_swa_slot,
                stride_swa_pos,
                stride_comp_page,
                stride_comp_entry,
                stride_bt,
                stride_topk,
                WINDOW,
                ENTRIES_PER_PAGE,
                COMP_MODE,
            )
            k = tl.load(ptrs[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, D] = V
            if DOT_FP32:
                k = k.to(tl.float32)
            acc, m_i, l_i = _online_softmax_step(q, k, valid, acc, m_i, l_i, scale_log2)
        if PHASE == 0:
            tl.store(
                out_rows[:, None] + offs_d[None, :],
                (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
                mask=mask_h[:, None],
            )
        else:
            base = ((split * num_rows + n) * num_heads).to(tl.int64) + offs_h
            tl.store(part_acc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask_h[:, None])
            tl.store(part_ml_ptr + base * 2, m_i, mask=mask_h)
            tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=mask_h)


def store_dtype() -> torch.dtype:
    """What the kernel stores: bf16 on a GPU, fp32 under the interpreter (see the module doc)."""
    return torch.float32 if interpreting() else torch.bfloat16


def _check_inputs(
    q: torch.Tensor,
    new_kv: torch.Tensor,
    swa_kv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    start_pos: torch.Tensor,
    seq_slot: torch.Tensor,
    comp_kv: torch.Tensor | None,
    block_table: torch.Tensor | None,
    topk_idx: torch.Tensor | None,
    ratio: int,
) -> None:
    """Shapes and dtypes the kernel assumes; raises ValueError naming the mismatch."""
    num_rows, _, head_dim = q.shape
    if head_dim & (head_dim - 1) or tuple(new_kv.shape) != (num_rows, head_dim) or swa_kv.shape[2] != head_dim:
        raise ValueError(
            f"need q [N, H, D] (D a power of two), new_kv [N, D], swa_kv [slots, W, D]; got "
            f"{tuple(q.shape)}, {tuple(new_kv.shape)}, {tuple(swa_kv.shape)}"
        )
    kv_dtypes = {new_kv.dtype, swa_kv.dtype} | ({comp_kv.dtype} if comp_kv is not None else set())
    if kv_dtypes != {q.dtype}:
        raise ValueError(f"q and every key tensor must share one dtype, got {q.dtype} and {kv_dtypes}")
    indices = (cu_seqlens, start_pos, seq_slot, block_table, topk_idx)
    if any(x is not None and x.dtype != torch.int32 for x in indices):
        raise ValueError("cu_seqlens, start_pos, seq_slot, block_table and topk_idx must be int32")
    if (comp_kv is None) != (ratio == 0) or (comp_kv is None and (block_table is not None or topk_idx is not None)):
        raise ValueError("comp_kv, block_table and a ratio > 0 come together (SWA-only layers pass none)")
    if comp_kv is not None and (block_table is None or comp_kv.shape[2] != head_dim):
        raise ValueError(f"comp_kv [pages, E, {head_dim}] needs a block_table, got {tuple(comp_kv.shape)}")
    if topk_idx is not None and topk_idx.shape[0] != num_rows:
        raise ValueError(f"topk_idx must be [N={num_rows}, K], got {tuple(topk_idx.shape)}")


def _workspaces(num_splits: int, q: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partials: acc [S, N, H, D] and (m, l) [S, N, H, 2] fp32 (one split: unused fp32 dummies)."""
    if num_splits == 1:
        return sink, sink
    return (
        torch.empty(num_splits, *q.shape, dtype=torch.float32, device=q.device),
        torch.empty(num_splits, *q.shape[:2], 2, dtype=torch.float32, device=q.device),
    )


def paged_sparse_attention(
    q: torch.Tensor,
    new_kv: torch.Tensor,
    swa_kv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    start_pos: torch.Tensor,
    seq_slot: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    comp_kv: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    topk_idx: torch.Tensor | None = None,
    ratio: int = 0,
    *,
    num_splits: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    token_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The layout and semantics of `paged_sparse_attention_ref` (same arguments). Returns o [N, H, D] in
    `store_dtype()`. `out` ([N, H, D], unit last stride, `store_dtype()`) receives the stores (tests pass a
    NaN-poisoned view). num_splits None picks a split-K for the GPU's SM count (1 on CPU); pass it
    explicitly to keep a step's launch shape fixed (e.g. under CUDA graphs). `token_rows` ([N] int32, each
    token's row in cu_seqlens) is what the wrapper would derive, given by a caller that keeps it for the step
    (the model's layers share one: `BatchLayout.token_rows`)."""
    _check_inputs(q, new_kv, swa_kv, cu_seqlens, start_pos, seq_slot, comp_kv, block_table, topk_idx, ratio)
    num_rows, num_heads, head_dim = q.shape
    q, new_kv, swa_kv, sink = q.contiguous(), new_kv.contiguous(), swa_kv.contiguous(), sink.float().contiguous()
    if token_rows is None:
        counts = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        row_req = torch.repeat_interleave(
            torch.arange(counts.numel(), device=q.device, dtype=torch.int32), counts, output_size=num_rows
        )
    elif token_rows.shape != (num_rows,) or token_rows.dtype != torch.int32:
        raise ValueError(f"token_rows must be [{num_rows}] int32, got {tuple(token_rows.shape)} {token_rows.dtype}")
    else:
        row_req = token_rows.contiguous()
    comp_mode = 0 if comp_kv is None else (1 if topk_idx is not None else 2)
    comp = new_kv.unsqueeze(1) if comp_kv is None else comp_kv.contiguous()  # a dummy when SWA-only
    table = cu_seqlens if block_table is None else block_table.contiguous()
    topk = cu_seqlens if topk_idx is None else topk_idx.contiguous()
    num_topk = 0 if topk_idx is None else topk_idx.shape[1]
    block_h = block_h or max(16, min(64, triton.next_power_of_2(num_heads)))
    if q.is_cuda:
        # CUDA builds of torch define this field (torch/csrc/cuda/Module.cpp); the bundled .pyi stub omits it
        smem = torch.cuda.get_device_properties(q.device).shared_memory_per_block_optin  # type: ignore[attr-defined]
        default_block_n, num_warps, num_stages = launch_shape(smem, block_h)
    else:
        default_block_n, num_warps, num_stages = 32, 4, 1
    block_n = block_n or default_block_n
    head_groups = triton.cdiv(num_heads, block_h)
    if num_splits is None:  # the most keys a token can have; HCA: what the block table holds (no host sync)
        max_keys = swa_kv.shape[1] + num_topk + (table.shape[1] * comp.shape[1] if comp_mode == 2 else 0)
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        num_splits = pick_num_splits(num_rows * head_groups, triton.cdiv(max_keys, block_n), num_sms)
    out = output_buffer(out, tuple(q.shape), store_dtype(), q.device)
    if num_rows == 0:
        return out
    part_acc, part_ml = _workspaces(num_splits, q, sink)
    args = (
        q,
        new_kv,
        swa_kv,
        comp,
        table,
        topk,
        cu_seqlens,
        start_pos,
        seq_slot,
        row_req,
        sink,
        out,
        part_acc,
        part_ml,
        scale * LOG2E,
        num_heads,
        num_rows,
        max(ratio, 1),
        num_topk,
        num_splits,
        q.stride(0),
        q.stride(1),
        new_kv.stride(0),
        swa_kv.stride(0),
        swa_kv.stride(1),
        comp.stride(0),
        comp.stride(1),
        table.stride(0),
        topk.stride(0),
        out.stride(0),
        out.stride(1),
    )
    meta = dict(
        WINDOW=swa_kv.shape[1],
        ENTRIES_PER_PAGE=comp.shape[1],
        HEAD_DIM=head_dim,
        COMP_MODE=comp_mode,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        DOT_FP32=interpreting(),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    paged_sparse_attention_kernel[(num_rows, head_groups, num_splits)](*args, PHASE=min(num_splits - 1, 1), **meta)
    if num_splits > 1:
        paged_sparse_attention_kernel[(num_rows, head_groups, 1)](*args, PHASE=2, **meta)
    return out
