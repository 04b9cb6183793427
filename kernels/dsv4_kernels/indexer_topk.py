"""Lightning-indexer scoring over the paged key pool in Triton, then the top-k choice (dsv4-model.md
§2.5). Reference: `indexer_topk_ref.indexer_topk_ref` (same arguments, same output).

Contract:
  q            [N, Hi, Di]   bf16 (fp32 allowed under the interpreter), the step's packed rows
  weights      [N, Hi]       fp32 head weights, already scaled by Di^-1/2 * Hi^-1/2
  idx_k        [P, E, Di]    indexer keys, E = window_size // ratio entries per page, same dtype as q
  block_table  [B, max_pages] int32 (-1 = unused); entry e of request b is idx_k[bt[b, e // E], e % E]
  cu_seqlens   [B + 1] int32, start_pos [B] int32 (absolute position of each request's first row)
  -> topk_idx  [N, topk] int32: the `topk` best entries among e < (position + 1) // ratio, equal
               scores to the earlier entry; best first (ties: earlier first), then -1 padding.

Split of the work:
- `indexer_score_kernel` computes score[t, e] = sum_h w[t, h] * relu(q[t, h] . k[e]) in fp32 (the
  bandwidth-heavy part). One program owns one key block of BLOCK_E entries (gathered once through
  the block table) and up to BLOCK_T consecutive rows of one request; it loops over those rows, each a
  [Hi, Di] x [Di, BLOCK_E] tensor-core product, so a key is read once per BLOCK_T rows (decode:
  BLOCK_T = 1, one program per (request, key block) reading the keys once for all heads). It writes
  every column of its rows: -inf where an entry is not visible, so the score matrix needs no fill.
- The choice is one more launch (`select_topk`, the kernel in indexer_topk_select.py): a radix select of
  each row's k-th best score, then the chosen entries sorted by one distinct int64 key each (score bits
  high, S - 1 - e low), which is exactly the stable-sort choice; given the step's layout a row scans only
  its visible columns. (It was ~15 torch launches: the keys, torch.topk, the -1 padding.)

Under the interpreter bf16 tiles are upcast to fp32 after loading (UPCAST; bf16 `tl.dot` is wrong
there). fp32 operands on a GPU use `input_precision="ieee"` (no silent TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_kernels.indexer_topk_ref import visible_counts
from dsv4_kernels.indexer_topk_select import topk_select
from dsv4_kernels.outputs import output_buffer


def interpreting() -> bool:
    """True when @triton.jit builds interpreter functions (TRITON_INTERPRET=1 at import time)."""
    return not isinstance(indexer_score_kernel, triton.runtime.JITFunction)


@triton.jit
def indexer_score_kernel(
    q_ptr,
    w_ptr,
    k_ptr,
    bt_ptr,
    cu_ptr,
    start_ptr,
    out_ptr,
    num_heads,
    num_cols,
    stride_qn,
    stride_qh,
    stride_wn,
    stride_kp,
    stride_ke,
    stride_btb,
    stride_on,
    RATIO: tl.constexpr,
    PER_PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Scores of rows [tile * BLOCK_T, +BLOCK_T) of request b against entries of key block pid_e."""
    pid_e = tl.program_id(0)
    tile = tl.program_id(1)
    b = tl.program_id(2)
    row0 = tl.load(cu_ptr + b)
    n_rows = tl.load(cu_ptr + b + 1) - row0 - tile * BLOCK_T
    if n_rows <= 0:
        return
    n_rows = tl.minimum(n_rows, BLOCK_T)
    row0 += tile * BLOCK_T
    pos0 = tl.load(start_ptr + b) + tile * BLOCK_T  # position of the tile's first row
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    head_ok = offs_h < num_heads
    # keys visible to the tile's last row; the rest of the block is never read
    key_ok = offs_e < (pos0 + n_rows) // RATIO
    pages = tl.load(bt_ptr + b * stride_btb + offs_e // PER_PAGE, mask=key_ok, other=0)
    k_ptrs = k_ptr + pages.to(tl.int64)[:, None] * stride_kp + (offs_e % PER_PAGE)[:, None] * stride_ke
    keys = tl.load(k_ptrs + offs_d[None, :], mask=key_ok[:, None], other=0.0)  # [BLOCK_E, Di]
    if UPCAST:
        keys = keys.to(tl.float32)
    keys_t = tl.trans(keys)
    for i in range(0, n_rows):
        row = (row0 + i).to(tl.int64)
        n_visible = (pos0 + i + 1) // RATIO
        score = tl.full((BLOCK_E,), float("-inf"), tl.float32)
        if pid_e * BLOCK_E < n_visible:
            q = tl.load(
                q_ptr + row * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None],
                other=0.0,
            )  # [BLOCK_H, Di]
            if UPCAST:
                q = q.to(tl.float32)
            w = tl.load(w_ptr + row * stride_wn + offs_h, mask=head_ok, other=0.0)
            dots = tl.dot(q, keys_t, input_precision="ieee")  # [BLOCK_H, BLOCK_E] fp32
            summed = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
            score = tl.where(offs_e < n_visible, summed, score)
        tl.store(out_ptr + row * stride_on + offs_e, score, mask=offs_e < num_cols)


def pick_blocks(max_rows_per_request: int, num_requests: int, num_cols: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_E). Decode rows (one per request) take BLOCK_T = 1; longer requests share each
    key tile among 16 rows. Key blocks are 128 entries, 64 when that leaves under ~2 programs per SM."""
    block_t = 1 if max_rows_per_request == 1 else 16
    programs = num_requests * triton.cdiv(max_rows_per_request, block_t) * triton.cdiv(num_cols, 128)
    return block_t, (64 if programs < 264 else 128)


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    idx_k: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    start_pos: torch.Tensor,
    ratio: int,
    num_cols: int,
    max_rows_per_request: int,
    blocks: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel alone: scores [N, num_cols] fp32, -inf where not visible. `num_cols` must cover
    every row's visible count; `out` ([N, num_cols] fp32, unit column stride) receives the stores."""
    n_rows, num_heads, head_dim = q.shape
    if idx_k.dtype != q.dtype or idx_k.shape[2] != head_dim or tuple(weights.shape) != (n_rows, num_heads):
        raise ValueError(
            f"q {q.dtype} {tuple(q.shape)}, weights {tuple(weights.shape)} and idx_k "
            f"{idx_k.dtype} {tuple(idx_k.shape)} do not fit"
        )
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"index head dim must be a power of two >= 16, got {head_dim}")
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"q and idx_k must be bf16 or fp32, got {q.dtype}")
    q, idx_k = q.contiguous(), idx_k.contiguous()
    weights = weights.float()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()  # rows may be strided (stride_wn)
    block_table = block_table.to(torch.int32).contiguous()
    out = output_buffer(out, (n_rows, num_cols), torch.float32, q.device)
    num_requests = cu_seqlens.shape[0] - 1
    if n_rows == 0 or num_requests == 0:
        return out
    block_t, block_e = blocks or pick_blocks(max_rows_per_request, num_requests, num_cols)
    grid = (triton.cdiv(num_cols, block_e), triton.cdiv(max_rows_per_request, block_t), num_requests)
    indexer_score_kernel[grid](
        q,
        weights,
        idx_k,
        block_table,
        cu_seqlens.to(torch.int32),
        start_pos.to(torch.int32),
        out,
        num_heads,
        num_cols,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        idx_k.stride(0),
        idx_k.stride(1),
        block_table.stride(0),
        out.stride(0),
        RATIO=ratio,
        PER_PAGE=idx_k.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads)),
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        UPCAST=interpreting(),
    )
    return out


def select_topk(
    scores: torch.Tensor, topk: int, layout: tuple[torch.Tensor, torch.Tensor, int] | None = None
) -> torch.Tensor:
    """scores [N, S] fp32 (-inf = not visible) -> [N, topk] int32, best first, ties to the earlier
    entry, -1 padding; one launch (indexer_topk_select). `layout` = (cu_seqlens, start_pos, ratio) lets each
    row scan only its visible columns (all scores past them must be -inf, as indexer_scores writes them)."""
    return topk_select(scores, topk, layout)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    idx_k: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    start_pos: torch.Tensor,
    ratio: int,
    topk: int,
    max_rows_per_request: int | None = None,
    num_cols: int | None = None,
) -> torch.Tensor:
    """See the module contract. `max_rows_per_request` (the longest request's row count) and
    `num_cols` (the most entries any row sees) size the grid; the step plan knows both, and leaving
    them out costs one device-to-host sync to compute them."""
    if max_rows_per_request is None or num_cols is None:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        max_rows_per_request = int(lengths.max()) if lengths.numel() else 0
        num_cols = int(visible_counts(cu_seqlens, start_pos, ratio).max()) if q.shape[0] else 0
    scores = indexer_scores(
        q, weights, idx_k, block_table, cu_seqlens, start_pos, ratio, max(num_cols, 1), max_rows_per_request
    )
    return select_topk(scores, topk, (cu_seqlens, start_pos, ratio))


COMPILE_SIGNATURE = {
    "q_ptr": "*bf16",
    "w_ptr": "*fp32",
    "k_ptr": "*bf16",
    "bt_ptr": "*i32",
    "cu_ptr": "*i32",
    "start_ptr": "*i32",
    "out_ptr": "*fp32",
    "num_heads": "i32",
    "num_cols": "i32",
    "stride_qn": "i32",
    "stride_qh": "i32",
    "stride_wn": "i32",
    "stride_kp": "i32",
    "stride_ke": "i32",
    "stride_btb": "i32",
    "stride_on": "i32",
    "RATIO": "constexpr",
    "PER_PAGE": "constexpr",
    "HEAD_DIM": "constexpr",
    "BLOCK_H": "constexpr",
    "BLOCK_T": "constexpr",
    "BLOCK_E": "constexpr",
    "UPCAST": "constexpr",
}
# multiples of 16 at DeepSeek-V4-Flash's dims (registry.py): 64 heads of 128, 32 keys a page; not the
# block table's width or the number of score columns
ALIGNED_INTS = ("num_heads", "stride_qn", "stride_qh", "stride_wn", "stride_kp", "stride_ke")
_REAL = {"RATIO": 4, "PER_PAGE": 32, "HEAD_DIM": 128, "BLOCK_H": 64, "UPCAST": False}  # DeepSeek-V4-Flash

# (config name, signature, constexprs) for the CPU compile checks (tests/kernels/test_compile.py)
COMPILE_CONFIGS = (
    ("decode", COMPILE_SIGNATURE, {**_REAL, "BLOCK_T": 1, "BLOCK_E": 128}),
    ("decode_small", COMPILE_SIGNATURE, {**_REAL, "BLOCK_T": 1, "BLOCK_E": 64}),
    ("prefill", COMPILE_SIGNATURE, {**_REAL, "BLOCK_T": 16, "BLOCK_E": 128}),
)
