"""`dsv4serve doctor`'s kt-kernel line (doctor_backends.py): optional, so never a failure; not installed says
how to install it, an install that does not load is a warning with the fix, a loaded one names its build."""

from __future__ import annotations

import pytest

from dsv4serve import doctor_backends
from dsv4serve.experts import kt_backend


def test_not_installed_is_ok_and_says_how_to_install(monkeypatch):
    monkeypatch.setattr(doctor_backends, "kt_kernel_available", lambda: (False, "kt-kernel is not installed (pip x)"))
    check = doctor_backends.check_kt_kernel()
    assert check.status == "ok" and "hybrid unavailable" in check.value and "pip x" in check.value
    assert check.data["installed"] is False and check.data["threads"] >= 1


def test_an_install_that_does_not_load_is_a_warning_with_the_fix(monkeypatch):
    monkeypatch.setattr(doctor_backends, "kt_kernel_available", lambda: (True, "kt-kernel installed"))
    monkeypatch.setattr(doctor_backends, "kt_version", lambda: "0.7.2")

    def broken():
        raise ModuleNotFoundError("No module named 'gguf'")

    monkeypatch.setattr(kt_backend, "load_kt", broken)
    check = doctor_backends.check_kt_kernel()
    assert check.status == "warn" and "gguf" in check.value and "pip install --no-deps kt-kernel==0.7.2" in check.fix


def test_a_loaded_install_names_its_build_and_threads(monkeypatch):
    installed, why = kt_backend.kt_kernel_available()  # no import: it would leave flush-to-zero on (load_kt)
    if not installed:
        pytest.skip(why)
    check = doctor_backends.check_kt_kernel()
    assert check.status in ("ok", "warn") and check.data["build"] in check.value and "thread" in check.value
