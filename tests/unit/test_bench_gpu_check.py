"""bench/gpu_check.py's pure parts: case discovery, the correctness check, rates and error rows."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_discovery_lists_every_case_module_and_skips_private_ones(gpu_check, tmp_path: Path) -> None:
    assert {"fp8_gemm", "fp4_moe", "end_to_end"} <= set(gpu_check.discover(gpu_check.CASES_DIR))
    for name in ("__init__.py", "_helpers.py", "zeta.py", "alpha.py", "notes.txt"):
        (tmp_path / name).write_text("")
    assert gpu_check.discover(tmp_path) == ["alpha", "zeta"]


def test_check_passes_within_tolerance_and_fails_outside_or_on_nan(gpu_check) -> None:
    ref = torch.tensor([1.0, -2.0, 100.0])
    assert gpu_check.check(ref + torch.tensor([0.01, 0.0, 0.5]), ref, atol=0.02, rtol=0.01).startswith("OK")
    assert gpu_check.check(ref + torch.tensor([0.0, 0.0, 2.0]), ref, atol=0.02, rtol=0.01).startswith("FAIL")
    assert gpu_check.check(torch.tensor([1.0, float("nan"), 100.0]), ref, atol=1.0, rtol=1.0).startswith("FAIL")
    assert "shape" in gpu_check.check(ref[:2], ref, atol=1.0, rtol=1.0)


def test_run_case_turns_times_into_rates_against_the_ceiling(gpu_check, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))  # as gpu_check does: cases import `bench.gpu_cases`
    from bench.gpu_cases import GpuCase

    x = torch.ones(4)
    ceilings = {"copy_GBps": 1e-9, "matmul_TFLOPs": 1e-12}  # tiny ceilings: any real rate is far above
    mem = GpuCase(
        "mem", lambda: x * 2, lambda: x * 2, 0.0, 0.0, bytes_moved=1000, baseline=lambda: x + x, baseline_name="torch"
    )
    row = gpu_check.run_case(mem, torch.device("cpu"), ceilings, warmup=1, repeats=3)
    assert row.ok.startswith("OK") and row.rate.endswith("GB/s") and row.pct_of_ceiling > 100
    assert row.baseline == "torch" and row.speedup > 0
    comp = GpuCase("comp", lambda: x, lambda: x + 1, 0.0, 0.0, bytes_moved=1, flops=10**6, bound="compute")
    row = gpu_check.run_case(comp, torch.device("cpu"), ceilings, warmup=1, repeats=3)
    assert row.ok.startswith("FAIL") and row.rate.endswith("TFLOP/s") and row.speedup is None


def test_a_module_that_cannot_import_is_a_row_not_a_crash(gpu_check, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    opts = argparse.Namespace(cpu_smoke=False, only=None, warmup=1, repeats=1)
    rows = gpu_check.run_module("no_such_case_module", torch.device("cpu"), {}, opts, float("inf"), [])
    assert len(rows) == 1 and rows[0].ok.startswith("ERROR: ModuleNotFoundError")
    text = gpu_check.format_rows(rows)
    assert text.splitlines()[0].split()[:3] == ["case", "time", "ms"] and "no_such_case_module" in text


def test_end_to_end_projection_against_the_bandwidth_bound(monkeypatch, real_model_dir: Path) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    from bench.gpu_cases import end_to_end as e2e
    from dsv4serve.model.args import read_model_args

    # the brief's figure: ~11 GB of FP8/FP4 weights read per decoded token at batch 1
    assert 10.5e9 < e2e.decode_bytes_per_token(read_model_args(real_model_dir)) < 12e9
    lines = e2e.notes({e2e.decode_name(2048): 10.0, e2e.prefill_name(2048): 1000.0}, {"copy_GBps": 4800.0})
    assert "= 42" in lines[0]  # 4800 GB/s / ~11.2 GB = ~428 tokens/s
    assert "43 layers 215.0 ms = 4.7 tokens/s" in lines[1]  # 10 ms x 43 / 2 layers
    assert "prefill 2048 tokens/s" in lines[2] and "~95 tokens/s projected" in lines[2]


@pytest.mark.slow  # every GPU case through the Triton interpreter: ~30 s
def test_the_cpu_smoke_run_checks_every_case_module(gpu_check, tmp_path: Path) -> None:
    """The GPU script's whole path (every module's cases, checks, timing, table) on tiny shapes, so a
    lent GPU's minutes are never lost to a broken case module."""
    import json
    import subprocess

    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--cpu-smoke", "--repeats", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert set(report["rows_per_module"]) == set(gpu_check.discover(gpu_check.CASES_DIR))
    assert min(report["rows_per_module"].values()) >= 2
    assert all(row["ok"].startswith("OK") for row in rows), [r for r in rows if not r["ok"].startswith("OK")]


def test_the_real_config_can_travel_with_the_repository(monkeypatch, tmp_path: Path, real_model_dir: Path) -> None:
    """A device machine receives the repository alone: by default the cases read the config in
    tests/data, which travels with it; DSV4_REAL_CONFIG_DIR (set by bench/gpu_session.sh) overrides it."""
    monkeypatch.syspath_prepend(str(REPO))
    from bench.gpu_cases import real_config_dir

    monkeypatch.delenv("DSV4_REAL_CONFIG_DIR", raising=False)
    assert (real_config_dir() / "config.json").read_bytes() == (real_model_dir / "config.json").read_bytes()
    monkeypatch.setenv("DSV4_REAL_CONFIG_DIR", str(tmp_path))
    assert real_config_dir() == tmp_path
    assert "DSV4_REAL_CONFIG_DIR" in (REPO / "bench" / "gpu_session.sh").read_text()


def test_only_takes_a_substring_with_brackets_or_a_regex(gpu_check) -> None:
    name = "decode_step bs=1 eager [resident, triton]"
    assert gpu_check.selected("bs=1 eager [resident", name)  # an invalid regex, a plain substring
    assert gpu_check.selected("resident|hybrid", name)
    assert not gpu_check.selected("hybrid|slot", name)
    assert not gpu_check.selected("[hybrid", name)
