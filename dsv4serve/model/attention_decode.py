"""The decode step's torch paths, vectorized over the batch (every row one token; dsv4-model.md §2.3-2.6).

The per-row paths in attention.py gather each row's keys by itself: a Python loop whose kernel count grows
with the batch. Here a decode step's rows are handled together, with shapes that depend only on the row
count and the layout's static bounds (`BatchLayout.max_end`), never on positions or routings:
- the window ring is written with one scatter (every row's key at position p lands at p % W of its slot);
- the window keys are read back as the W positions p - W + 1 .. p of each row (masked below 0);
- compressed entries are gathered through the block table: a CSA row's chosen entries, an HCA row's first
  max_end // ratio entries (masked past the row's visible count);
- the indexer scores every row against max_end // ratio entries and keeps the top k, ties to the earlier
  entry (a stable sort), as `Indexer.select` does row by row.
Equal short rows (a verify step's) run these paths once per token, over `BatchLayout.substeps` (attention.py).
They are the same arithmetic as the per-row paths up to summation order (keys are masked, not cut), so they
are used only without --batch-invariant; tests/model/test_decode_paths.py compares the two.
"""

from __future__ import annotations

import torch

from dsv4serve.model.batch import BatchLayout
from dsv4serve.model.kv_pool import CompressedCache


def store_window(swa: torch.Tensor, kv: torch.Tensor, layout: BatchLayout) -> None:
    """swa [slots, W, d] ring, kv [B * T, d] the new keys of B rows of T tokens each (a decode step: T = 1;
    equal rows, `BatchLayout.tokens_per_row`, T <= W so that no two of a row's keys share a ring entry) ->
    written at (slot, position % W), in one scatter."""
    n_rows = layout.num_rows
    ring_pos = layout.ring_index(swa.shape[1]).view(n_rows, -1)  # [B, T]
    swa[layout.slots64[:, None], ring_pos] = kv.view(n_rows, ring_pos.shape[1], -1).to(swa.dtype)


def window_keys(swa: torch.Tensor, layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """The W keys of each row's window, positions p - W + 1 .. p (after `store_window`):
    ([B, W, d], valid [B, W] bool)."""
    window = swa.shape[1]
    k_pos = layout.positions64[:, None] - (window - 1) + torch.arange(window, device=swa.device)  # [B, W]
    keys = _rows(swa, layout.slots64[:, None], k_pos % window)
    return keys, k_pos >= 0


def _rows(table: torch.Tensor, outer: torch.Tensor, inner: torch.Tensor) -> torch.Tensor:
    """table [A, S, d] (contiguous), outer / inner indices broadcasting to [B, M] (outer may be negative, as in
    Python indexing: a padding row's -1) -> table[outer, inner] [B, M, d], as one index_select: what the
    advanced indexing gathers, at a fraction of its CPU cost (16 rows: ~5 against ~30 us)."""
    flat = (outer % table.shape[0]) * table.shape[1] + inner
    return table.view(-1, table.shape[-1]).index_select(0, flat.flatten()).view(*flat.shape, table.shape[-1])


def gather_entries(cache: CompressedCache, layout: BatchLayout, index: torch.Tensor) -> torch.Tensor:
    """Entries `index` [B, M] (int, -1 allowed: garbage, masked by the caller) of each row -> [B, M, d]."""
    idx = index.long().clamp_min(0)
    pages = layout.table64.gather(1, torch.div(idx, cache.per_page, rounding_mode="floor"))
    return _rows(cache.entries, pages, idx % cache.per_page)


def entry_count_bound(layout: BatchLayout, ratio: int) -> int:
    """Columns of the entry gathers: the most entries any row can hold (a static bound when the layout's
    max_end is fixed, e.g. from max_model_len)."""
    return max(layout.max_end // ratio, 1)


def attend_decode(
    q: torch.Tensor,
    swa: torch.Tensor,
    comp: CompressedCache | None,
    topk: torch.Tensor | None,
    layout: BatchLayout,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, H, d] -> [B, H, d] fp32: each row over its window, plus its chosen (CSA, `topk` [B, K]) or all
    visible (HCA) compressed entries; the sink joins only the denominator (attention.sparse_attention)."""
    keys, valid = window_keys(swa, layout)
    if comp is not None:
        if topk is not None:
            index = topk.long()
            visible = index >= 0
        else:
            cols = torch.arange(entry_count_bound(layout, comp.ratio), device=q.device)
            index = cols.expand(q.shape[0], -1)
            visible = cols[None, :] < ((layout.positions64 + 1) // comp.ratio)[:, None]
        keys = torch.cat((keys, gather_entries(comp, layout, index)), dim=1)
        valid = torch.cat((valid, visible), dim=1)
    kf = keys.float()  # [B, L, d]
    s = torch.einsum("bhd,bld->bhl", q.float(), kf) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sink.float().view(1, -1)
    m = torch.maximum(s.amax(dim=-1), sink)  # [B, H]
    p = torch.exp(s - m.unsqueeze(-1))
    denom = p.sum(dim=-1) + torch.exp(sink - m)
    return torch.einsum("bhl,bld->bhd", p, kf) / denom.unsqueeze(-1)


def select_decode(
    q: torch.Tensor, weights: torch.Tensor, cache: CompressedCache, layout: BatchLayout, index_topk: int
) -> torch.Tensor:
    """The indexer's choice for decode rows: q [B, H_I, d_I], weights [B, H_I] fp32 -> [B, index_topk] int32
    entry indices in ascending order, -1 padded (`Indexer.as_indices`' layout)."""
    bound = entry_count_bound(layout, cache.ratio)
    cols = torch.arange(bound, device=q.device)
    keys = gather_entries(cache, layout, cols.expand(q.shape[0], -1))  # [B, M, d_I]
    visible = cols[None, :] < ((layout.positions64 + 1) // cache.ratio)[:, None]
    scores = torch.einsum("bhd,bmd->bhm", q.float(), keys.float()).relu_()
    scores = (scores * weights.unsqueeze(-1)).sum(dim=1).masked_fill(~visible, float("-inf"))  # [B, M]
    k = min(index_topk, bound)
    top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    chosen = torch.zeros_like(visible).scatter_(1, top, True) & visible
    order = torch.where(chosen, cols, cols + bound).sort(dim=1).values[:, :k]
    order = torch.where(order < bound, order, -1)
    return torch.nn.functional.pad(order, (0, index_topk - k), value=-1).to(torch.int32)
