"""Exact rollback of a speculative forward (speculative decoding, issue 19).

A verify forward runs a row [last token, d_1 .. d_N] at positions p .. p + N and keeps only the first K of
them. What it wrote for the rejected positions must look as if never written:

- window ring: the rejected positions overwrote the ring rows of positions q - W, which later tokens still
  attend to: those rows are saved before the forward and put back.
- compressor carry: every compressor writes its pending rows positionally (row q % ratio holds position q;
  model/compressor.py), so with T <= ratio each row is written at most once by the forward, and a rejected
  position's row is put back to its value before the forward. The overlap half `prev_*` changes only when a
  window closes (q % ratio == ratio - 1); with T <= ratio at most one closes, and when its closing
  position is rejected the saved `prev_*` is put back.
- compressed entries and indexer keys: an entry of a window closed by a rejected position lies at an index
  >= the kept length // ratio: nobody reads it (reads stop at the sequence's own count, kv_pool.py) and
  the window's real closing overwrites it, so entries need no saving.

The forward cannot know how many tokens it keeps, so `save` copies (per layer, for the rows asked) the ring
rows the forward will overwrite and the slot's whole carry (a few rows of `ratio` each); `restore` puts back
what the rejected positions changed. Both are a few gathers / scatters per layer for the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4serve.model.kv_pool import CompressedCache, KvPool


@dataclass(frozen=True)
class SpecRow:
    slot: int
    start: int  # position of the row's first token
    num_tokens: int  # tokens the speculative forward(s) write from `start` on


@dataclass
class _CarrySave:
    pending_kv: torch.Tensor  # [R, ratio, w] fp32, the rows' carry before the forward
    pending_score: torch.Tensor
    prev_kv: torch.Tensor | None  # [R, ratio, d] fp32 (overlapping compressors)
    prev_score: torch.Tensor | None


@dataclass
class SpecSave:
    """What a speculative forward over `rows` will overwrite in `layers` of `pool`."""

    pool: KvPool
    layers: range
    rows: tuple[SpecRow, ...]
    ring: list[torch.Tensor]  # per layer: [sum of T, D] the ring rows at the rows' positions
    carry: list[list[_CarrySave | None]]  # per layer: (comp, idx)


def _index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host indices on the device without blocking the host (torch.tensor(..., device=cuda) is a blocking copy
    from pageable memory: a host-device sync per call, seven per speculative step)."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def max_spec_tokens(pool: KvPool, layers: range) -> int:
    """The most tokens one speculative forward may write and still roll back exactly: the smallest
    compression ratio and the window of those layers (see the module note)."""
    a = pool.args
    ratios = [a.compress_ratios[i] for i in layers if a.compress_ratios[i]]
    return min([a.window_size, *ratios])


def _ring_index(rows: Sequence[SpecRow], window: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    slots = [r.slot for r in rows for _ in range(r.num_tokens)]
    pos = [(r.start + k) % window for r in rows for k in range(r.num_tokens)]
    return _index(slots, device), _index(pos, device)


def save(pool: KvPool, layers: range, rows: Sequence[SpecRow]) -> SpecSave:
    limit = max_spec_tokens(pool, layers)
    if any(r.num_tokens > limit for r in rows):
        raise ValueError(f"a speculative row writes more than {limit} tokens: its rollback would not be exact")
    dev = pool.device
    slots = _index([r.slot for r in rows], dev)
    ring_slots, ring_pos = _ring_index(rows, pool.args.window_size, dev)
    ring, carry = [], []
    for i in layers:
        layer = pool.layers[i]
        ring.append(layer.swa[ring_slots, ring_pos])  # advanced indexing: a copy
        carry.append([_save_carry(c, slots) if c is not None else None for c in (layer.comp, layer.idx)])
    return SpecSave(pool, layers, tuple(rows), ring, carry)


def _save_carry(c: CompressedCache, slots: torch.Tensor) -> _CarrySave:
    prev = (c.prev_kv[slots], c.prev_score[slots]) if c.prev_kv is not None and c.prev_score is not None else None
    return _CarrySave(c.pending_kv[slots], c.pending_score[slots], *(prev or (None, None)))


def restore(saved: SpecSave, kept: Sequence[int]) -> None:
    """Undo what the speculative forward wrote for every position past the first kept[i] of row i."""
    rows, dev, window = saved.rows, saved.pool.device, saved.pool.args.window_size
    assert len(kept) == len(rows)
    # (saved row, slot, position) of every rejected position; ring rows are saved flat, rows one after another
    rejected = [
        (n, row.slot, row.start + j) for n, (row, k) in enumerate(zip(rows, kept)) for j in range(k, row.num_tokens)
    ]
    if not rejected:
        return
    firsts = [sum(r.num_tokens for r in rows[:n]) for n in range(len(rows))]
    flat = _index([firsts[n] + q - rows[n].start for n, _, q in rejected], dev)
    slots = _index([slot for _, slot, _ in rejected], dev)
    where = _index([q % window for _, _, q in rejected], dev)
    carry_index: dict[int, _CarryIndex] = {}  # by compression ratio: built once per step, not per layer
    for n, i in enumerate(saved.layers):
        layer = saved.pool.layers[i]
        layer.swa[slots, where] = saved.ring[n][flat]
        for c, s in zip((layer.comp, layer.idx), saved.carry[n]):
            if c is not None and s is not None:
                if c.ratio not in carry_index:
                    carry_index[c.ratio] = _CarryIndex.of(rejected, c.ratio, slots, dev)
                _restore_carry(c, s, carry_index[c.ratio])


@dataclass(frozen=True)
class _CarryIndex:
    row: torch.Tensor  # [M] the saved row of each rejected position
    slot: torch.Tensor  # [M] its sequence slot
    pending: torch.Tensor  # [M] its carry row, position % ratio
    prev_row: torch.Tensor | None  # [K] the saved rows whose window-closing position was rejected
    prev_slot: torch.Tensor | None

    @classmethod
    def of(
        cls, rejected: list[tuple[int, int, int]], ratio: int, slots: torch.Tensor, dev: torch.device
    ) -> _CarryIndex:
        closing = [(n, slot) for n, slot, q in rejected if q % ratio == ratio - 1]
        prev = (_index([n for n, _ in closing], dev), _index([s for _, s in closing], dev)) if closing else (None, None)
        row = _index([n for n, _, _ in rejected], dev)
        pending = _index([q % ratio for _, _, q in rejected], dev)
        return cls(row, slots, pending, *prev)


def _restore_carry(c: CompressedCache, s: _CarrySave, ix: _CarryIndex) -> None:
    c.pending_kv[ix.slot, ix.pending] = s.pending_kv[ix.row, ix.pending]
    c.pending_score[ix.slot, ix.pending] = s.pending_score[ix.row, ix.pending]
    if ix.prev_row is not None and c.prev_kv is not None and c.prev_score is not None:
        assert s.prev_kv is not None and s.prev_score is not None
        c.prev_kv[ix.prev_slot] = s.prev_kv[ix.prev_row]
        c.prev_score[ix.prev_slot] = s.prev_score[ix.prev_row]
