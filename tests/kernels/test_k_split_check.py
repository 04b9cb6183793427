"""The start-up check of the K splits and tuned loop forms (dsv4serve/worker/k_split_check.py), in the
interpreter: every form gives its kernel's unsplit bits on the check's exact inputs; a form that does not is
caught and named; a failed check switches the splits and tuned forms off (the wrappers then pick the unsplit
built-in forms) and the start goes on."""

from __future__ import annotations

import torch

from dsv4serve.worker import k_split_check


def test_every_split_and_loop_form_gives_the_unsplit_bits() -> None:
    verdicts = k_split_check.check_k_splits(torch.device("cpu"))
    names = [v.kernel for v in verdicts]
    assert {"fp8_gemm split 4", "fp8_swiglu split 4", "head_logits split 4", "fp4_moe late_scale+split2"} <= set(names)
    assert all(v.ok for v in verdicts), [v for v in verdicts if not v.ok]


def test_a_split_that_changes_the_result_is_caught(monkeypatch) -> None:
    import dsv4_kernels.fp8_gemm as fp8_gemm

    real = fp8_gemm.fp8_linear

    def off_by_one_ulp(x, b, b_scale, *args, split_k=None, **kwargs):
        out = real(x, b, b_scale, *args, split_k=split_k, **kwargs)
        return out * (1 + 2.0**-7) if split_k and split_k > 1 else out

    monkeypatch.setattr(fp8_gemm, "fp8_linear", off_by_one_ulp)
    verdicts = k_split_check.check_k_splits(torch.device("cpu"), ("fp8_gemm", "head_logits"))
    assert [(v.kernel, v.ok) for v in verdicts] == [("fp8_gemm split 4", False), ("head_logits split 4", True)]


def test_a_failed_check_turns_the_splits_off_and_the_start_goes_on(monkeypatch, caplog) -> None:
    from dsv4_kernels import split_k
    from dsv4_kernels.fp4_moe_choices import tuned_choice
    from dsv4_kernels.fp8_gemm import pick_split_k as fp8_split
    from dsv4_kernels.fp8_swiglu import pick_split_k as swiglu_split

    bad = [k_split_check.Verdict("fp8_swiglu split 4", False, "differs from the unsplit launch on exact sums")]
    monkeypatch.setattr(k_split_check, "check_k_splits", lambda device: bad)
    monkeypatch.setattr(split_k, "_ALLOWED", [True])  # restored after the test
    monkeypatch.setattr("dsv4_kernels.tuning.lookup", lambda *a, **k: 4)  # a card whose tuning says split 4
    assert fp8_split(1, 512, 512, torch.device("cpu")) == 4
    assert k_split_check.check_and_apply(torch.device("cpu")) is False
    assert not split_k.k_splits_allowed()
    assert fp8_split(1, 512, 512, torch.device("cpu")) == 1 and swiglu_split(1, 512, 512, torch.device("cpu")) == 1
    assert tuned_choice("gate_up", 6, 16, torch.device("cpu")) == {}
    assert "fp8_swiglu split 4: FAILED" in caplog.text and "off for this worker" in caplog.text
