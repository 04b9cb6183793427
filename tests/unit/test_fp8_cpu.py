"""The FP8 activation simulation compiled for the CPU (model/fp8_cpu.py, numba_math.fp8_quant_dequant_row) against
its torch ops (numerics.fp8_quant_dequant_torch): the same bits on edges, ties, subnormal codes, NaN and inf, every
shape and dtype the model passes; numerics.fp8_quant_dequant takes it on the CPU and leaves its input alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4serve.model import fp8_cpu
from dsv4serve.model.numerics import ACT_BLOCK, KV_BLOCK, fp8_quant_dequant, fp8_quant_dequant_torch


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    if fp8_cpu.compiled() is None:  # numba is a dependency: this is a broken install, not a skip
        pytest.fail("numba did not compile the FP8 simulation")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, any NaN matching any NaN."""
    a, b = a.float(), b.float()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def _edge_rows(length: int) -> np.ndarray:
    rng = np.random.default_rng(length)
    rows = [rng.standard_normal(length).astype(np.float32) * s for s in (1e-6, 1e-3, 1.0, 300.0, 1e30)]
    tiny = np.zeros(length, np.float32)
    tiny[:8] = [2**-9, 3 * 2**-10, 2**-6, 2**-7 + 2**-10, -(2**-8), 5e-5, -0.0, 0.0]  # subnormal steps, ties
    ties = np.full(length, 1.0, np.float32)
    ties[1:15] = [
        1.0625,
        1.1875,
        -1.0625,
        448.0,
        1.125,
        17.0,
        19.0,
        0.0,
        -0.0,
        2**-12,
        240.0,
        3 * 2**-10,
        5 * 2**-10,
        -3e-3,
    ]
    zeros = np.zeros(length, np.float32)  # the amax floor
    odd = rng.standard_normal(length).astype(np.float32)
    odd[[0, 3, 5]] = [np.nan, np.inf, -np.inf]  # a NaN block, an inf block
    odd[-1] = np.nan
    return np.stack([*rows, tiny, ties, zeros, odd])


@pytest.mark.parametrize("block", [ACT_BLOCK, KV_BLOCK])
@pytest.mark.parametrize("length", [128, 256, 160, 448])  # 160, 448: a partial last block of its own
def test_the_compiled_rows_are_the_torch_ops_to_the_bit(block, length):
    x = torch.from_numpy(_edge_rows(length))
    want = fp8_quant_dequant_torch(x, block)
    got = x.clone()
    loop = fp8_cpu.compiled()
    assert loop is not None
    loop(got.numpy(), block, np.float32(1e-4), np.float32(448.0))
    assert _same(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_numerics_takes_the_compiled_path_on_the_cpu_for_every_shape_the_model_passes(dtype, monkeypatch):
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(3, 5, 512, generator=g) * 3).to(dtype)
    cases = [
        (torch.randn(1, 128, generator=g).to(dtype), ACT_BLOCK),  # a decode row's projection input
        (torch.randn(16, 4096, generator=g).to(dtype), ACT_BLOCK),  # V4-Flash's width
        (full, ACT_BLOCK),
        (full[:, :, :448], KV_BLOCK),  # the KV's nope dims: a strided slice
        (torch.randn(2, 96, generator=g).to(dtype), ACT_BLOCK),  # a partial block
    ]
    calls = []
    real = fp8_cpu.fp8_quant_dequant_cpu
    monkeypatch.setattr(
        "dsv4serve.model.numerics.fp8_quant_dequant_cpu", lambda *a: calls.append((y := real(*a)) is not None) or y
    )
    for x, block in cases:
        before = x.clone()
        got = fp8_quant_dequant(x, block)
        assert got.dtype == x.dtype and got.shape == x.shape
        assert _same(got, fp8_quant_dequant_torch(x, block))
        assert torch.equal(x, before)  # the input is not rounded in place
    assert calls == [True] * len(cases)


def test_where_numba_cannot_compile_the_torch_ops_serve(monkeypatch):
    monkeypatch.setattr(fp8_cpu, "compiled", lambda: None)
    x = torch.randn(4, 128)
    assert fp8_cpu.fp8_quant_dequant_cpu(x, ACT_BLOCK, 1e-4, 448.0) is None
    assert torch.equal(fp8_quant_dequant(x, ACT_BLOCK), fp8_quant_dequant_torch(x, ACT_BLOCK))
