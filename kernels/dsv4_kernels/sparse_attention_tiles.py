"""@triton.jit helpers of the paged sparse attention kernel (sparse_attention.py), one step each of a
program's work on its token's key list; the kernel inlines them.

- `_key_rows`: a block of virtual key slots -> the rows to load (window positions from this step's `new_kv` or
  the ring, then compressed entries through the block table: CSA's top-k columns or HCA's visible entries)
  and which slots are valid.
- `_online_softmax_step`: one key block into the running (acc, max, sum), base 2.
- `_combine_splits`: PHASE 2, the merge of the split-K partials into the normalized output.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _key_rows(
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
    WINDOW: tl.constexpr,
    ENTRIES_PER_PAGE: tl.constexpr,
    COMP_MODE: tl.constexpr,
):
    """Virtual key slots [BLOCK_N] of query row n (position t) -> (row pointers, valid) [BLOCK_N]."""
    is_win = slot < n_win
    pos = t - n_win + 1 + slot  # >= 0 on window slots (n_win <= t + 1); unused elsewhere
    from_new = is_win & (pos >= sp)  # this step's own keys, causal: pos <= t
    new_ptrs = new_kv_ptr + (n - t + pos).to(tl.int64) * stride_new
    ring_ptrs = swa_kv_ptr + seq.to(tl.int64) * stride_swa_slot + (pos % WINDOW) * stride_swa_pos
    ptrs = tl.where(from_new, new_ptrs, ring_ptrs)
    valid = is_win
    if COMP_MODE != 0:
        j = slot - n_win
        is_comp = (slot >= n_win) & (j < n_comp)
        if COMP_MODE == 1:  # CSA: the indexer's choice, -1 = unused
            entry = tl.load(topk_ptr + n.to(tl.int64) * stride_topk + j, mask=is_comp, other=-1)
            is_comp = is_comp & (entry >= 0) & (entry < n_visible)
        else:  # HCA: every visible entry (n_comp = n_visible)
            entry = j
        page = tl.load(block_table_ptr + b.to(tl.int64) * stride_bt + entry // ENTRIES_PER_PAGE, mask=is_comp, other=-1)
        is_comp = is_comp & (page >= 0)
        comp_ptrs = comp_kv_ptr + page.to(tl.int64) * stride_comp_page + (entry % ENTRIES_PER_PAGE) * stride_comp_entry
        ptrs = tl.where(is_comp, comp_ptrs, ptrs)
        valid = valid | is_comp
    return ptrs, valid


@triton.jit
def _online_softmax_step(q, k, valid, acc, m_i, l_i, scale_log2):
    """One key block: q [BLOCK_H, D], k = v [BLOCK_N, D], valid [BLOCK_N]; running acc [BLOCK_H, D],
    max m_i and sum l_i [BLOCK_H] in log2 units -> the updated (acc, m_i, l_i)."""
    s = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_H, BLOCK_N]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: m_i starts finite
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)  # bf16 probabilities on a GPU
    return acc, m_new, l_i


@triton.jit
def _combine_splits(
    n,
    offs_h,
    mask_h,
    out_rows,
    part_acc_ptr,
    part_ml_ptr,
    num_heads,
    num_rows,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D_CHUNK: tl.constexpr,
):
    """PHASE 2: merge the splits' (acc, m, l) of row n: o = sum_s 2^(m_s-M) acc_s / sum_s 2^(m_s-M) l_s,
    with M = max_s m_s. out_rows [BLOCK_H]: the output row pointers. The sum runs D_CHUNK channels at a
    time, so the merge holds a [BLOCK_H, D_CHUNK] accumulator, not a whole [BLOCK_H, HEAD_DIM] one."""
    m_max = tl.full([BLOCK_H], -1.0e30, tl.float32)
    for s in range(0, num_splits):
        base = ((s * num_rows + n) * num_heads).to(tl.int64) + offs_h
        m_max = tl.maximum(m_max, tl.load(part_ml_ptr + base * 2, mask=mask_h, other=-1.0e30))
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    for s in range(0, num_splits):
        base = ((s * num_rows + n) * num_heads).to(tl.int64) + offs_h
        m_s = tl.load(part_ml_ptr + base * 2, mask=mask_h, other=-1.0e30)
        l_sum += tl.load(part_ml_ptr + base * 2 + 1, mask=mask_h, other=0.0) * tl.exp2(m_s - m_max)
    l_sum = tl.where(mask_h, l_sum, 1.0)
    for d0 in tl.static_range(0, HEAD_DIM, D_CHUNK):
        offs_d = d0 + tl.arange(0, D_CHUNK)
        acc = tl.zeros([BLOCK_H, D_CHUNK], tl.float32)
        for s in range(0, num_splits):
            base = ((s * num_rows + n) * num_heads).to(tl.int64) + offs_h
            beta = tl.exp2(tl.load(part_ml_ptr + base * 2, mask=mask_h, other=-1.0e30) - m_max)
            acc_s = tl.load(part_acc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_h[:, None], other=0.0)
            acc += acc_s * beta[:, None]
        out_ptrs = out_rows[:, None] + offs_d[None, :]
        tl.store(out_ptrs, (acc / l_sum[:, None]).to(out_ptrs.dtype.element_ty), mask=mask_h[:, None])
