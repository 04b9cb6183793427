"""Torch reference of the paged sparse attention (dsv4-model.md §2.3, §2.6) on the paged KV layout.

For the query at absolute position t of request b, the keys (= values) are the window positions
max(0, t-W+1) .. t (positions >= start_pos[b] from `new_kv`, earlier ones from the ring
`swa_kv[seq_slot[b], p % W]`) plus the selected compressed entries e, read at
`comp_kv[block_table[b, e // E], e % E]`, where E = comp_kv.shape[1] entries share a page. Entry e is
visible iff e < (t + 1) // ratio; CSA layers select entries with `topk_idx` (-1 = unused), HCA layers
use every visible entry, SWA-only layers pass no `comp_kv`. A slot whose index or page is -1 is
skipped. The sink logit joins only the softmax denominator.

The reference gathers each query's key list [L, D] (L = W + the compressed slots), masks what is
invalid, and evaluates the softmax in fp64: the exact value, rounded once to fp32.
"""

from __future__ import annotations

import torch

ROW_CHUNK = 256  # query rows gathered at a time: bounds the [rows, L, D] gather at real dims


def _request_of_rows(cu_seqlens: torch.Tensor, num_rows: int) -> torch.Tensor:
    """cu_seqlens [B+1] -> the request of each packed row [N] int64."""
    counts = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(counts.numel(), device=cu_seqlens.device), counts, output_size=num_rows)


def _window_keys(
    req: torch.Tensor,
    pos: torch.Tensor,
    cu_seqlens: torch.Tensor,
    start_pos: torch.Tensor,
    seq_slot: torch.Tensor,
    new_kv: torch.Tensor,
    swa_kv: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window keys of the given rows: [R, W, D] and validity [R, W] (slot i holds position t-W+1+i)."""
    window = swa_kv.shape[1]
    key_pos = pos[:, None] - window + 1 + torch.arange(window, device=pos.device)[None, :]  # [R, W]
    sp = start_pos.long()[req][:, None]
    valid = key_pos >= 0
    from_new = key_pos >= sp
    new_row = (cu_seqlens.long()[req][:, None] + key_pos - sp).clamp(0, new_kv.shape[0] - 1)
    ring = swa_kv[seq_slot.long()[req][:, None], key_pos.remainder(window)]  # [R, W, D]
    keys = torch.where(from_new[..., None], new_kv[new_row], ring)
    return keys, valid


def _compressed_keys(
    req: torch.Tensor,
    pos: torch.Tensor,
    comp_kv: torch.Tensor,
    block_table: torch.Tensor,
    topk_idx: torch.Tensor | None,
    ratio: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected compressed entries of the given rows: [R, K, D] and validity [R, K]."""
    per_page = comp_kv.shape[1]
    num_visible = (pos + 1) // ratio  # [R]
    if topk_idx is None:  # HCA: every entry the longest-seeing row may use, masked per row
        entry = torch.arange(int(num_visible.max().item()) if pos.numel() else 0, device=pos.device)
        entry = entry[None, :].expand(pos.shape[0], -1)
    else:
        entry = topk_idx.long()
    valid = (entry >= 0) & (entry < num_visible[:, None])
    page_col = (entry // per_page).clamp(0, block_table.shape[1] - 1)
    page = block_table.long()[req[:, None], page_col]
    valid &= page >= 0
    keys = comp_kv[page.clamp_min(0), entry.clamp_min(0).remainder(per_page)]
    return keys, valid


def paged_sparse_attention_ref(
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
) -> torch.Tensor:
    """q [N, H, D], new_kv [N, D], swa_kv [slots, W, D], cu_seqlens [B+1], start_pos [B], seq_slot [B],
    sink [H] fp32; optional comp_kv [pages, E, D], block_table [B, max_pages], topk_idx [N, K], ratio
    -> o [N, H, D] fp32 (see the module doc)."""
    num_rows = q.shape[0]
    req_all = _request_of_rows(cu_seqlens, num_rows)
    pos_all = start_pos.long()[req_all] + torch.arange(num_rows, device=q.device) - cu_seqlens.long()[req_all]
    sink64 = sink.double()[None, :]  # [1, H]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for lo in range(0, num_rows, ROW_CHUNK):
        rows = torch.arange(lo, min(num_rows, lo + ROW_CHUNK), device=q.device)
        req, pos = req_all[rows], pos_all[rows]
        keys, valid = _window_keys(req, pos, cu_seqlens, start_pos, seq_slot, new_kv, swa_kv)
        if comp_kv is not None:
            assert block_table is not None, "compressed keys are paged: comp_kv comes with its block_table"
            comp, comp_valid = _compressed_keys(
                req, pos, comp_kv, block_table, None if topk_idx is None else topk_idx[rows], ratio
            )
            keys, valid = torch.cat((keys, comp), 1), torch.cat((valid, comp_valid), 1)
        k64 = keys.double().masked_fill(~valid[..., None], 0.0)  # stale slots may hold anything, even NaN
        logits = torch.einsum("rhd,rld->rhl", q[rows].double(), k64) * scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        m = torch.maximum(logits.amax(-1), sink64)  # [R, H]
        p = torch.exp(logits - m[..., None])
        denom = p.sum(-1) + torch.exp(sink64 - m)
        out[rows] = (torch.einsum("rhl,rld->rhd", p, k64) / denom[..., None]).float()
    return out
