"""`dsv4serve doctor`: one report of what the server will run on, each line OK or what to fix.

    dsv4serve doctor [--json]

It looks at Python, torch and its CUDA build, the NVIDIA driver, triton, flashinfer, every GPU
(total / free memory, compute capability), the Triton kernels (on a GPU: the worker's start-up kernel
check, each compiled and run against torch), WSL2 and containers, the pinned-memory budget (measured
on CUDA), host RAM and its bandwidth, host-to-device copies, the disk behind the Hugging Face cache (its free
space, and how fast it pages experts in: doctor_disk.py). It runs on CPU-only machines too:
the CPU path (the PyTorch reference) counts as runnable. Exit code 0 when the server can run, 1
when a check found a blocking problem (status "fail"); "warn" lines never change the exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from dsv4serve.doctor_check import Check
from dsv4serve.env import Environment


def add_doctor_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def gather(env: Environment) -> list[Check]:
    """Every check, in the order a person reads them: software, GPUs, platform, memory, disk."""
    from dsv4serve import doctor_backends, doctor_gpu, doctor_host

    platform_check, platform = doctor_host.check_platform()
    checks = [doctor_host.check_python()]
    torch_check, torch = doctor_gpu.check_torch()
    build = torch.version.cuda if torch is not None else None
    driver = doctor_gpu.driver_cuda_version()
    release = doctor_gpu.driver_release() if driver is not None else None
    checks += [
        torch_check,
        doctor_gpu.check_driver(build, driver, release),
        doctor_gpu.check_triton(),
        doctor_gpu.check_flashinfer(),
        doctor_backends.check_cpu_loops(),
        doctor_backends.check_kt_kernel(),
    ]
    gpu_checks, largest_gpu_bytes = doctor_gpu.check_gpus(torch)
    checks += gpu_checks
    if not any(c.status == "fail" for c in checks):
        checks.append(doctor_gpu.check_kernels(torch))
    checks.append(platform_check)
    host = doctor_host.check_host_ram(platform, largest_gpu_bytes)
    checks += [host, doctor_gpu.check_pinned(torch, platform, host.data.get("available_bytes", 0))]
    checks += doctor_gpu.check_bandwidths(torch)
    checks += doctor_host.check_storage(env, platform)
    return checks


def can_run(checks: list[Check]) -> bool:
    return not any(c.status == "fail" for c in checks)


def format_report(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = ["dsv4serve doctor: what the server will run on"]
    for c in checks:
        lines.append(f"  {c.status.upper():<4}  {c.name:<{width}}  {c.value}")
        if c.fix:
            lines.append(f"  {'':<4}  {'':<{width}}  fix: {c.fix}")
    verdict = (
        "the server can run here" if can_run(checks) else "the server cannot run here until the FAIL lines are fixed"
    )
    n_warn = sum(c.status == "warn" for c in checks)
    lines.append(f"verdict: {verdict}" + (f" ({n_warn} warning{'s' * (n_warn != 1)})" if n_warn else ""))
    return "\n".join(lines)


def report_json(checks: list[Check]) -> dict[str, Any]:
    return {"can_run": can_run(checks), "checks": [asdict(c) for c in checks]}


def run_doctor(ns: argparse.Namespace, env: Environment) -> int:
    checks = gather(env)
    if ns.json:
        json.dump(report_json(checks), sys.stdout, indent=2)
        print()
    else:
        print(format_report(checks))
    return 0 if can_run(checks) else 1
