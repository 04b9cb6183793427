"""Indexer scoring + top-k (dsv4_kernels.indexer_topk) in the interpreter against its torch reference,
and the reference against the model's `Indexer.select`.

Tolerance of the scores, and why: the reference is the exact score (fp64) rounded once to fp32; the
kernel accumulates q . k over Di terms and the weighted head sum over Hi terms in fp32, in another
order. Each dot is off by at most Di * 2^-24 * sum_d |q_d k_d| (relu does not enlarge it), and the
head sum adds Hi * 2^-24 of its magnitude, so |err| <= (Di + Hi + 1) * 2^-24 * sum_h |w_h| sum_d
|q_hd k_d|; we allow twice that. The choice is compared exactly: on small-integer data every score
is exact in fp32 in any order (ties everywhere, the tie rule decides), and on random data the seeds
are fixed and no two scores of a row sit within that error of each other.

Every run stores into a NaN-poisoned view of a larger buffer (an unwritten score fails, a store
outside the view fails the border check), and every key slot no row may see (unused pages, the tail
of a partly filled page) holds NaN, so reading one poisons a score.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.indexer_topk import indexer_scores, indexer_topk, select_topk
from dsv4_kernels.indexer_topk_ref import (
    gather_keys,
    indexer_scores_ref,
    indexer_topk_ref,
    topk_from_scores_ref,
    visible_counts,
)
from dsv4_kernels.indexer_topk_select import topk_select
from dsv4_kernels.testing import into_poisoned

RATIO = 4


def _problem(
    requests: list[tuple[int, int]], heads: int, head_dim: int, per_page: int, seed: int, integer: bool = False
) -> dict:
    """A packed step: requests [(start_pos, n_rows)], each with its own shuffled pages."""
    gen = torch.Generator().manual_seed(seed)
    n_entries = [(start + n) // RATIO for start, n in requests]
    pages_needed = [-(-e // per_page) for e in n_entries]
    num_pages = sum(pages_needed) + 3  # three pages nobody owns
    order = torch.randperm(num_pages, generator=gen).int()
    block_table = torch.full((len(requests), max(pages_needed) + 2), -1, dtype=torch.int32)  # -1 padding
    used = 0
    for b, need in enumerate(pages_needed):
        block_table[b, :need] = order[used : used + need]
        used += need
    if integer:
        idx_k = torch.randint(-1, 2, (num_pages, per_page, head_dim), generator=gen).float()
    else:
        idx_k = torch.randn(num_pages, per_page, head_dim, generator=gen)
    readable = torch.zeros(num_pages, per_page, dtype=torch.bool)
    for b, n in enumerate(n_entries):
        e = torch.arange(n)
        readable[block_table[b].long()[e // per_page], e % per_page] = True
    idx_k[~readable] = float("nan")
    n_rows = sum(n for _, n in requests)
    if integer:
        q = torch.randint(-1, 2, (n_rows, heads, head_dim), generator=gen).float()
        weights = torch.randint(-2, 5, (n_rows, heads), generator=gen).float() / 2
    else:
        q = torch.randn(n_rows, heads, head_dim, generator=gen)
        weights = torch.randn(n_rows, heads, generator=gen)
    cu = torch.tensor([0] + [n for _, n in requests], dtype=torch.int32).cumsum(0).int()
    start_pos = torch.tensor([s for s, _ in requests], dtype=torch.int32)
    return dict(q=q, weights=weights, idx_k=idx_k, block_table=block_table, cu_seqlens=cu, start_pos=start_pos)


def _score_bound(p: dict, num_cols: int) -> torch.Tensor:
    """Twice the fp32 summation-order bound of the module doc, [N, num_cols] (inf where invisible)."""
    q, w = p["q"], p["weights"]
    bound = torch.full((q.shape[0], num_cols), float("inf"))
    bounds = p["cu_seqlens"].tolist()
    visible = visible_counts(p["cu_seqlens"], p["start_pos"], RATIO)
    for b in range(len(bounds) - 1):
        rows = slice(bounds[b], bounds[b + 1])
        n_vis = int(visible[rows].max()) if bounds[b] < bounds[b + 1] else 0
        keys = gather_keys(p["idx_k"], p["block_table"], b, n_vis)
        mag = torch.einsum("th,thd,sd->ts", w[rows].abs().double(), q[rows].abs().double(), keys.abs().double())
        bound[rows, :n_vis] = 2 * (q.shape[2] + q.shape[1] + 1) * 2.0**-24 * mag.float()
    return bound


def _scores_poisoned(p: dict, num_cols: int, max_rows: int, blocks=None) -> torch.Tensor:
    return into_poisoned(
        (p["q"].shape[0], num_cols),
        torch.float32,
        lambda out: indexer_scores(
            **p, ratio=RATIO, num_cols=num_cols, max_rows_per_request=max_rows, blocks=blocks, out=out
        ),
    )


# (requests [(start_pos, n_rows)], heads, head_dim, entries per page)
CASES = {
    "decode_m1_real_heads": ([(37, 1)], 64, 128, 32),
    "decode_batch": ([(5, 1), (130, 1), (2, 1), (63, 1)], 6, 64, 4),  # a row that sees no entry yet
    "ragged_chunks": ([(0, 21), (50, 3), (9, 17)], 4, 64, 4),  # a chunk from position 0, two tiles
    "mixed_decode_and_chunk": ([(70, 1), (13, 9)], 4, 32, 8),
}


@pytest.mark.parametrize("case", CASES)
def test_scores_match_reference(case: str) -> None:
    requests, heads, head_dim, per_page = CASES[case]
    p = _problem(requests, heads, head_dim, per_page, seed=len(case))
    num_cols = int(visible_counts(p["cu_seqlens"], p["start_pos"], RATIO).max()) + 5  # spare columns
    out = _scores_poisoned(p, num_cols, max(n for _, n in requests))
    ref = indexer_scores_ref(**p, ratio=RATIO, num_cols=num_cols)
    assert not torch.isnan(out).any()
    assert torch.equal(torch.isinf(out), torch.isinf(ref)), "visibility differs"
    finite = torch.isfinite(ref)
    err = (out - ref).abs()[finite]
    assert bool((err <= _score_bound(p, num_cols)[finite]).all()), f"max err {err.max().item()}"


def test_bf16_inputs_match_reference() -> None:
    """The serving dtype: bf16 q and keys (upcast after loading under the interpreter)."""
    p = _problem([(5, 1), (130, 1), (27, 6)], 6, 64, 4, seed=11)
    p["q"], p["idx_k"] = p["q"].to(torch.bfloat16), p["idx_k"].to(torch.bfloat16)
    num_cols = int(visible_counts(p["cu_seqlens"], p["start_pos"], RATIO).max())
    out = _scores_poisoned(p, num_cols, 6)
    ref = indexer_scores_ref(**p, ratio=RATIO, num_cols=num_cols)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isinf(out), ~finite)
    assert bool(((out - ref).abs()[finite] <= _score_bound(p, num_cols)[finite]).all())


@pytest.mark.parametrize("blocks", [(1, 16), (4, 16), (16, 64)])
def test_score_tile_forms_agree(blocks: tuple[int, int]) -> None:
    """Several key blocks and row tiles per request (BLOCK_T, BLOCK_E forced small)."""
    requests = [(30, 9), (3, 6), (101, 1)]
    p = _problem(requests, 4, 32, 4, seed=7)
    num_cols = int(visible_counts(p["cu_seqlens"], p["start_pos"], RATIO).max())
    out = _scores_poisoned(p, num_cols, 9, blocks=blocks)
    ref = indexer_scores_ref(**p, ratio=RATIO, num_cols=num_cols)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isinf(out), ~finite)
    assert bool(((out - ref).abs()[finite] <= _score_bound(p, num_cols)[finite]).all())


@pytest.mark.parametrize("integer", [True, False], ids=["integer_ties", "random"])
@pytest.mark.parametrize("topk", [3, 8, 64])  # 64: more than any row sees, so -1 padding everywhere
def test_topk_matches_reference(integer: bool, topk: int) -> None:
    p = _problem([(0, 14), (45, 1), (22, 5)], 4, 32, 4, seed=topk, integer=integer)
    got = indexer_topk(**p, ratio=RATIO, topk=topk)
    ref = indexer_topk_ref(**p, ratio=RATIO, topk=topk)
    assert got.dtype == torch.int32 and got.shape == (14 + 1 + 5, topk)
    assert torch.equal(got, ref)
    if integer:  # the data really has ties for the rule to settle
        scores = indexer_scores_ref(**p, ratio=RATIO, num_cols=12)
        finite = scores[torch.isfinite(scores)]
        assert finite.unique().numel() < finite.numel()


def test_select_topk_tie_rule() -> None:
    """Equal scores go to the earlier entry (+0.0 and -0.0 are equal), best first, -1 padding, and
    appending invisible (-inf) columns changes nothing."""
    inf = float("inf")
    scores = torch.tensor(
        [[0.0, 2.0, -0.0, 2.0, -1.0, -inf], [-0.0, 0.0, -inf, -inf, -inf, -inf], [-3.0, -inf, -3.0, 5.0, -2.0, 0.0]]
    )
    expected = torch.tensor([[1, 3, 0, 2], [0, 1, -1, -1], [3, 5, 4, 0]], dtype=torch.int32)
    assert torch.equal(select_topk(scores, 4), expected)
    assert torch.equal(topk_from_scores_ref(scores, 4), expected)
    wider = torch.cat((scores, torch.full((3, 9), -inf)), dim=1)
    assert torch.equal(select_topk(wider, 4), expected)
    assert torch.equal(select_topk(scores, 8), torch.nn.functional.pad(select_topk(scores, 6), (0, 2), value=-1))


def test_reference_matches_model_indexer_select() -> None:
    """Independent oracle: dsv4serve.model.indexer.Indexer.select (the model's stable-sort choice) on
    one request's keys, with integer data so that ties decide part of the choice."""
    from dsv4serve.model.args import args_from_dicts
    from dsv4serve.model.indexer import Indexer
    from dsv4serve.tiny.spec import TINY_CONFIG

    args = args_from_dicts(TINY_CONFIG, expert_dtype_hint="fp4")  # experts play no part here
    indexer = Indexer(args, ratio=RATIO)
    start, n_rows = 11, 26  # a chunk whose rows see 3 .. 9 entries, index_topk = 4 in dsv4-tiny
    p = _problem([(start, n_rows)], args.index_n_heads, args.index_head_dim, 4, seed=5, integer=True)
    n_entries = (start + n_rows) // RATIO
    keys = gather_keys(p["idx_k"], p["block_table"], 0, n_entries)
    visible = torch.arange(n_entries) < ((start + torch.arange(n_rows) + 1) // RATIO)[:, None]
    chosen = indexer.select(p["q"], p["weights"], keys, visible)  # [T, S] bool
    ref = indexer_topk_ref(**p, ratio=RATIO, topk=args.index_topk)
    ref_mask = torch.zeros(n_rows, n_entries + 1, dtype=torch.bool).scatter_(1, ref.long() % (n_entries + 1), True)
    assert torch.equal(chosen, ref_mask[:, :n_entries])
    assert torch.equal(indexer_topk(**p, ratio=RATIO, topk=args.index_topk), ref)


# ---- the choice kernel alone (indexer_topk_select), against the stable sort ----


def _select_poisoned(scores: torch.Tensor, topk: int, layout=None) -> torch.Tensor:
    """topk_select into a poisoned int32 view (-7 outside what it must write: int32 has no NaN)."""
    big = torch.full((scores.shape[0] + 3, topk + 3), -7, dtype=torch.int32)
    got = topk_select(scores, topk, layout, out=big[1:-2, 1:-2])
    border = big.clone()
    border[1:-2, 1:-2] = -7
    assert bool((border == -7).all()), "the kernel stored outside its output"
    return got


def _tied_rows(n_rows: int, num_cols: int, seed: int) -> torch.Tensor:
    """Scores as the indexer's are on dsv4-tiny: many exact zeros (+0.0 and -0.0), a few small integers
    (ties among them), random values that share their high bits (the radix rounds' later digits decide),
    -inf here and there."""
    gen = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 5, (n_rows, num_cols), generator=gen)
    scores = torch.randn(n_rows, num_cols, generator=gen)
    scores = torch.where(kind == 0, 0.0, scores)
    scores = torch.where(kind == 1, -0.0, scores)
    scores = torch.where(kind == 2, torch.randint(-2, 3, (n_rows, num_cols), generator=gen).float(), scores)
    near = 1.0 + torch.randint(0, 64, (n_rows, num_cols), generator=gen).float() * 2.0**-23  # 1 + a few ulps
    scores = torch.where(kind == 3, near, scores)
    return scores.masked_fill(torch.rand(n_rows, num_cols, generator=gen) < 0.05, float("-inf"))


@pytest.mark.parametrize(("num_cols", "topk"), [(37, 4), (300, 64), (2500, 512), (40, 64)])
def test_select_kernel_matches_the_stable_sort(num_cols: int, topk: int) -> None:
    """Ties everywhere; rows of several 1024-column passes (2500); k above every row's count (40, 64)."""
    scores = _tied_rows(5, num_cols, seed=num_cols)
    assert torch.equal(_select_poisoned(scores, topk), topk_from_scores_ref(scores, topk))


def test_select_kernel_breaks_zero_ties_at_the_kth_entry() -> None:
    """Exact zeros straddle the k-th place: the earlier zeros are chosen (-0.0 like +0.0), in column order
    after the better scores; a row of only zeros and -inf keeps its first k zeros."""
    inf = float("inf")
    scores = torch.tensor(
        [
            [0.0, 3.0, -0.0, 0.0, 1.0, -0.0, 0.0, -1.0, 0.0],  # k = 4: 3, 1, then the first two zeros
            [-inf, -0.0, -inf, 0.0, 0.0, -0.0, -inf, 0.0, 0.0],  # k = 4: the first four zeros
            [-2.0, -2.0, -2.0, -2.0, -2.0, -inf, -2.0, -2.0, 5.0],  # ties below zero
            [-inf] * 9,  # nothing visible: all -1
        ]
    )
    expected = torch.tensor([[1, 4, 0, 2], [1, 3, 4, 5], [8, 0, 1, 2], [-1, -1, -1, -1]], dtype=torch.int32)
    assert torch.equal(_select_poisoned(scores, 4), expected)
    assert torch.equal(topk_from_scores_ref(scores, 4), expected)


def test_select_kernel_scans_only_the_visible_columns() -> None:
    """With the layout, a row reads only its (position + 1) // ratio columns: NaN past them changes nothing."""
    requests = [(5, 1), (130, 1), (2, 1), (21, 9)]  # decode rows and a chunk; one row sees no entry
    cu = torch.tensor([0, 1, 2, 3, 12], dtype=torch.int32)
    start = torch.tensor([s for s, _ in requests], dtype=torch.int32)
    visible = visible_counts(cu, start, RATIO)
    scores = _tied_rows(12, 40, seed=3)
    past = torch.arange(40)[None, :] >= visible[:, None]
    expected = topk_from_scores_ref(scores.masked_fill(past, float("-inf")), 8)
    got = _select_poisoned(scores.masked_fill(past, float("nan")), 8, (cu, start, RATIO))
    assert torch.equal(got, expected)
