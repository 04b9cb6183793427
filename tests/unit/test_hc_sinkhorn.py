"""mHC's Sinkhorn rounds: the compiled path the CPU takes (model/sinkhorn_cpu.py, numba) against the torch
rounds (the reference), bit for bit: the same fp32 sums, divisions and additions in the same order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4serve.model import sinkhorn_cpu
from dsv4serve.model.hc import sinkhorn, sinkhorn_rounds
from dsv4serve.model.numerics import in_fp64


def _torch_reference(logits: torch.Tensor, n_iters: int, eps: float) -> torch.Tensor:
    comb = in_fp64(lambda z: torch.softmax(z, dim=-1), logits).add_(eps)
    sinkhorn_rounds(comb, n_iters, eps)
    return comb


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 33, 64])
@pytest.mark.parametrize("n_iters", [0, 1, 2, 20])
def test_compiled_rounds_equal_the_torch_rounds_bitwise(rows: int, n_iters: int) -> None:
    gen = torch.Generator().manual_seed(rows * 100 + n_iters)
    for spread in (0.1, 3.0, 30.0):  # near-uniform to near-one-hot mixing matrices
        logits = torch.randn(rows, 4, 4, generator=gen) * spread
        for eps in (1e-6, 1e-2):
            want = _torch_reference(logits, n_iters, eps)
            direct = in_fp64(lambda z: torch.softmax(z, dim=-1), logits).add_(eps)
            assert sinkhorn_cpu.sinkhorn_rounds_cpu(direct.numpy(), n_iters, eps)  # the compiled call ran
            for got in (sinkhorn(logits, n_iters, eps), direct):
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (spread, eps)


def test_the_compiled_rounds_run_and_change_the_matrix() -> None:
    """The compiled call itself (not a fallback): in place on the array, each column then summing to ~1."""
    comb = np.random.default_rng(0).random((3, 4, 4), dtype=np.float32) + 0.1
    before = comb.copy()
    assert sinkhorn_cpu.compiled() is not None and sinkhorn_cpu.sinkhorn_rounds_cpu(comb, 20, 1e-6)
    assert not np.array_equal(comb, before)
    np.testing.assert_allclose(comb.sum(axis=-2), 1.0, atol=1e-4)
    np.testing.assert_allclose(comb.sum(axis=-1), 1.0, atol=1e-4)
    ref = torch.from_numpy(before)
    sinkhorn_rounds(ref, 20, 1e-6)
    assert np.array_equal(comb, ref.numpy())


@pytest.mark.parametrize(
    "bad", [np.zeros((2, 4, 4), np.float64), np.zeros((2, 3, 3), np.float32), np.zeros((2, 4, 8), np.float32)[..., ::2]]
)
def test_the_compiled_rounds_refuse_other_arrays(bad: np.ndarray) -> None:
    assert not sinkhorn_cpu.supports(bad)
    with pytest.raises(ValueError, match="contiguous float32"):
        sinkhorn_cpu.sinkhorn_rounds_cpu(bad, 20, 1e-6)


def test_sinkhorn_keeps_torch_for_what_the_compiled_rounds_do_not_take() -> None:
    """fp64 logits and hc = 2 go through torch's rounds; under inference mode the CPU path is the compiled one,
    row independent."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 4, 4, generator=gen)
    with torch.inference_mode():
        small = sinkhorn(logits[:3], 20, 1e-6)
        large = sinkhorn(logits, 20, 1e-6)
    assert torch.equal(small, large[:3])
    assert torch.allclose(large.sum(dim=-2), torch.ones(40, 4), atol=1e-4)  # doubly stochastic
    wide = torch.randn(5, 4, 4, generator=gen, dtype=torch.float64)
    assert torch.equal(sinkhorn(wide, 20, 1e-6), _torch_reference(wide, 20, 1e-6))
    two = torch.randn(5, 2, 2, generator=gen)
    assert torch.equal(sinkhorn(two, 20, 1e-6), _torch_reference(two, 20, 1e-6))


def test_without_numba_the_torch_rounds_run(monkeypatch, caplog) -> None:
    """numba failing to compile (here: its import) leaves the torch rounds, the same values, logged once."""
    import builtins

    real_import = builtins.__import__

    def no_numba(name, *args, **kwargs):
        if name == "numba":
            raise ImportError("no numba here")
        return real_import(name, *args, **kwargs)

    sinkhorn_cpu.compiled.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_numba)
    try:
        assert sinkhorn_cpu.compiled() is None
        assert "torch's rounds run" in caplog.text
        comb = np.full((2, 4, 4), 0.3, np.float32)
        assert not sinkhorn_cpu.sinkhorn_rounds_cpu(comb, 20, 1e-6) and (comb == np.float32(0.3)).all()
        logits = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(1))
        assert torch.equal(sinkhorn(logits, 20, 1e-6), _torch_reference(logits, 20, 1e-6))
    finally:
        monkeypatch.undo()
        sinkhorn_cpu.compiled.cache_clear()
    assert sinkhorn_cpu.compiled() is not None
