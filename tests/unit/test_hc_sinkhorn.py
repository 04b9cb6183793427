"""mHC's Sinkhorn rounds: the numpy path the CPU takes for small batches against the torch rounds (the
reference), bit for bit: the same fp32 sums, divisions and additions in the same order."""

from __future__ import annotations

import pytest
import torch

from dsv4serve.model.hc import NUMPY_ROWS_MAX, sinkhorn, sinkhorn_rounds
from dsv4serve.model.numerics import in_fp64


def _torch_reference(logits: torch.Tensor, n_iters: int, eps: float) -> torch.Tensor:
    comb = in_fp64(lambda z: torch.softmax(z, dim=-1), logits).add_(eps)
    sinkhorn_rounds(comb, n_iters, eps)
    return comb


@pytest.mark.parametrize("rows", [1, 2, 7, 16, NUMPY_ROWS_MAX])
@pytest.mark.parametrize("n_iters", [1, 2, 20])
def test_numpy_rounds_equal_the_torch_rounds_bitwise(rows: int, n_iters: int) -> None:
    gen = torch.Generator().manual_seed(rows * 100 + n_iters)
    for spread in (0.1, 3.0, 30.0):  # near-uniform to near-one-hot mixing matrices
        logits = torch.randn(rows, 4, 4, generator=gen) * spread
        for eps in (1e-6, 1e-2):
            got = sinkhorn(logits, n_iters, eps)
            want = _torch_reference(logits, n_iters, eps)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (spread, eps)


def test_sinkhorn_under_inference_mode_and_beyond_the_numpy_rows() -> None:
    logits = torch.randn(NUMPY_ROWS_MAX + 1, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        small = sinkhorn(logits[:3], 20, 1e-6)
        large = sinkhorn(logits, 20, 1e-6)  # torch's rounds
    assert torch.equal(small, large[:3])  # row-independent: the two paths agree row by row
    assert torch.allclose(large.sum(dim=-2), torch.ones(NUMPY_ROWS_MAX + 1, 4), atol=1e-4)  # doubly stochastic
