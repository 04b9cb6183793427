"""The CPU head's oneDNN path (model/cpu_head.py) against MKL's product: the same logits within fp32
rounding at every batch size the engine runs (one row stays on MKL, two and three are padded), a refusal
when the probe disagrees or the ops are missing, and the model using it only on its own head weight."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dsv4serve.model import cpu_head
from dsv4serve.model.cpu_head import CpuHead
from dsv4serve.model.numerics import NUMERICS_OFF

VOCAB, DIM = 3_000, 128  # a vocabulary that is no multiple of oneDNN's blocks


def _weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, DIM, generator=g).to(torch.bfloat16).float()  # as a checkpoint's bf16 head


@pytest.mark.skipif(not cpu_head.onednn_available(), reason="this torch build has no oneDNN matmul")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 64])
def test_the_head_gives_mkls_logits_at_every_batch_size(rows):
    weight = _weight()
    head = CpuHead.build(weight)
    assert head is not None
    y = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(rows))
    got = head(y)
    assert got.shape == (rows, VOCAB) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(y, weight), rtol=1e-5, atol=1e-5)
    if rows >= 4:  # a row's logits do not depend on its neighbours (the padding of 2 / 3 rows relies on it)
        torch.testing.assert_close(head(y[:4])[:2], head(y[:2]), rtol=0, atol=0)


@pytest.mark.skipif(not cpu_head.onednn_available(), reason="this torch build has no oneDNN matmul")
def test_a_product_off_mkls_or_missing_ops_leave_mkl_for_every_batch(monkeypatch):
    weight = _weight()
    real = CpuHead._onednn
    monkeypatch.setattr(CpuHead, "_onednn", lambda self, y: real(self, y) * 1.01)  # e.g. a wrong blocked layout
    assert CpuHead.build(weight) is None
    monkeypatch.undo()
    monkeypatch.setattr(cpu_head, "onednn_available", lambda: False)
    assert CpuHead.build(weight) is None
    assert CpuHead.build(weight.to(torch.bfloat16)) is None  # only an fp32 head (the torch path's)


def test_the_model_runs_its_head_through_it_and_drops_it_for_a_new_weight():
    from dsv4serve.model.backends import TORCH
    from dsv4serve.model.random_init import random_model
    from dsv4serve.parallel.split_check import split_tiny_args

    model = random_model(split_tiny_args(), "cpu", seed=5, include_mtp=False)
    for p in model.parameters():
        p.data = p.data.float()
    model.use_kernels(TORCH)
    if not cpu_head.onednn_available():
        assert model._cpu_head is None
        return
    assert model._cpu_head is not None and model._cpu_head.source is model.head.weight
    calls = []
    real = CpuHead.__call__
    CpuHead.__call__ = lambda self, y: calls.append(y.shape[0]) or real(self, y)  # type: ignore[method-assign]
    try:
        num = dataclasses.replace(NUMERICS_OFF, batch_invariant=False)
        h = torch.randn(8, model.args.hc_mult, model.args.dim)
        args = (h, model.hc_head_fn, model.hc_head_scale, model.hc_head_base, model.norm)
        with torch.inference_mode():
            fast = model.logits(*args, num)
            assert calls == [8]
            per_row = model.logits(*args, NUMERICS_OFF)  # batch invariance: MKL, one row at a time
            assert calls == [8]
            torch.testing.assert_close(fast, per_row, rtol=1e-5, atol=1e-5)
            model.head.weight = torch.nn.Parameter(model.head.weight.clone(), requires_grad=False)
            model.logits(*args, num)  # a replaced head weight: not the copy's source, MKL again
            assert calls == [8]
    finally:
        CpuHead.__call__ = real  # type: ignore[method-assign]
