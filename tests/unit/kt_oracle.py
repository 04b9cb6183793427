"""The torch oracle for kt-kernel's MXFP4 experts (issue 18, checked bit for bit at batch 1): the package's
start-up reference (dsv4serve/experts/kt_check.py, which says what it rounds where), re-exported for the
tests that load this file by path (tests run with --import-mode=importlib)."""

from __future__ import annotations

from dsv4serve.experts.kt_check import expert_out, kt_reference

__all__ = ["expert_out", "kt_reference"]
