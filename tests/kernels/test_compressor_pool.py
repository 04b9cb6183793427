"""Compressor pooling (dsv4_kernels.compressor_pool) in the interpreter against its torch reference,
and the reference against the model's `Compressor.update`.

Tolerance, and why: the reference is the exact pooling (fp64) rounded once. The kernel's fp32 weights
exp(x), x = score - max <= 0, carry the rounding of x (|x| 2^-24 relative after exp) and of exp
itself (a couple of ulp, ex2.approx on a GPU), and the two sums over L slots add L * 2^-24 each; every
error is relative to the magnitudes summed, so |err| <= (2L + |x|max + 4) * 2^-24 * sum_l p_l |kv_l|,
with p the softmax weights; we allow twice that.

Every run stores into a NaN-poisoned view of a larger buffer: an unwritten channel fails, a store
outside the view fails the border check.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.compressor_pool import compressor_pool
from dsv4_kernels.compressor_pool_ref import compressor_pool_ref
from dsv4_kernels.testing import into_poisoned


def _bound(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Twice the bound of the module doc, [n_windows, d]."""
    s = score.double()
    top = s.amax(dim=1, keepdim=True)
    top = torch.where(torch.isinf(top), 0.0, top)
    p = torch.exp(s - top)
    p = p / p.sum(dim=1, keepdim=True).clamp_min(1e-300)
    spread = torch.where(torch.isinf(s), 0.0, (s - top).abs()).amax(dim=1)
    slots = kv.shape[1]
    return (2 * (2 * slots + spread + 4) * 2.0**-24 * (p * kv.double().abs()).sum(dim=1)).float()


def _pool_poisoned(kv: torch.Tensor, score: torch.Tensor, block_d: int | None = None) -> torch.Tensor:
    n, _, d = kv.shape
    return into_poisoned((n, d), torch.float32, lambda out: compressor_pool(kv, score, block_d=block_d, out=out))


def _windows(n_windows: int, slots: int, d: int, seed: int, first_half_missing: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(n_windows, slots, d, generator=gen)
    score = torch.randn(n_windows, slots, d, generator=gen) * 4  # softmax spreads from flat to peaked
    if first_half_missing:  # the CSA form's window 0: no previous window
        kv[0, : slots // 2] = 0.0
        score[0, : slots // 2] = float("-inf")
    return kv, score


# (n_windows, L, d, CSA first window): CSA decode m=1 (d = 512), the indexer's CSA form (d = 128) over a
# prefill chunk, HCA (L = 128) with d not a multiple of the channel block
SHAPES = [(1, 8, 512, True), (9, 8, 128, True), (3, 128, 96, False), (2, 8, 40, False)]


@pytest.mark.parametrize(("n_windows", "slots", "d", "first_half_missing"), SHAPES)
def test_pool_matches_reference(n_windows: int, slots: int, d: int, first_half_missing: bool) -> None:
    kv, score = _windows(n_windows, slots, d, seed=n_windows * d, first_half_missing=first_half_missing)
    out = _pool_poisoned(kv, score)
    ref = compressor_pool_ref(kv, score)
    assert not torch.isnan(out).any()
    err = (out - ref).abs()
    assert bool((err <= _bound(kv, score)).all()), f"max err {err.max().item()}"


@pytest.mark.parametrize("block_d", [16, 64])
def test_pool_channel_blocks_agree(block_d: int) -> None:
    """Several channel blocks per window, the last one partial (d = 100)."""
    kv, score = _windows(4, 8, 100, seed=block_d, first_half_missing=True)
    out = _pool_poisoned(kv, score, block_d=block_d)
    assert bool(((out - compressor_pool_ref(kv, score)).abs() <= _bound(kv, score)).all())


def test_all_missing_channel_pools_to_zero() -> None:
    """A channel with every slot -inf gives 0 (not NaN) in both; a single finite slot gives its kv."""
    kv, score = _windows(2, 8, 16, seed=3, first_half_missing=False)
    score[0, :, 5] = float("-inf")
    score[1, :, 2] = float("-inf")
    score[1, 6, 2] = 1.5
    for pooled in (_pool_poisoned(kv, score), compressor_pool_ref(kv, score)):
        assert not torch.isnan(pooled).any()
        assert pooled[0, 5] == 0.0
        assert torch.allclose(pooled[1, 2], kv[1, 6, 2], rtol=1e-6, atol=0)


def _model_entries(ratio: int, chunks: list[int], seed: int):
    """Run the model's compressor (dsv4-tiny dims, no QAT, fp32) over token chunks; return its kv and
    gate projections of every token, its parameters and the entries it wrote."""
    from dsv4serve.model.args import args_from_dicts
    from dsv4serve.model.compressor import Compressor
    from dsv4serve.model.kv_pool import CompressedCache
    from dsv4serve.model.numerics import NUMERICS_OFF
    from dsv4serve.model.rope import inv_freq
    from dsv4serve.tiny.spec import TINY_CONFIG

    args = args_from_dicts(TINY_CONFIG, expert_dtype_hint="fp4")  # experts play no part here
    gen = torch.Generator().manual_seed(seed)
    comp = Compressor(args, ratio, args.index_head_dim, rotate=True)
    with torch.no_grad():
        for param in comp.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * (0.3 if param.dim() == 2 else 1.0))
    n_tokens = sum(chunks)
    page_tokens = 16 if ratio == 4 else 128
    n_pages = -(-n_tokens // page_tokens)
    cache = CompressedCache.empty(
        ratio, page_tokens, args.index_head_dim, n_pages + 1, 1, torch.float32, torch.device("cpu")
    )
    pages = torch.randperm(n_pages + 1, generator=gen)[:n_pages]
    x = torch.randn(n_tokens, args.dim, generator=gen)
    kv, gate = comp.project(x, NUMERICS_OFF)
    start = 0
    for n in chunks:
        comp.update(
            kv[start : start + n],
            gate[start : start + n],
            start,
            cache,
            0,
            pages,
            inv_freq(args, compressed_layer=True),
            NUMERICS_OFF,
        )
        start += n
    n_entries = n_tokens // ratio
    return comp, kv, gate, cache.read(pages, n_entries), args.rope_head_dim


@pytest.mark.parametrize(("ratio", "chunks"), [(4, [7, 1, 10]), (128, [200, 60])])
def test_reference_matches_model_compressor(ratio: int, chunks: list[int]) -> None:
    """Independent oracle: dsv4serve.model.compressor.Compressor.update, fed in chunks (its carry and
    the CSA overlap across chunk ends included). Its entries are RMSNorm + RoPE of the pooling; the
    dims RoPE leaves alone must equal the model's norm applied to our pooling of the same windows,
    laid out here from the per-token projections (A halves of window w-1, then B halves of w)."""
    comp, kv, gate, entries, rope_dim = _model_entries(ratio, chunks, seed=ratio)
    d = entries.shape[1]
    n_windows = entries.shape[0]
    score = gate + comp.ape.detach().float()[torch.arange(kv.shape[0]) % ratio]
    kv_w = kv[: n_windows * ratio].view(n_windows, ratio, -1)
    score_w = score[: n_windows * ratio].view(n_windows, ratio, -1)
    if ratio == 4:
        prev_kv = torch.cat((torch.zeros(1, ratio, d), kv_w[:-1, :, :d]))
        prev_score = torch.cat((torch.full((1, ratio, d), float("-inf")), score_w[:-1, :, :d]))
        kv_w = torch.cat((prev_kv, kv_w[..., d:]), dim=1)
        score_w = torch.cat((prev_score, score_w[..., d:]), dim=1)
    pooled_ref = compressor_pool_ref(kv_w.detach(), score_w.detach())
    pooled_kernel = compressor_pool(kv_w.detach().contiguous(), score_w.detach().contiguous())
    with torch.no_grad():
        for pooled in (pooled_ref, pooled_kernel):
            normed = comp.norm(pooled)
            torch.testing.assert_close(normed[:, : d - rope_dim], entries[:, : d - rope_dim], rtol=1e-5, atol=1e-5)
