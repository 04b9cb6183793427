"""The CPU head (model/cpu_head.py) against MKL's product: the same logits within fp32 rounding at every batch
size the engine runs (a checkpoint's head through its bf16 copy's kernels, from fp32 and bf16 rows; a head off
bf16's grid through oneDNN's blocked copy, one row on MKL, two and three padded), the kernels' arithmetic bit for
bit, each path refused when its probe disagrees or it cannot run, and the model using it only on its own head
weight."""

from __future__ import annotations

import dataclasses
import platform

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dsv4serve.model import cpu_head, head_bf16_cpu
from dsv4serve.model.cpu_head import CpuHead
from dsv4serve.model.head_bf16_ir import BLOCK
from dsv4serve.model.numba_loops import failure
from dsv4serve.model.numerics import NUMERICS_OFF

VOCAB, DIM = 3_000, 128  # a vocabulary that is no multiple of oneDNN's blocks, nor of the bf16 copy's


def _weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, DIM, generator=g).to(torch.bfloat16).float()  # as a checkpoint's bf16 head


def _has_dot() -> bool:
    kernels = head_bf16_cpu.compiled()
    return kernels is not None and kernels.dot is not None


@pytest.mark.skipif(not cpu_head.onednn_available(), reason="this torch build has no oneDNN matmul")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 64])
@pytest.mark.parametrize("case", ["bf16 head, fp32 rows", "bf16 head, bf16 rows", "fp32 head"])
def test_the_head_gives_mkls_logits_at_every_batch_size(rows, case):
    """A checkpoint's head (values on bf16's grid: the bf16 copy for every batch), from the fp32 rows of the torch
    path's tests or the bf16 rows the engine's final norm gives; a head off bf16's grid: no bf16 copy, MKL for one
    row, oneDNN for more (two and three rows padded)."""
    bf16 = case.startswith("bf16")
    weight = _weight() if bf16 else _weight() + 1e-3
    head = CpuHead.build(weight)
    assert head is not None and (head._packed is not None) == bf16 and (head._blocked is None) == bf16
    y = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(rows))
    y = y.to(torch.bfloat16) if case.endswith("bf16 rows") else y
    got = head(y)
    assert got.shape == (rows, VOCAB) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(y.float(), weight), rtol=1e-5, atol=1e-5)
    if bf16:  # every row's logits are its own alone, bit for bit, whatever tile of the batch it falls in
        alone = torch.cat([head(y[i : i + 1]) for i in range(rows)])
        assert torch.equal(got, alone)
    elif rows >= 4:  # oneDNN: a row's logits do not depend on its neighbours (the padding of 2 / 3 rows relies on it)
        torch.testing.assert_close(head(y[:4])[:2], head(y[:2]), rtol=0, atol=0)


def _fma_in_order(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """head_fma's arithmetic: fma(y[k], w[k], acc) over k in order, each rounded once to fp32 (the product of an
    fp32 and a bf16 value is exact in fp64, and so is its sum with an fp32 acc for these values)."""
    acc = torch.zeros(y.shape[0], weight.shape[0])
    yd, wd = y.double(), weight.double()
    for k in range(y.shape[1]):
        acc = (acc.double() + yd[:, k : k + 1] * wd[:, k]).float()
    return acc


def _dot_in_pairs(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """vdpbf16ps' arithmetic (the ISA's): per pair of channels, fma with the odd channel, then with the even one."""
    acc = torch.zeros(y.shape[0], weight.shape[0])
    yd, wd = y.double(), weight.double()
    for k in range(0, y.shape[1], 2):
        acc = (acc.double() + yd[:, k + 1 : k + 2] * wd[:, k + 1]).float()
        acc = (acc.double() + yd[:, k : k + 1] * wd[:, k]).float()
    return acc


def test_the_bf16_copy_holds_the_heads_bits_and_its_kernels_sum_as_documented():
    """The compiled kernels themselves (not a fallback), on a vocabulary that is no multiple of their blocks and
    on row counts across their tiles and rests: the packed copy holds exactly the head's bf16 bits, in pairs of
    channels; fp32 rows give, bit for bit, fused multiply-adds over dim in order; bf16 rows (where the CPU has
    AVX512_BF16) vdpbf16ps' pairs, odd channel first."""
    weight = _weight(3)
    packed = head_bf16_cpu.pack(weight)
    blocks = -(-VOCAB // BLOCK)
    assert packed.dtype == np.uint32 and packed.shape == (blocks, DIM // 2, BLOCK)
    unblocked = torch.from_numpy(packed.view(np.int16)).view(blocks, DIM // 2, BLOCK, 2).permute(0, 2, 1, 3)
    unblocked = unblocked.reshape(blocks * BLOCK, DIM)
    assert torch.equal(unblocked[:VOCAB].view(torch.bfloat16).float(), weight) and not unblocked[VOCAB:].any()
    assert head_bf16_cpu.compiled() is not None, failure(head_bf16_cpu.WHAT)
    for rows in (1, 3, 4, 5, 6, 7, 13):
        y = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(10 + rows))
        got = head_bf16_cpu.logits(y, packed, VOCAB)
        assert got.shape == (rows, VOCAB) and got.is_contiguous()
        assert torch.equal(got, _fma_in_order(y, weight))
        yb = y.to(torch.bfloat16)
        want = _dot_in_pairs(yb, weight) if _has_dot() else _fma_in_order(yb.float(), weight)
        assert torch.equal(head_bf16_cpu.logits(yb, packed, VOCAB), want)
    for bad in (torch.randn(0, DIM), torch.randn(1, DIM + 2), torch.randn(1, DIM, dtype=torch.float64)):
        with pytest.raises(ValueError, match="the bf16 head takes"):
            head_bf16_cpu.logits(bad, packed, VOCAB)
    with pytest.raises(ValueError, match="odd"):
        head_bf16_cpu.pack(torch.zeros(BLOCK, 3))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64-v3 code runs on x86-64 only")
def test_the_kernels_for_a_cpu_without_avx512_sum_the_same_way(monkeypatch):
    """The code a CPU with AVX2 and FMA but no AVX-512 gets (one row a tile, no vdpbf16ps), compiled for x86-64-v3
    and run here: fp32 and bf16 rows alike through fused multiply-adds over dim in order, bit for bit."""
    narrow = head_bf16_cpu._compile(avx2_only=True)
    assert narrow.dot is None
    monkeypatch.setattr(head_bf16_cpu, "compiled", lambda: narrow)
    weight = _weight(4)
    packed = head_bf16_cpu.pack(weight)
    for rows in (1, 3, 8):
        y = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(20 + rows))
        assert torch.equal(head_bf16_cpu.logits(y, packed, VOCAB), _fma_in_order(y, weight))
        yb = y.to(torch.bfloat16)
        assert torch.equal(head_bf16_cpu.logits(yb, packed, VOCAB), _fma_in_order(yb.float(), weight))


def test_a_product_off_mkls_or_missing_ops_leave_mkl(monkeypatch):
    weight = _weight()
    if cpu_head.onednn_available():
        real = cpu_head._onednn
        monkeypatch.setattr(cpu_head, "_onednn", lambda y, b: real(y, b) * 1.01)  # e.g. a wrong blocked layout
        head = CpuHead.build(weight + 1e-3)  # a head off bf16's grid, and oneDNN off MKL's: MKL alone
        assert head is None
        monkeypatch.undo()
    real_logits = head_bf16_cpu.logits
    monkeypatch.setattr(head_bf16_cpu, "logits", lambda *a: real_logits(*a) * 1.01)
    head = CpuHead.build(weight)
    assert head is None or (head._packed is None and head._blocked is not None)
    monkeypatch.undo()

    def broken(*args):
        raise RuntimeError("llvmlite cannot compile here")

    monkeypatch.setattr(head_bf16_cpu, "logits", broken)
    head = CpuHead.build(weight)
    assert head is None or head._packed is None
    monkeypatch.undo()
    monkeypatch.setattr(cpu_head, "onednn_available", lambda: False)
    head = CpuHead.build(weight)  # the bf16 copy needs no oneDNN
    assert head is not None and head._blocked is None and head._packed is not None
    y = torch.randn(6, DIM, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(head(y), F.linear(y, weight), rtol=1e-5, atol=1e-5)
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
            # batch invariance: the bf16 copy serves too (a row's logits are its own alone); MKL a row at a time
            # for a head without one
            invariant = model._cpu_head.batch_invariant
            per_row = model.logits(*args, NUMERICS_OFF)
            assert calls == ([8, 8] if invariant else [8])
            torch.testing.assert_close(fast, per_row, rtol=1e-5, atol=1e-5)
            if invariant:
                alone = torch.cat([model.logits(h[i : i + 1], *args[1:], NUMERICS_OFF) for i in range(8)])
                assert torch.equal(alone, per_row)
            calls.clear()
            model.head.weight = torch.nn.Parameter(model.head.weight.clone(), requires_grad=False)
            model.logits(*args, num)  # a replaced head weight: not the copy's source, MKL again
            assert calls == []
    finally:
        CpuHead.__call__ = real  # type: ignore[method-assign]
