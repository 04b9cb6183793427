"""Paged sparse attention (dsv4_kernels.sparse_attention) in the interpreter against its torch
reference, and the reference against an independent dense computation (the model's
`sparse_attention` over each request's whole key list with a boolean mask).

Tolerance, and why: under the interpreter the kernel computes in fp32 while the reference evaluates
the same softmax exactly (fp64, rounded once). Each fp32 logit carries at most ~D * 2^-24 relative
error in its D-term dot product, the exp2 / rescaling steps a few ulp each, and the output is an
average of at most L <= W + K keys, so the error is ~(D + L) * 2^-24 * (1 + |logits|) of max|v|:
below 2e-6 * max|v| here (D <= 128, L <= 32, |logits| < 8). We allow 1e-5 * max|v| (observed ~3e-7).
Positions and entries no query may read hold NaN (stale ring slots, pages past a request's entries,
unused pages), and each run writes into a NaN-poisoned view of a larger buffer, so a read of a key
that is not there, an element left unwritten or a store outside the output all fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dsv4_kernels.sparse_attention import paged_sparse_attention, store_dtype
from dsv4_kernels.sparse_attention_ref import paged_sparse_attention_ref
from dsv4_kernels.testing import into_poisoned
from dsv4serve.model.attention import sparse_attention

WINDOW = 16  # dsv4-tiny's window
NUM_PAGES = 40


@dataclass(frozen=True)
class Batch:
    """One step's inputs in the paged layout (the kwargs of both functions) plus the per-request truth
    that the dense oracle needs: every key by position, every compressed entry in order."""

    kwargs: dict
    keys_by_pos: list[torch.Tensor]  # request b: [start_pos + T, D]; positions no ring holds are NaN
    entries: list[torch.Tensor]  # request b: [num_entries, D], as the pages hold them (dropped pages: NaN)


def _make_batch(
    rows: list[tuple[int, int]],
    mode: str,
    heads: int = 6,
    dim: int = 64,
    ratio: int = 4,
    topk: int = 6,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """rows: (new tokens, start_pos) per request. mode: 'swa', 'csa' (topk_idx) or 'hca' (all visible)."""
    gen = torch.Generator().manual_seed(seed)
    num_req, num_rows = len(rows), sum(n for n, _ in rows)
    nan = float("nan")
    swa = torch.full((num_req + 2, WINDOW, dim), nan)
    seq_slot = torch.randperm(num_req + 2, generator=gen)[:num_req].int()
    per_page = WINDOW // ratio
    comp = torch.full((NUM_PAGES, per_page, dim), nan)
    table = torch.full((num_req, 8), -1, dtype=torch.int32)
    free_pages = torch.randperm(NUM_PAGES, generator=gen).tolist()
    new_kv, keys_by_pos, entries, topk_rows = [], [], [], []
    for b, (n_new, sp) in enumerate(rows):
        keys = torch.randn(sp + n_new, dim, generator=gen) * 1.5
        keys[: max(0, sp - WINDOW)] = nan  # only the last W context positions are in the ring
        for p in range(max(0, sp - WINDOW), sp):
            swa[seq_slot[b], p % WINDOW] = keys[p]
        new_kv.append(keys[sp:])
        keys_by_pos.append(keys)
        n_entries = (sp + n_new) // ratio  # every entry the chunk's last token closes
        ent = torch.randn(n_entries, dim, generator=gen)
        for page in range(-(-n_entries // per_page)):
            table[b, page] = free_pages.pop()
            comp[table[b, page], : min(per_page, n_entries - page * per_page)] = ent[page * per_page :][:per_page]
        if mode == "hca" and n_entries > per_page:  # an invalid page inside the visible range is skipped
            table[b, 0] = -1
            ent[:per_page] = nan
        entries.append(ent)
        for t in range(sp, sp + n_new):
            visible = (t + 1) // ratio
            chosen = torch.randperm(visible, generator=gen)[:topk]  # fewer than topk when few are visible
            picks = torch.cat((chosen, torch.full((topk - chosen.numel(),), -1)))
            if chosen.numel() < topk and visible < n_entries:  # a stored entry this token may not see yet
                picks[-1] = visible
            topk_rows.append(picks.int())
    cu = torch.tensor([0] + [n for n, _ in rows], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    start_pos = torch.tensor([sp for _, sp in rows], dtype=torch.int32)
    kwargs = dict(
        q=torch.randn(num_rows, heads, dim, generator=gen).to(dtype),
        new_kv=torch.cat(new_kv).to(dtype),
        swa_kv=swa.to(dtype),
        cu_seqlens=cu,
        start_pos=start_pos,
        seq_slot=seq_slot,
        sink=torch.randn(heads, generator=gen) * 2,
        scale=dim**-0.5,
    )
    if mode != "swa":
        kwargs.update(comp_kv=comp.to(dtype), block_table=table, ratio=ratio)
    if mode == "csa":
        kwargs["topk_idx"] = torch.stack(topk_rows)
    return Batch(kwargs, keys_by_pos, entries)


def _run_poisoned(batch: Batch, **launch) -> torch.Tensor:
    return into_poisoned(
        tuple(batch.kwargs["q"].shape),
        store_dtype(),
        lambda out: paged_sparse_attention(**batch.kwargs, out=out, **launch),
    )


def _assert_close(out: torch.Tensor, ref: torch.Tensor, batch: Batch) -> None:
    assert out.shape == ref.shape and not torch.isnan(out).any() and not torch.isnan(ref).any()
    max_v = max(
        x.nan_to_num().abs().max().item()
        for x in batch.kwargs.values()
        if isinstance(x, torch.Tensor) and x.is_floating_point()
    )
    err = (out.float() - ref).abs().max().item()
    assert err <= 1e-5 * max_v, f"max err {err} > {1e-5 * max_v}"


CASES = {  # name: (rows [(new tokens, start_pos)], mode, extra batch kwargs)
    "decode_csa": ([(1, 0), (1, 5), (1, 16), (1, 40)], "csa", {}),
    "chunks_csa": ([(5, 0), (1, 37), (9, 21), (3, 14)], "csa", {"topk": 8}),
    "decode_hca": ([(1, 70), (1, 15), (1, 3)], "hca", {"ratio": 16}),
    "chunks_hca": ([(6, 30), (2, 0), (4, 60)], "hca", {"ratio": 16}),
    "chunks_swa": ([(4, 0), (1, 100), (7, 12)], "swa", {}),
    "dim128_bf16": ([(1, 33), (3, 17)], "csa", {"dim": 128, "heads": 4, "dtype": torch.bfloat16}),
}


@pytest.mark.parametrize(
    ("name", "num_splits"),
    [
        ("decode_csa", 1),
        ("decode_csa", 3),
        ("chunks_csa", 1),
        ("chunks_csa", 3),
        ("decode_hca", 3),
        ("chunks_hca", 1),
        ("chunks_swa", 2),
        ("dim128_bf16", 2),
    ],
)
def test_kernel_matches_reference(name: str, num_splits: int) -> None:
    """Decode and ragged chunks, start_pos 0 and > W, CSA / HCA / SWA-only, with the single-split
    (prefill) form and the split-K (decode) form, including splits that get no key block."""
    rows, mode, extra = CASES[name]
    batch = _make_batch(rows, mode, seed=len(name), **extra)
    out = _run_poisoned(batch, num_splits=num_splits, block_n=8)
    _assert_close(out, paged_sparse_attention_ref(**batch.kwargs), batch)


@pytest.mark.parametrize("block_h", [4, 16])
def test_head_tiles(block_h: int) -> None:
    """Heads split over two programs (4 of 8) and a head tile wider than the heads (16 of 8, masked)."""
    batch = _make_batch([(2, 9), (1, 50)], "csa", heads=8, seed=5)
    out = _run_poisoned(batch, num_splits=2, block_h=block_h, block_n=16)
    _assert_close(out, paged_sparse_attention_ref(**batch.kwargs), batch)


def _dense_oracle(batch: Batch) -> torch.Tensor:
    """Every request's whole key list [positions 0 .. end | entries 0 .. end] with a [T, L] mask built from
    the definitions (window, visibility, top-k membership), through dsv4serve.model.attention."""
    kw = batch.kwargs
    ratio, topk = kw.get("ratio", 0), kw.get("topk_idx")
    cu, outs = kw["cu_seqlens"].tolist(), []
    for b, (keys, ent) in enumerate(zip(batch.keys_by_pos, batch.entries)):
        sp, n_new = int(kw["start_pos"][b]), cu[b + 1] - cu[b]
        q_pos = sp + torch.arange(n_new)
        delta = q_pos[:, None] - torch.arange(sp + n_new)[None, :]
        allowed = (delta >= 0) & (delta < WINDOW)
        if ratio:
            visible = torch.arange(ent.shape[0])[None, :] < ((q_pos + 1) // ratio)[:, None]
            if topk is not None:
                chosen = torch.zeros_like(visible)
                for i in range(n_new):
                    picks = topk[cu[b] + i]
                    chosen[i, picks[picks >= 0].long()] = True
                visible &= chosen
            visible &= ~torch.isnan(ent[:, 0])[None, :]  # entries of a dropped page are skipped
            keys, allowed = torch.cat((keys, ent)), torch.cat((allowed, visible), 1)
        keys = keys.masked_fill(~allowed.any(0)[:, None], 0.0)  # positions nobody may read
        outs.append(
            sparse_attention(
                kw["q"][cu[b] : cu[b + 1]].double(), keys.double(), allowed, kw["sink"].double(), kw["scale"]
            )
        )
    return torch.cat(outs).float()


@pytest.mark.parametrize("name", ["chunks_csa", "chunks_hca", "chunks_swa"])
def test_reference_matches_dense_oracle(name: str) -> None:
    rows, mode, extra = CASES[name]
    batch = _make_batch(rows, mode, seed=len(name), **extra)
    ref = paged_sparse_attention_ref(**batch.kwargs)
    oracle = _dense_oracle(batch)
    assert torch.allclose(ref, oracle, rtol=1e-6, atol=1e-6), (ref - oracle).abs().max()


def test_rejects_inconsistent_inputs() -> None:
    batch = _make_batch([(1, 3)], "csa")
    with pytest.raises(ValueError):
        paged_sparse_attention(**{**batch.kwargs, "ratio": 0})
    with pytest.raises(ValueError):
        paged_sparse_attention(**{**batch.kwargs, "new_kv": batch.kwargs["new_kv"].double()})
