"""The habits of a well-kept project, run by the suite: ruff (lint and format) and mypy, as configured in
pyproject.toml. A failure prints what to fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True)


def test_ruff_lint_and_format():
    lint = _run("ruff", "check", ".")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = _run("ruff", "format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr + "\n(run `ruff format .`)"


@pytest.mark.slow  # about a minute on two cores without mypy's cache
def test_mypy():
    out = _run("mypy")
    assert out.returncode == 0, out.stdout + out.stderr
