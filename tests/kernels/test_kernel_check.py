"""The start-up kernel check (dsv4serve/worker/kernel_check.py) on the CPU, kernels in the interpreter:
a sound kernel passes, a broken one falls back to torch when it may and stops the start when it may not,
and an error carries its fix."""

from __future__ import annotations

import logging

import pytest
import torch

import dsv4_kernels.fp8_gemm
import dsv4_kernels.head_logits
from dsv4serve.model.backends import KernelBackends, kernel_names, named_kernels
from dsv4serve.worker.kernel_check import KernelCheckError, check_kernels, run_check

pytestmark = pytest.mark.slow  # the interpreter runs whole models: `pytest -m "not slow"` skips it

CPU = torch.device("cpu")
HEAD = KernelBackends(head="triton")


def test_named_kernels():
    assert named_kernels("auto") == frozenset()
    assert named_kernels("all=triton,fp4_moe=torch") == frozenset(kernel_names())
    assert named_kernels(" attention=triton , head=torch") == {"attention", "head"}


def test_every_kernel_passes_and_keeps_its_backend():
    """Measured in the interpreter (batch invariance off, as served): each kernel, alone or with its partners
    (hc with token_ops and fp4_moe, attention with token_ops: kernel_check.PARTNERS), agrees on 44/45 (attention)
    to 45/45 greedy tokens, mean gap <= 0.013 (bounds 0.5 and 0.25: kernel_check.py)."""
    verdicts = run_check(list(kernel_names()), CPU)
    assert [v.kernel for v in verdicts] == list(kernel_names()) and all(v.ok for v in verdicts), verdicts
    assert all("greedy" in v.detail for v in verdicts)
    assert check_kernels(KernelBackends(compressor="triton"), CPU, frozenset()) == KernelBackends(compressor="triton")
    assert check_kernels(KernelBackends(), CPU, frozenset()) == KernelBackends()  # nothing on Triton: no check


def _garbage_head(y, w, block_m=None, out=None):
    return torch.randn(y.shape[0], w.shape[0], device=y.device)


def test_a_broken_auto_kernel_falls_back_to_torch(monkeypatch, caplog):
    monkeypatch.setattr(dsv4_kernels.head_logits, "head_logits", _garbage_head)
    with caplog.at_level(logging.WARNING, logger="dsv4serve.worker.kernel_check"):
        assert check_kernels(HEAD, CPU, frozenset()) == KernelBackends()
    assert "kernel head failed the start-up check" in caplog.text and "running it on torch" in caplog.text


def test_a_broken_named_kernel_stops_the_start(monkeypatch):
    monkeypatch.setattr(dsv4_kernels.head_logits, "head_logits", _garbage_head)
    with pytest.raises(KernelCheckError, match=r"head: greedy \d+/\d+ as torch.*\(named in --kernels\)"):
        check_kernels(HEAD, CPU, frozenset({"head"}))


def test_a_toolchain_error_names_its_fix_and_fp8_never_falls_back(monkeypatch):
    def no_libcuda(*args, **kwargs):
        raise AssertionError("libcuda.so cannot found!\nPlease make sure GPU is set up")

    monkeypatch.setattr(dsv4_kernels.fp8_gemm, "fp8_linear", no_libcuda)
    with pytest.raises(KernelCheckError) as err:
        check_kernels(KernelBackends(fp8_gemm="triton"), CPU, frozenset())
    text = str(err.value)
    assert "fp8_gemm: AssertionError: libcuda.so cannot found!" in text
    assert "TRITON_LIBCUDA_PATH=/usr/lib/wsl/lib" in text and "needs the weights loaded dense" in text


def test_the_worker_stops_with_the_flag_named(monkeypatch):
    import dataclasses

    from dsv4serve.model.numerics import NUMERICS_ON
    from dsv4serve.worker.model_load import StartupError, checked_numerics

    monkeypatch.setattr(dsv4_kernels.head_logits, "head_logits", _garbage_head)
    with pytest.raises(StartupError, match="--kernels head=triton: the Triton kernel check failed"):
        checked_numerics(dataclasses.replace(NUMERICS_ON, backends=HEAD), "head=triton", CPU)
    auto = checked_numerics(dataclasses.replace(NUMERICS_ON, backends=HEAD), "auto", CPU)
    assert auto.backends == KernelBackends() and auto.fp8_act  # the rest of the numerics kept


def test_a_device_fault_stops_the_check_at_that_kernel(monkeypatch):
    """A sticky CUDA error poisons the context: no later kernel (nor torch) could run, so no fallback."""

    def fault(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(dsv4_kernels.head_logits, "head_logits", fault)  # the compressor's projection runs it too
    with pytest.raises(KernelCheckError, match="compressor: RuntimeError: CUDA error.*device fault"):
        check_kernels(KernelBackends(compressor="triton", head="triton"), CPU, frozenset())


def test_a_kernel_is_checked_with_the_partners_it_fuses_with(monkeypatch, caplog):
    """hc with fp4_moe on Triton sums the MoE output in its post launch (dsv4_kernels.hc_post_combine), a form
    neither runs alone: a broken one fails hc's check only when fp4_moe is on Triton too, and hc falls back."""
    import dsv4_kernels.hc_post_combine as combine

    def garbage(pairs, addends, out_dtype, h, post, comb, new_out=None):
        return torch.randn(h.shape, device=h.device).to(h.dtype)

    monkeypatch.setattr(combine, "hc_post_combine", garbage)
    both = KernelBackends(hc="triton", fp4_moe="triton")
    with caplog.at_level(logging.WARNING, logger="dsv4serve.worker.kernel_check"):
        assert check_kernels(both, CPU, frozenset()) == KernelBackends(fp4_moe="triton")
    assert "kernel hc failed the start-up check" in caplog.text
    assert [v.ok for v in run_check(["hc"], CPU)] == [True]  # alone, hc never launches the combined form
