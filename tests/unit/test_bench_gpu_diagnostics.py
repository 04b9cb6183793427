"""bench/gpu_profile.py and bench/gpu_diverge.py on the CPU (their own file: each takes ~30 s in the interpreter,
and xdist hands a file to one worker, so this one can run beside test_bench_gpu_check's smoke run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # dsv4-tiny through the Triton interpreter: ~20 s each
def test_the_gpu_diagnostics_run_on_the_cpu(tmp_path: Path) -> None:
    """bench/gpu_profile.py and bench/gpu_diverge.py, the tools a lent GPU's minutes go to after gpu_check, run
    their whole path on dsv4-tiny: the profile's rows per (batch, mode), and the divergence finder seeing what
    batch-invariant numerics promise on the CPU (a decoded token's logits equal a one-shot prefill's, bit for
    bit, on the Triton kernels and on torch, with the same routing)."""
    import json
    import subprocess

    out = tmp_path / "profile.json"
    cmd = [sys.executable, str(REPO / "bench" / "gpu_profile.py"), "--cpu-smoke", "--batch", "1"]
    cmd += ["--steps", "1", "--context", "136", "--top", "3", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["mode"]) for r in rows] == [(1, "eager"), (1, "graphs")]
    assert all(r["wall_ms"] > 0 for r in rows)
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_diverge.py"), "--cpu-smoke", "--prompt", "40"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for kind in ("triton", "torch"):
        assert f"[{kind}] logits of token 40: max |diff| 0," in proc.stdout, proc.stdout
    assert proc.stdout.count("no module output differs") == 2
    assert "DIFFER" not in proc.stdout and proc.stdout.count("experts same") == 4
