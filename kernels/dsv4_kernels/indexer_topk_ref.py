"""Torch reference of the lightning indexer's scoring and top-k over the paged key pool
(dsv4-model.md §2.5; the kernel is `indexer_topk.indexer_topk`).

Layout: entry e of request b is idx_k[block_table[b, e // E], e % E], E = entries per page. Row t
of a step (a token at absolute position p) sees entries e < (p + 1) // ratio, and scores them
score[t, e] = sum_h weights[t, h] * relu(q[t, h] . k[e]).

The reference sums in fp64 and rounds once to fp32, so it is the exact score up to that rounding;
the kernel (fp32 accumulation) differs from it only by fp32 summation order. The choice keeps the
`topk` best visible entries, equal scores going to the earlier entry (a stable descending sort, as
`dsv4serve.model.indexer.Indexer.select`), so it never depends on the invisible entries. A row lists
its choice best first (ties: earlier entry first), then -1 padding.
"""

from __future__ import annotations

import torch


def visible_counts(cu_seqlens: torch.Tensor, start_pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """[N] int64: how many entries each packed row sees, (position + 1) // ratio."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    row_start = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    row_pos = (
        torch.repeat_interleave(start_pos.long(), lengths)
        + torch.arange(int(lengths.sum()), device=cu_seqlens.device)
        - row_start
    )
    return (row_pos + 1) // ratio


def gather_keys(idx_k: torch.Tensor, block_table: torch.Tensor, b: int, num_entries: int) -> torch.Tensor:
    """Request b's first `num_entries` keys [num_entries, Di], read through its block table."""
    per_page = idx_k.shape[1]
    entries = torch.arange(num_entries, device=idx_k.device)
    pages = block_table[b].long()[entries // per_page]
    return idx_k[pages, entries % per_page]


def indexer_scores_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    idx_k: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    start_pos: torch.Tensor,
    ratio: int,
    num_cols: int,
) -> torch.Tensor:
    """q [N, Hi, Di], weights [N, Hi] -> scores [N, num_cols] fp32, -inf where e is not visible."""
    n_rows = q.shape[0]
    visible = visible_counts(cu_seqlens, start_pos, ratio)
    scores = torch.full((n_rows, num_cols), float("-inf"), dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    for b in range(len(bounds) - 1):
        if bounds[b] == bounds[b + 1]:
            continue
        rows = slice(bounds[b], bounds[b + 1])
        n_vis = int(visible[rows].max())
        keys = gather_keys(idx_k, block_table, b, n_vis).double()  # [S_b, Di]
        dots = torch.einsum("thd,sd->ths", q[rows].double(), keys).relu()  # [T_b, Hi, S_b]
        exact = torch.einsum("ths,th->ts", dots, weights[rows].double())
        exact = exact.masked_fill(torch.arange(n_vis, device=q.device) >= visible[rows, None], float("-inf"))
        scores[rows, :n_vis] = exact.float()
    return scores


def topk_from_scores_ref(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [N, S] (-inf = not visible) -> [N, topk] int32: best first, ties to the earlier entry."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :topk]
    chosen = torch.where(scores.gather(1, order) > float("-inf"), order, -1).to(torch.int32)
    pad = topk - chosen.shape[1]
    return torch.nn.functional.pad(chosen, (0, pad), value=-1) if pad > 0 else chosen


def indexer_topk_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    idx_k: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    start_pos: torch.Tensor,
    ratio: int,
    topk: int,
) -> torch.Tensor:
    """The whole selection: [N, topk] int32 entry indices per packed row (see the module doc)."""
    num_cols = max(int(visible_counts(cu_seqlens, start_pos, ratio).max()), 1) if q.shape[0] else 1
    scores = indexer_scores_ref(q, weights, idx_k, block_table, cu_seqlens, start_pos, ratio, num_cols)
    return topk_from_scores_ref(scores, topk)
