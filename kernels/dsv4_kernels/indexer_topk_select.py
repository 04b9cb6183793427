"""The indexer's choice in one Triton launch: the top k of each row's scores, equal scores to the earlier
entry (dsv4-model.md §2.5, tie rule). Reference: `indexer_topk_ref.topk_from_scores_ref` (a stable
descending sort). Called by `indexer_topk.select_topk`.

Contract:
  scores  [N, S] fp32, -inf = not visible (never chosen); -0.0 and +0.0 are one score
  -> out  [N, k] int32: the k best visible entries, best first (equal scores: earlier entry first), then -1

The order: each score maps to a 32-bit key u whose unsigned order is the float order (+0 for -0.0; the
sign bit set flips the other bits), and entry e ranks by (u descending, e ascending), a strict order.
One program per row:
1. radix select of the k-th largest u, 8 bits a round (four rounds, each a pass over the row with a
   256-bin histogram of the next digit among the entries that match the digits chosen so far): the
   threshold T and how many entries with u = T the choice still needs (`need`);
2. one pass that keeps every entry with u > T and the first `need` entries with u = T (a running count in
   column order: earlier entries first), compacted in column order into the row's output (a cumsum);
3. those at most k entries reloaded and sorted by (u, reversed e) as one int64 key, descending, and
   stored with -1 after them. A barrier separates the compaction's stores from the reload, and the
   reload from the final stores (other threads of the program hold the other columns).
Rows with at most k visible entries skip the rounds (every one is chosen). With the step's layout
(`cu_seqlens`, `start_pos`, ratio) a row scans only its visible columns, (position + 1) // ratio,
instead of all S: the score kernel writes -inf past them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_kernels.outputs import output_buffer

INT64_MIN = tl.constexpr(-(2**63))


def interpreting() -> bool:
    """True when @triton.jit builds interpreter functions (TRITON_INTERPRET=1 at import time)."""
    return not isinstance(topk_select_kernel, triton.runtime.JITFunction)


@triton.jit
def _ordered(score):
    """fp32 -> int64 in [0, 2^32) whose order is the scores' order (-0.0 as +0.0)."""
    bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)
    signed = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return signed.to(tl.int64) + 2**31


@triton.jit
def _visible_columns(row, cu_ptr, start_ptr, num_requests, ratio):
    """How many entries packed row `row` sees: its request b (the number of requests that end at or before
    it), its position start_pos[b] + row - cu[b], then (position + 1) // ratio."""
    b = 0
    for b0 in range(0, num_requests, 128):
        offs = b0 + tl.arange(0, 128)
        ends = tl.load(cu_ptr + 1 + offs, mask=offs < num_requests, other=2**31 - 1)
        b += tl.sum((ends <= row).to(tl.int32))
    position = tl.load(start_ptr + b) + row - tl.load(cu_ptr + b)
    return (position + 1) // ratio


@triton.jit
def _threshold(row_ptr, n_scan, K: tl.constexpr, BLOCK: tl.constexpr):
    """(T, need): the k-th largest key of the row's visible entries, and how many entries with key T the
    choice takes; (-1, 0) when the row has at most k (every one is chosen)."""
    cols = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    prefix = tl.zeros((), tl.int64)
    need = tl.full((), K, tl.int32)
    n_valid = tl.zeros((), tl.int32)
    for rnd in tl.static_range(4):
        shift = 24 - 8 * rnd  # rnd is a compile-time constant: so is shift
        hist = tl.zeros((256,), tl.int32)
        for c0 in range(0, n_scan, BLOCK):
            c = c0 + cols
            s = tl.load(row_ptr + c, mask=c < n_scan, other=float("-inf"))
            u = _ordered(s)
            match = (c < n_scan) & (s > float("-inf")) & ((u >> (shift + 8)) == prefix)
            hist += tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=match)
        if rnd == 0:
            n_valid = tl.sum(hist)
        at_least = tl.cumsum(hist, 0, reverse=True)  # entries whose digit is >= each bin's
        digit = tl.sum((at_least >= need).to(tl.int32)) - 1  # the largest digit still holding the k-th
        need -= tl.sum(tl.where(bins > digit, hist, 0))
        prefix = prefix * 256 + digit
    every = n_valid <= K
    return tl.where(every, -1, prefix), tl.where(every, 0, need)


@triton.jit
def topk_select_kernel(
    scores_ptr,
    out_ptr,
    cu_ptr,
    start_ptr,
    num_cols,
    num_requests,
    ratio,
    stride_sn,
    stride_on,
    K: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK: tl.constexpr,
    FROM_LAYOUT: tl.constexpr,
):
    """out[row, :K] for row = program_id(0)."""
    row = tl.program_id(0)
    s_row = scores_ptr + row.to(tl.int64) * stride_sn
    o_row = out_ptr + row.to(tl.int64) * stride_on
    n_scan = num_cols
    if FROM_LAYOUT:
        n_scan = tl.minimum(_visible_columns(row, cu_ptr, start_ptr, num_requests, ratio), num_cols)
    threshold = tl.full((), -1, tl.int64)
    need = tl.zeros((), tl.int32)
    if n_scan > K:
        threshold, need = _threshold(s_row, n_scan, K, BLOCK)
    # the choice, compacted in column order into the output row
    cols = tl.arange(0, BLOCK)
    taken = tl.zeros((), tl.int32)
    ties = tl.zeros((), tl.int32)
    for c0 in range(0, n_scan, BLOCK):
        c = c0 + cols
        s = tl.load(s_row + c, mask=c < n_scan, other=float("-inf"))
        u = _ordered(s)
        valid = (c < n_scan) & (s > float("-inf"))
        tie = valid & (u == threshold)
        tie_rank = ties + tl.cumsum(tie.to(tl.int32), 0) - 1
        take = (valid & (u > threshold)) | (tie & (tie_rank < need))
        slot = taken + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(o_row + slot, c, mask=take)
        taken += tl.sum(take.to(tl.int32))
        ties += tl.sum(tie.to(tl.int32))
    tl.debug_barrier()
    # best first: sort the chosen by (key, reversed entry), one distinct int64 each
    offs = tl.arange(0, K_POW2)
    have = offs < taken
    entry = tl.load(o_row + offs, mask=have, other=0)
    u = _ordered(tl.load(s_row + entry, mask=have, other=0.0))
    key = ((u - 2**31) << 32) | (num_cols - 1 - entry).to(tl.int64)
    key = tl.sort(tl.where(have, key, INT64_MIN), descending=True)
    entry = (num_cols - 1 - (key & 0xFFFFFFFF)).to(tl.int32)
    tl.debug_barrier()
    tl.store(o_row + offs, tl.where(have, entry, -1), mask=offs < K)


def pick_block(num_cols: int) -> int:
    """Columns a pass handles at once: 1024 (8 a thread at 4 warps), fewer for short rows."""
    return min(1024, max(16, triton.next_power_of_2(num_cols)))


def topk_select(
    scores: torch.Tensor,
    topk: int,
    layout: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See the module contract. `layout` = (cu_seqlens [B + 1], start_pos [B] int32, ratio) bounds each row's
    scan by its visible count; `out` ([N, topk] int32, unit column stride) receives the stores."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"need fp32 scores [N, S] with unit column stride, got {scores.dtype} {tuple(scores.shape)}")
    if topk < 1:
        raise ValueError(f"topk must be positive, got {topk}")
    n_rows, num_cols = scores.shape
    out = output_buffer(out, (n_rows, topk), torch.int32, scores.device)
    if n_rows == 0:
        return out
    cu, start, ratio = layout if layout is not None else (scores, scores, 1)  # pointers never read without it
    if layout is not None:
        cu, start = cu.to(torch.int32), start.to(torch.int32)
    topk_select_kernel[(n_rows,)](
        scores,
        out,
        cu,
        start,
        num_cols,
        cu.shape[0] - 1 if layout is not None else 0,
        ratio,
        scores.stride(0),
        out.stride(0),
        K=topk,
        K_POW2=max(2, triton.next_power_of_2(topk)),
        BLOCK=pick_block(num_cols),
        FROM_LAYOUT=layout is not None,
    )
    return out


COMPILE_SIGNATURE = {
    "scores_ptr": "*fp32",
    "out_ptr": "*i32",
    "cu_ptr": "*i32",
    "start_ptr": "*i32",
    **{name: "i32" for name in ("num_cols", "num_requests", "ratio", "stride_sn", "stride_on")},
    **{name: "constexpr" for name in ("K", "K_POW2", "BLOCK", "FROM_LAYOUT")},
}

# (config name, signature, constexprs) for the CPU compile checks (tests/kernels/test_compile.py):
# DeepSeek-V4-Flash's index_topk = 512 over long rows, with the step's layout (the model's call) and without
COMPILE_CONFIGS = (
    ("layout", COMPILE_SIGNATURE, {"K": 512, "K_POW2": 512, "BLOCK": 1024, "FROM_LAYOUT": True}),
    ("plain", COMPILE_SIGNATURE, {"K": 512, "K_POW2": 512, "BLOCK": 1024, "FROM_LAYOUT": False}),
)
