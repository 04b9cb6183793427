"""mHC's gates and stream mix compiled for the CPU (model/hc_cpu.py) against hc_pre's and hc_head's torch ops: the
same x, post and comb bits over 2^16 rows of logits from near zero to saturation, bf16 and fp32 streams; the model's
sites take it on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4serve.model import hc_cpu
from dsv4serve.model.hc import hc_head, hc_pre
from dsv4serve.model.numerics import NUMERICS_OFF, NUMERICS_ON

HC, DIM = 4, 8  # DeepSeek-V4's hc_mult; a narrow stream keeps 2^16 rows cheap
ROWS = 2**16


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    if hc_cpu.compiled() is None:  # numba is a dependency: this is a broken install, not a skip
        pytest.fail("numba did not compile the mHC gates")


def _inputs(n_mix: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(ROWS, HC, DIM, generator=g) * 2).to(dtype)
    # fn spread by row blocks: gate logits from ~0 to ~+-60 (saturated sigmoids, one-hot softmax rows)
    fn = torch.randn(n_mix, HC * DIM, generator=g) * 0.5
    h = h * torch.logspace(-3, 1.5, ROWS).view(ROWS, 1, 1).to(dtype)  # the RMS in _mixes keeps m's scale, but not h's
    scale = torch.rand(3, generator=g) * 8
    base = torch.randn(n_mix, generator=g)
    return h, fn, scale, base


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num", [NUMERICS_ON, dataclasses.replace(NUMERICS_OFF, batch_invariant=False)])
def test_hc_pre_compiled_is_its_torch_ops_to_the_bit(dtype, num, monkeypatch):
    h, fn, scale, base = _inputs((2 + HC) * HC, dtype)
    served = []
    real = hc_cpu.gates_and_mix
    monkeypatch.setattr(hc_cpu, "gates_and_mix", lambda *a: served.append((y := real(*a)) is not None) or y)
    with torch.inference_mode():
        got = hc_pre(h, fn, scale, base, 20, 1e-6, 1e-6, num)
        monkeypatch.setattr(hc_cpu, "compiled", lambda: None)
        want = hc_pre(h, fn, scale, base, 20, 1e-6, 1e-6, num)
    assert served == [True, False]
    assert all(_same(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hc_head_compiled_is_its_torch_ops_to_the_bit(dtype, monkeypatch):
    h, fn, scale, base = _inputs(HC, dtype, seed=1)
    with torch.inference_mode():
        got = hc_head(h, fn, scale[:1], base, 1e-6, 1e-6, NUMERICS_ON)
        monkeypatch.setattr(hc_cpu, "compiled", lambda: None)
        want = hc_head(h, fn, scale[:1], base, 1e-6, 1e-6, NUMERICS_ON)
    assert _same(got, want)


def test_shapes_it_does_not_take_go_to_the_torch_ops():
    m = torch.zeros(2, 3 * 3)
    h = torch.zeros(2, 3, 8)  # hc = 3: not DeepSeek-V4's
    assert hc_cpu.gates_and_mix(m, torch.ones(3), torch.zeros(9), h, 1e-6, 20) is None
    assert (
        hc_cpu.gates_and_mix(torch.zeros(2, 5).double(), torch.ones(3), torch.zeros(5), torch.zeros(2, 4, 8), 0, 0)
        is None
    )
