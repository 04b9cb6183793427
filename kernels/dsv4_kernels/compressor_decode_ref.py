"""Torch reference of the compressor's decode update (dsv4-model.md §2.4; kernel:
`compressor_decode.compressor_decode`; the model's vectorized torch form is
`dsv4serve.model.compressor.Compressor.update_decode`).

Each row is one token at position p of the sequence in its slot. With ratio m, j = p % m and e = p // m:
1. the token's kv and score (gate + ape[j]) join the slot's carry at row j (`pending_*`);
2. window e is pooled from the carry as it now stands: all m rows (rows past j still hold an older
   window's tokens: the entry is partial until j = m - 1, and nobody reads entry e before then);
   overlapping (CSA, m = 4) windows pool 2m slots, the previous window's A halves (`prev_*`; for
   e = 0, kv 0 with score -inf) and the carry's B halves;
3. the pooled row becomes an entry (compressed_entry_ref: RMSNorm, RoPE at position e * m, the mode's
   simulation) stored at entry e of the row's pages;
4. when the window closes (j = m - 1), its A halves become the slot's `prev_*`.

Pooling is the exact one (compressor_pool_ref: fp64, rounded once), so the kernel's fp32 pooling is
measured against the exact value; the update works row by row (rows are distinct sequences).
"""

from __future__ import annotations

import torch

from dsv4_kernels.compressor_pool_ref import compressor_pool_ref
from dsv4_kernels.token_ops_ref import KV_BLOCK, Angles, compressed_entry_ref


def compressor_decode_ref(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_table: torch.Tensor,
    pending_kv: torch.Tensor,
    pending_score: torch.Tensor,
    prev_kv: torch.Tensor | None,
    prev_score: torch.Tensor | None,
    entries: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    freqs: torch.Tensor,
    mode: str,
    compute_dtype: torch.dtype,
    nope_dims: int = 0,
    fp8_block: int = KV_BLOCK,
) -> None:
    """kv, gate [B, coff * d] fp32 of B decode rows -> updates pending_* [slots, m, coff * d], prev_*
    [slots, m, d] (overlapping form only, else None) and entries [pages, per_page, d] in place."""
    ratio, per_page, d = pending_kv.shape[1], entries.shape[1], entries.shape[2]
    overlap = prev_kv is not None
    for b in range(kv.shape[0]):
        p, slot = int(positions[b]), int(slots[b])
        j, e = p % ratio, p // ratio
        pending_kv[slot, j] = kv[b]
        pending_score[slot, j] = gate[b] + ape[j].float()
        win_kv, win_score = pending_kv[slot].clone(), pending_score[slot].clone()  # [m, coff * d]
        if overlap:
            assert prev_kv is not None and prev_score is not None
            first = e == 0
            before_kv = torch.zeros_like(prev_kv[slot]) if first else prev_kv[slot].clone()
            before_score = torch.full_like(prev_score[slot], float("-inf")) if first else prev_score[slot].clone()
            if j == ratio - 1:
                prev_kv[slot], prev_score[slot] = win_kv[:, :d], win_score[:, :d]
            win_kv = torch.cat((before_kv, win_kv[:, d:]))
            win_score = torch.cat((before_score, win_score[:, d:]))
        pooled = compressor_pool_ref(win_kv[None], win_score[None])  # [1, d]
        angles = Angles.at(positions[b : b + 1].long(), freqs.float(), ratio)
        entry = compressed_entry_ref(pooled, norm_weight, eps, angles, mode, compute_dtype, nope_dims, fp8_block)
        page = int(block_table[b, e // per_page])
        entries[page, e % per_page] = entry[0].to(entries.dtype)
