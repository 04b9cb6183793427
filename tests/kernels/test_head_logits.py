"""The output head (dsv4_kernels.head_logits) in the interpreter against its torch reference.

Tolerance, and why: the kernel's products are exact (y is split into three bf16 parts that sum to y
exactly, each times a bf16 weight is exact in fp32), so it differs from the exact sum only by fp32
summation order: at most gamma_K * sum_k |y_k w_k| with gamma_K ~ K * 2^-24, doubled for margin. The
same bound holds for the reference (an fp32 GEMM). The exact sum is taken in fp64. A head that rounded
y to bf16 (one dot instead of three) is off by up to 2^-9 of that sum and fails for K >= 64; the test
checks that this margin is real. Each run writes into a NaN-poisoned view of a larger buffer.
"""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.head_logits import Tail, head_logits, pick_block_m
from dsv4_kernels.head_logits_ref import head_logits_ref
from dsv4_kernels.testing import into_poisoned


def _operands(m: int, v: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(m, k, generator=gen) * torch.logspace(-3, 1, k)  # magnitudes over four decades
    w = (torch.randn(v, k, generator=gen) * 0.02).to(torch.bfloat16)
    return y, w


def _bound(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    k = y.shape[1]
    return 2 * k * 2.0**-24 * (y.double().abs() @ w.double().abs().t()) + 1e-30


def _run_poisoned(y: torch.Tensor, w: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    return into_poisoned((y.shape[0], w.shape[0]), torch.float32, lambda out: head_logits(y, w, block_m, out))


# (M, V, K): decode m=1 with a ragged vocabulary and K (200 = 3 blocks + 8), a decode batch over one
# 16-row tile (17 -> 32-row tiles), exact blocks, and a 64-row tile with a partial last tile (70)
SHAPES = [(1, 300, 200), (5, 128, 128), (17, 130, 256), (70, 257, 192)]


@pytest.mark.parametrize(("m", "v", "k"), SHAPES)
def test_head_logits_matches_the_exact_sum(m: int, v: int, k: int) -> None:
    y, w = _operands(m, v, k, seed=m * 7 + v)
    out = _run_poisoned(y, w)
    exact = y.double() @ w.double().t()
    bound = _bound(y, w)
    assert out.dtype == torch.float32 and out.shape == (m, v) and not torch.isnan(out).any()
    assert ((out.double() - exact).abs() <= bound).all(), float(((out.double() - exact).abs() / bound).max())
    ref = head_logits_ref(y, w)
    assert ((ref.double() - exact).abs() <= bound).all()  # the reference meets the same bound


def test_the_split_loses_no_bit() -> None:
    """Weights with one power of two per row pick single values of y: a one-term sum is exact, so the
    logits must equal y's values times that power bit for bit (a split dropping mid or lo would not)."""
    gen = torch.Generator().manual_seed(2)
    m, v, k = 3, 70, 130
    y = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, k)
    cols = torch.randint(0, k, (v,), generator=gen)
    powers = 2.0 ** torch.randint(-4, 5, (v,), generator=gen).float()
    w = torch.zeros(v, k)
    w[torch.arange(v), cols] = powers
    out = _run_poisoned(y, w.to(torch.bfloat16))
    assert torch.equal(out, y[:, cols] * powers)


def test_the_bound_would_catch_a_bf16_rounded_activation() -> None:
    y, w = _operands(3, 64, 256, seed=1)
    exact = y.double() @ w.double().t()
    rounded = y.to(torch.bfloat16).double() @ w.double().t()
    assert ((rounded - exact).abs() > _bound(y, w)).any()


def test_tile_shape_and_batch_invariance() -> None:
    """A row's logits do not depend on the tile height or on the other rows (batch-invariant numerics
    pass block_m=16 whatever M is)."""
    y, w = _operands(40, 96, 128, seed=3)
    assert pick_block_m(40) == 32 and pick_block_m(40, batch_invariant=True) == 16
    whole = _run_poisoned(y, w, block_m=16)
    alone = torch.cat([_run_poisoned(y[i : i + 1], w, block_m=16) for i in (0, 17, 39)])
    assert torch.equal(whole[[0, 17, 39]], alone)


def test_a_bf16_input_is_its_fp32_upcast() -> None:
    """The model passes bf16 y as its norms leave it (no cast launch first): the kernel upcasts it exactly, so the
    logits are those of the fp32 copy bit for bit."""
    y, w = _operands(3, 200, 192, seed=6)
    y16 = y.to(torch.bfloat16)
    assert torch.equal(_run_poisoned(y16, w), _run_poisoned(y16.float(), w))


def test_bad_operands_are_refused() -> None:
    y, w = _operands(2, 16, 64, seed=4)
    with pytest.raises(ValueError, match="bf16 w"):
        head_logits(y, w.float())
    with pytest.raises(ValueError, match="fp32 / bf16 y"):
        head_logits(y.to(torch.float16), w)
    with pytest.raises(ValueError, match="out must be"):
        head_logits(y, w, out=torch.empty(2, 15))
    assert head_logits(y[:0], w).shape == (0, 16)


@pytest.mark.parametrize("split", [2, 4])
def test_split_k_meets_the_same_bound_and_leaves_its_counters_at_zero(split: int) -> None:
    """K split over programs in one launch (the compressors' narrow projection takes it): the same exact
    products, the parts added in split order, so the same bound; the arrival counters end at 0."""
    from dsv4_kernels.split_k import split_counters

    y, w = _operands(3, 300, 256, seed=split)
    out = into_poisoned((3, 300), torch.float32, lambda out: head_logits(y, w, None, out, split_k=split))
    assert not torch.isnan(out).any()
    assert ((out.double() - y.double() @ w.double().t()).abs() <= _bound(y, w)).all()
    assert int(split_counters(1, y.device).abs().sum()) == 0


@pytest.mark.parametrize(("split", "round_bf16"), [(1, True), (2, True), (1, False)])
def test_a_tail_leaves_rounded_and_scaled_and_the_rows_above_it_as_summed(split: int, round_bf16: bool) -> None:
    """Rows stacked under the first projection (the indexer's head weights under its compressor's) leave as that
    projection's Linear leaves them: rounded to bf16 (to nearest even, as torch's cast: the interpreter's own
    cast truncates) when asked, then times the scale in fp32; the rows above are untouched. Integer operands
    make every sum exact, so both sides are bit for bit, split or not; the sums are odd integers, many of them
    past bf16's 8 significant bits, so a truncating or missing rounding shows."""
    gen = torch.Generator().manual_seed(5)
    m, v, k, start, scale = 3, 200, 128, 136, 0.3535
    y = torch.randint(-64, 65, (m, k), generator=gen).float()
    w = torch.randint(-64, 65, (v, k), generator=gen).to(torch.bfloat16)
    exact = y @ w.float().t()  # integers below 2^24: exact in fp32
    assert (exact[:, start:].abs() > 256).any() and (exact.remainder(2) == 1).any()
    tail = Tail(start, scale, round_bf16)
    got = into_poisoned((m, v), torch.float32, lambda out: head_logits(y, w, None, out, split_k=split, tail=tail))
    finished = exact[:, start:].to(torch.bfloat16).float() if round_bf16 else exact[:, start:]
    assert torch.equal(got[:, :start], exact[:, :start])
    assert torch.equal(got[:, start:], finished * scale)
    with pytest.raises(ValueError, match="tail"):
        head_logits(y, w, tail=Tail(v + 1, scale, round_bf16))


def test_split_k_must_divide_k_in_blocks() -> None:
    y, w = _operands(1, 64, 200, seed=1)
    with pytest.raises(ValueError, match="split_k 2"):
        head_logits(y, w, split_k=2)


def test_pick_split_k_fills_the_gpu_for_narrow_products_only() -> None:
    from dsv4_kernels.head_logits import pick_split_k

    assert pick_split_k(1010, 4096) == 1  # the real head: 1,010 vocabulary tiles
    assert pick_split_k(16, 4096) == 8 and pick_split_k(4, 4096) == 8  # the compressors: 2,048 / 512 rows
    assert pick_split_k(16, 192) == 1  # 3 K blocks: no even split
