"""The CPU head (model/cpu_head.py) against MKL's product: the same logits within fp32 rounding at every batch
size the engine runs (one to three rows through the bf16 copy's compiled loops, more through oneDNN's blocked
copy; without the bf16 copy one row on MKL, two and three padded), each path refused when its probe disagrees
or it cannot run, and the model using it only on its own head weight."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dsv4serve.model import cpu_head, head_bf16_cpu
from dsv4serve.model.cpu_head import CpuHead
from dsv4serve.model.numerics import NUMERICS_OFF

VOCAB, DIM = 3_000, 128  # a vocabulary that is no multiple of oneDNN's blocks


def _weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, DIM, generator=g).to(torch.bfloat16).float()  # as a checkpoint's bf16 head


@pytest.mark.skipif(not cpu_head.onednn_available(), reason="this torch build has no oneDNN matmul")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 64])
@pytest.mark.parametrize("bf16", [True, False])
def test_the_head_gives_mkls_logits_at_every_batch_size(rows, bf16):
    """bf16: a checkpoint's head (the bf16 copy for 1-3 rows); else a head with values off bf16's grid (no bf16
    copy: MKL for one row, two and three rows padded for oneDNN)."""
    weight = _weight() if bf16 else _weight() + 1e-3
    head = CpuHead.build(weight)
    assert head is not None and (head._packed is not None) == bf16
    y = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(rows))
    got = head(y)
    assert got.shape == (rows, VOCAB) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(y, weight), rtol=1e-5, atol=1e-5)
    # a row's logits do not depend on its neighbours: within the bf16 copy's sizes, and within oneDNN's (the
    # padding of 2 / 3 rows relies on it)
    small = (1, 3) if bf16 else (2, 4)
    if rows >= small[1]:
        torch.testing.assert_close(head(y[: small[1]])[: small[0]], head(y[: small[0]]), rtol=0, atol=0)


def test_the_bf16_copy_streams_the_heads_bf16_bits_through_the_compiled_loops(monkeypatch):
    """The compiled call itself (not a fallback), on a vocabulary that is no multiple of its blocks: the
    packed copy holds exactly the head's bf16 bits, and its logits are MKL's within fp32 rounding and, bit for
    bit, the sum over dim in order with each product and each sum rounded to fp32."""
    weight = _weight(3)
    packed = head_bf16_cpu.pack(weight)
    assert packed.dtype.name == "uint16" and packed.shape == (
        -(-VOCAB // head_bf16_cpu.BLOCK),
        DIM,
        head_bf16_cpu.BLOCK,
    )
    unblocked = torch.from_numpy(packed.view("int16")).transpose(1, 2).reshape(-1, DIM)
    assert torch.equal(unblocked[:VOCAB].view(torch.bfloat16).float(), weight) and not unblocked[VOCAB:].any()
    for rows in (1, 2, 3):
        y = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(10 + rows))
        got = head_bf16_cpu.logits(y, packed, VOCAB)
        assert got.shape == (rows, VOCAB) and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(y, weight), rtol=1e-5, atol=1e-5)
        in_order = torch.zeros(rows, VOCAB)  # the kernels' arithmetic: over dim in order, product then sum
        for k in range(DIM):
            in_order = in_order + y[:, k : k + 1] * weight[:, k]
        assert torch.equal(got, in_order)
    for bad in (torch.randn(4, DIM), torch.randn(1, DIM + 1), torch.randn(1, DIM, dtype=torch.float64)):
        with pytest.raises(ValueError, match="the bf16 head takes"):
            head_bf16_cpu.logits(bad, packed, VOCAB)


def test_a_product_off_mkls_or_missing_ops_leave_mkl(monkeypatch):
    weight = _weight()
    if cpu_head.onednn_available():
        real = cpu_head._onednn
        monkeypatch.setattr(cpu_head, "_onednn", lambda y, b: real(y, b) * 1.01)  # e.g. a wrong blocked layout
        head = CpuHead.build(weight)
        assert head is not None and head._blocked is None and head._packed is not None
        monkeypatch.undo()
    real_logits = head_bf16_cpu.logits
    monkeypatch.setattr(head_bf16_cpu, "logits", lambda *a: real_logits(*a) * 1.01)
    head = CpuHead.build(weight)
    assert head is None or (head._packed is None and head._blocked is not None)
    monkeypatch.undo()

    def broken(*args):
        raise RuntimeError("numba cannot compile here")

    monkeypatch.setattr(head_bf16_cpu, "logits", broken)
    head = CpuHead.build(weight)
    assert head is None or head._packed is None
    monkeypatch.undo()
    monkeypatch.setattr(cpu_head, "onednn_available", lambda: False)
    head = CpuHead.build(weight)  # the bf16 copy alone: batches of rows on MKL
    assert head is not None and head._blocked is None
    y = torch.randn(6, DIM, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(head(y), F.linear(y, weight), rtol=0, atol=0)
    assert CpuHead.build(weight + 1e-3) is None  # neither copy
    assert CpuHead.build(weight.to(torch.bfloat16)) is None  # only an fp32 head (the torch path's)


def test_the_model_runs_its_head_through_it_and_drops_it_for_a_new_weight():
    from dsv4serve.model.backends import TORCH
    from dsv4serve.model.random_init import random_model
    from dsv4serve.parallel.split_check import split_tiny_args

    model = random_model(split_tiny_args(), "cpu", seed=5, include_mtp=False)
    for p in model.parameters():
        p.data = p.data.float()
    model.use_kernels(TORCH)
    if not cpu_head.onednn_available() and not head_bf16_cpu.exact_in_bf16(model.head.weight):
        assert model._cpu_head is None  # neither copy can serve
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
