"""`dsv4serve plan` without --gpu-memory plans for the machine it runs on (issue #17.5): on this CPU-only
machine, the CPU and the RAM /proc/meminfo reports; the prefill chunk and its binding limit are printed."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from dsv4serve.cli import build_parser
from dsv4serve.config import options
from dsv4serve.env import read_environment
from dsv4serve.plan_cli import build_plan, run_plan
from dsv4serve.units import gib


def _mem_total_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def _ns(tiny_cache: Path, *extra: str):
    env = read_environment({"DSV4SERVE_CACHE_DIR": str(tiny_cache)}, tuple(options()))
    return build_parser("plan").parse_args(["--model", "dsv4-tiny", *extra]), env


def test_plan_without_gpu_memory_is_for_the_cpu_and_its_measured_ram(tiny_cache):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the plan is for GPU 0")
    ns, env = _ns(tiny_cache)
    plan = build_plan(ns, env)
    machine, chunk = plan["machine"], plan["prefill_chunk"]
    assert machine["device"] == "cpu" and machine["gpu_memory_bytes"] == _mem_total_bytes()
    assert machine["plan_for"].startswith("the CPU") and gib(_mem_total_bytes()) in machine["plan_for"]
    assert chunk["effective"] > 0 and chunk["binding"] and chunk["reason"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run_plan(ns, env) == 0
    text = out.getvalue()
    assert "plan for the CPU" in text and "host RAM, CPU" in text
    assert (
        f"prefill chunk: requested auto, effective {chunk['effective']:,} tokens, bound by {chunk['binding']}" in text
    )


def test_an_explicit_gpu_memory_still_plans_for_that_gpu(tiny_cache):
    ns, env = _ns(tiny_cache, "--gpu-memory", "24GiB")
    plan = build_plan(ns, env)
    assert plan["machine"]["device"] == "cuda" and plan["machine"]["gpu_memory_bytes"] == 24 * 2**30
    assert "--gpu-memory" in plan["machine"]["plan_for"] and plan["prefill_chunk"]["binding"]
