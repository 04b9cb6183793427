"""`dsv4serve doctor`: the real command on this machine, and each check against fake /proc files."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dsv4serve.container import detect_container
from dsv4serve.doctor import Check, can_run, format_report
from dsv4serve.doctor_gpu import (
    PIN_PROBE_CAP_BYTES,
    arch_supported,
    check_driver,
    check_gpus,
    check_pinned,
    check_torch,
)
from dsv4serve.doctor_host import (
    DSV4_FLASH_CHECKPOINT_BYTES,
    DSV4_FLASH_EXPERT_BANK_BYTES,
    DSV4_FLASH_HUB_FOLDER,
    check_hf_cache,
    check_host_ram,
    check_platform,
)
from dsv4serve.memory.chunk_planner import MemorySnapshot

GIB = 1024**3
WSL2_VERSION = (
    "Linux version 6.6.87.2-microsoft-standard-WSL2 (root@439a258ad544) (gcc (GCC) 11.2.0) "
    "#1 SMP PREEMPT_DYNAMIC Thu Jun  5 18:30:46 UTC 2025\n"
)
NATIVE_VERSION = "Linux version 6.8.0-45-generic (buildd@lcy02-amd64-075) (gcc 13.2.0) #45-Ubuntu SMP\n"
NAMES = [
    "python",
    "torch",
    "CPU loops",
    "NVIDIA driver",
    "triton",
    "flashinfer",
    "platform",
    "host RAM",
    "pinned memory",
    "host memory bandwidth",
    "host-to-device",
    "decode projection",
    "HF cache",
    "dsv4serve cache",
]


def doctor(*args: str, tmp_path) -> subprocess.CompletedProcess:
    exe = shutil.which("dsv4serve") or pytest.fail("dsv4serve is not on PATH: install the package first")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "DSV4SERVE_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run([exe, "doctor", *args], capture_output=True, text=True, env=env, timeout=120)


# ------------------------------------------------------------------------------------- the real command


def test_doctor_json_reports_every_check_and_exits_zero_here(tmp_path):
    out = doctor("--json", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["can_run"] is True
    assert set(NAMES) <= set(checks)
    assert all(c["status"] in ("ok", "warn") for c in checks.values())
    assert all(c["fix"] for c in checks.values() if c["status"] == "warn")  # a warning always says what to do
    assert checks["torch"]["data"]["cuda_build"] == torch.version.cuda
    assert checks["HF cache"]["data"]["path"] == str(tmp_path / "hf" / "hub")
    if not torch.cuda.is_available():  # the CPU path of this machine and of CI
        assert checks["pinned memory"]["value"] == "no CUDA: pageable only"
        assert checks["host-to-device"]["value"] == "no GPU: not measured"
        assert "CPU path" in checks["GPU"]["value"]


def test_doctor_text_report_says_ok_or_what_to_fix(tmp_path):
    out = doctor(tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("dsv4serve doctor") and lines[-1].startswith("verdict: the server can run here")
    rows = [ln for ln in lines[1:-1] if not ln.strip().startswith("fix:")]
    for name in NAMES:
        assert any(re.match(rf"^  (OK|WARN)\s+{re.escape(name)}\s", row) for row in rows), name


def test_a_failed_check_is_the_only_thing_that_stops_the_server():
    warn = Check("host RAM", "warn", "8 GiB", "add RAM")
    fail = Check("GPU 0", "fail", "CUDA could not use it: device not ready", "see README")
    assert can_run([warn]) and not can_run([warn, fail])
    text = format_report([warn, fail])
    assert "fix: add RAM" in text and "FAIL  GPU 0" in text and "cannot run here" in text.splitlines()[-1]


# ------------------------------------------------------------------------------------- WSL2 and Docker


@pytest.mark.parametrize(
    "files, expected",
    [
        ({".dockerenv": ""}, ("docker", "/.dockerenv")),
        ({"run/.containerenv": ""}, ("podman", "/run/.containerenv")),
        ({"proc/1/cgroup": "12:pids:/docker/3f2a9c\n0::/\n"}, ("docker", "/proc/1/cgroup")),
        ({"proc/1/cgroup": "11:memory:/kubepods/burstable/pod1/abc\n"}, ("kubernetes", "/proc/1/cgroup")),
        (
            {
                "proc/1/cgroup": "0::/\n",
                "proc/self/mountinfo": "612 600 8:1 /var/lib/docker/containers/3f2a/hostname /etc/hostname rw - ext4 /dev/sda1 rw\n",
            },
            ("docker", "/proc/self/mountinfo"),
        ),
        ({"proc/1/cgroup": "0::/init.scope\n", "proc/self/mountinfo": "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"}, None),
        ({}, None),
    ],
)
def test_container_detection_from_fake_proc_files(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = detect_container(tmp_path)
    assert (found and (found.runtime, found.evidence)) == expected


@pytest.mark.parametrize(
    "version, docker, platform, margin_gib",
    [
        (WSL2_VERSION, False, "wsl2", 2.5),
        (WSL2_VERSION, True, "wsl2", 2.5),
        (NATIVE_VERSION, False, "native", 0.5),
    ],
)
def test_platform_line_names_wsl2_docker_and_the_planner_margin(tmp_path, version, docker, platform, margin_gib):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "version").write_text(version)
    if docker:
        (tmp_path / ".dockerenv").write_text("")
    check, found = check_platform(tmp_path / "proc" / "version", tmp_path)
    assert found == platform and check.status == "ok"
    assert check.data["margin_bytes"] == margin_gib * GIB
    assert ("WSL2" in check.value) == (platform == "wsl2")
    assert ("inside docker" in check.value) == docker


# ------------------------------------------------------------------------------------- memory and disk


def meminfo(tmp_path, total_gib: int, available_gib: int):
    path = tmp_path / "meminfo"
    path.write_text(
        f"MemTotal:       {total_gib * 1024**2} kB\nMemFree:        1024 kB\n"
        f"MemAvailable:   {available_gib * 1024**2} kB\n"
    )
    return path


def test_host_ram_below_the_expert_bank_warns_and_names_wslconfig_under_wsl2(tmp_path):
    small = meminfo(tmp_path, 64, 60)
    wsl = check_host_ram("wsl2", 32 * GIB, small)
    assert wsl.status == "warn" and ".wslconfig" in wsl.fix and wsl.data["available_bytes"] == 60 * GIB
    assert ".wslconfig" not in check_host_ram("native", 32 * GIB, small).fix
    assert check_host_ram("native", 32 * GIB, meminfo(tmp_path, 256, 250)).status == "ok"
    assert check_host_ram("native", 160 * 10**9, small).status == "ok"  # the GPU holds the whole model


def test_hf_cache_on_a_windows_drive_under_wsl2_is_a_warning(tmp_path):
    check = check_hf_cache(tmp_path / "mnt" / "c" / "hub", "wsl2")  # not /mnt/c: a folder under tmp
    assert "Windows drive" not in check.fix
    windows = check_hf_cache(Path("/mnt/c/Users/dev/.cache/huggingface/hub"), "wsl2")
    assert windows.status == "warn" and "Windows drive" in windows.fix


def test_hf_cache_holding_the_checkpoint_needs_no_free_space(tmp_path):
    (tmp_path / DSV4_FLASH_HUB_FOLDER).mkdir()
    check = check_hf_cache(tmp_path, "native")
    assert check.status == "ok" and check.data["dsv4_flash_cached"] is True


def test_checkpoint_sizes_match_the_real_tensor_list(real_model_dir):
    """Recomputed from the published tensor list (name, dtype, shape), independent of our schema code."""
    dtype_bytes = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "I64": 8}
    total = experts = 0
    with gzip.open(real_model_dir / "tensors.tsv.gz", "rt") as f:
        next(f)
        for line in f:
            name, dtype, shape = line.rstrip("\n").split("\t")
            n_bytes = math.prod(int(x) for x in shape.split(",")) * dtype_bytes[dtype]
            total += n_bytes
            experts += n_bytes if re.match(r"layers\.\d+\.ffn\.experts\.", name) else 0
    assert (total, experts) == (DSV4_FLASH_CHECKPOINT_BYTES, DSV4_FLASH_EXPERT_BANK_BYTES)


# ------------------------------------------------------------------------------------- torch and the driver


@pytest.mark.parametrize(
    "build, driver, status, words",
    [
        (None, None, "ok", "CPU path"),
        ("13.0", None, "ok", "CPU path"),
        ("13.0", (13, 0), "ok", "supports CUDA 13.0"),
        ("13.0", (13, 2), "ok", "supports CUDA 13.2"),
        ("13.0", (12, 8), "warn", "R580"),
        (None, (13, 0), "warn", "CPU build"),
    ],
)
def test_driver_against_torchs_cuda_build(build, driver, status, words):
    check = check_driver(build, driver)
    assert check.status == status
    assert words in check.value + check.fix


def test_driver_line_shows_the_release_when_nvidia_smi_gave_one():
    check = check_driver("13.0", (13, 0), "580.95.05")
    assert check.value.startswith("580.95.05, supports CUDA 13.0") and check.data["release"] == "580.95.05"


@pytest.mark.parametrize(
    "capability, supported",
    [
        ((12, 0), True),
        ((8, 9), True),
        ((9, 0), True),
        ((10, 3), True),
        ((7, 0), False),
        ((6, 1), False),
    ],
)
def test_gpu_architecture_against_the_torch_arch_list(capability, supported):
    # the arch list of torch 2.13.0's CUDA 13.0 wheel: Turing (sm_75) and newer, no Volta or older
    archs = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
    assert arch_supported(capability, archs) is supported


def test_ptx_in_the_arch_list_covers_newer_gpus():
    assert arch_supported((12, 1), ["sm_90", "compute_90"]) and not arch_supported((8, 6), ["compute_90"])


def test_torch_check_on_this_machine_matches_the_pin():
    check, module = check_torch()
    assert module is torch and check.status == "ok" and torch.__version__ in check.value


# ------------------------------------------------------------------------------------- the CUDA path, faked


def fake_cuda_torch(device_error: str) -> SimpleNamespace:
    """A CUDA torch as check_gpus sees it: GPU 0 an RTX 5090, GPU 1 broken the way WSL2 breaks."""

    def properties(i: int) -> SimpleNamespace:
        if i == 1:
            raise RuntimeError(device_error)
        return SimpleNamespace(name="NVIDIA GeForce RTX 5090", major=12, minor=0)

    cuda = SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 2,
        get_device_properties=properties,
        get_arch_list=lambda: ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"],
    )
    return SimpleNamespace(__version__="2.13.0", version=SimpleNamespace(cuda="13.0"), cuda=cuda)


def test_gpu_lines_on_cuda_report_memory_capability_and_a_broken_device(monkeypatch):
    snapshots = []

    def snapshot(device: str, ratio: float) -> MemorySnapshot:
        snapshots.append((device, ratio))
        return MemorySnapshot(29 * GIB, 32 * GIB, "wsl2", None, "measured")

    monkeypatch.setattr("dsv4serve.memory.probe.take_snapshot", snapshot)
    checks, largest = check_gpus(fake_cuda_torch("CUDA driver error: device not ready\nmore"))  # type: ignore
    assert largest == 32 * GIB and snapshots == [("cuda:0", 1.0)]
    assert checks[0].status == "ok" and checks[0].data["compute_capability"] == "12.0"
    assert "32.00 GiB total, 29.00 GiB free" in checks[0].value
    assert checks[1].status == "fail" and checks[1].value.endswith("device not ready")
    assert "WSL2" in checks[1].fix


def test_pinned_budget_on_cuda_is_measured_within_a_cap_and_warns_when_small(monkeypatch):
    from dsv4serve.experts.pinning import PinBudget

    asked = []

    def measure(cap_bytes: int, platform: str) -> PinBudget:
        asked.append(cap_bytes)
        return PinBudget(768 * 1024**2, platform, "the platform refused to pin more after 1.00 GiB")

    monkeypatch.setattr("dsv4serve.experts.pinning.measure_pin_budget", measure)
    torch_cuda = fake_cuda_torch("unused")
    small = check_pinned(torch_cuda, "wsl2", 20 * GIB)  # type: ignore[arg-type]
    assert asked == [10 * GIB] and small.status == "warn" and ".wslconfig" in small.fix
    assert small.data["budget_bytes"] == 768 * 1024**2 and "refused" in small.value
    check_pinned(torch_cuda, "native", 512 * GIB)  # type: ignore[arg-type]
    assert asked[-1] == PIN_PROBE_CAP_BYTES


def test_kernel_line_runs_the_start_up_check_on_cuda(monkeypatch):
    from dsv4serve.doctor_gpu import check_kernels
    from dsv4serve.model.backends import kernel_names
    from dsv4serve.worker.kernel_check import Verdict

    assert check_kernels(None).status == "ok"  # no torch / no CUDA: nothing to check
    ran = []

    def run_check(kernels, device):
        ran.append((tuple(kernels), str(device)))
        return [Verdict(k, k not in failing, "greedy 45/45" if k not in failing else "ERR -> fix it") for k in kernels]

    monkeypatch.setattr("dsv4serve.worker.kernel_check.run_check", run_check)
    fake = fake_cuda_torch("unused")
    fake.device = lambda name: name
    failing: set[str] = set()
    ok = check_kernels(fake)  # type: ignore[arg-type]
    assert ok.status == "ok" and ran[0][1] == "cuda:0" and ran[0][0] == tuple(kernel_names())
    assert len(ok.data["verdicts"]) == len(kernel_names())  # every kernel checked
    failing = {"attention"}
    warn = check_kernels(fake)  # type: ignore[arg-type]
    assert warn.status == "warn" and "attention: ERR -> fix it" in warn.value and "torch" in warn.fix
    failing = {"attention", "fp4_moe"}
    fail = check_kernels(fake)  # type: ignore[arg-type]
    assert fail.status == "fail" and "fp4_moe must run on Triton" in fail.fix


# ------------------------------------------------------------------------ bandwidths for `plan`


def test_host_bandwidth_is_measured_and_named_in_the_check():
    from dsv4serve.doctor_host import HOST_COPY_BYTES, check_host_bandwidth, measure_host_bandwidth

    gbps, n_threads = measure_host_bandwidth(32 * 1024**2, repeats=3)
    # a copy of 64 MiB (read + write) can neither be free nor beat any DRAM (DDR5 x 12 channels: ~600 GB/s)
    assert 0.1 < gbps < 1000 and n_threads in (1, os.cpu_count())
    check = check_host_bandwidth(lambda: (12.34, 2))
    assert check.value.startswith("12.3 GB/s") and f"{HOST_COPY_BYTES >> 20} MiB copy" in check.value
    assert check.data["gbps"] == 12.34 and "2 of" in check.value


def test_the_plan_line_uses_the_measured_bandwidths_and_parses_as_plan_flags(monkeypatch, tmp_path):
    from dsv4serve.cli import build_parser
    from dsv4serve.doctor_disk import DiskRead
    from dsv4serve.doctor_gpu import check_bandwidths

    disk = DiskRead(cold_gbps=2.5, warm_gbps=9.0)
    cpu_only = check_bandwidths(None, measure_host=lambda: (31.0, 1), disk_folder=tmp_path, measure_disk=lambda p: disk)
    names = ["host memory bandwidth", "host-to-device", "disk read", "decode projection"]
    assert [c.name for c in cpu_only] == names
    assert cpu_only[1].value == "no GPU: not measured" and cpu_only[2].data["gbps"] == 2.5
    line = cpu_only[3].value
    assert "--host-bandwidth 31.0" in line and "--h2d-bandwidth" not in line and "--gpu-memory 32GiB" in line
    assert "--disk-bandwidth 2.50" in line
    measured = {True: 52.5, False: 21.0}
    monkeypatch.setattr("dsv4serve.doctor_gpu.measure_h2d_bandwidth", lambda torch, pinned: measured[pinned])
    gpu = check_bandwidths(
        fake_cuda_torch("unused"),  # type: ignore[arg-type]
        measure_host=lambda: (80.0, 16),
        disk_folder=tmp_path,
        measure_disk=lambda p: disk,
    )
    assert gpu[1].data == {"pinned_gbps": 52.5, "pageable_gbps": 21.0}
    assert "pinned 52.5 GB/s, pageable 21.0 GB/s" in gpu[1].value
    ns = build_parser("plan").parse_args(gpu[3].value.split()[2:])  # the line is a valid `plan` command
    # GPU 0 is planned as measured
    assert (ns.h2d_bandwidth, ns.host_bandwidth, ns.disk_bandwidth, ns.gpu_memory) == (52.5, 80.0, 2.5, None)


def test_disk_read_is_measured_through_a_map_and_a_cached_read_is_not_called_a_disk(tmp_path):
    from dsv4serve.doctor_disk import DISK_BLOCK_BYTES, DiskRead, check_disk_bandwidth, measure_disk_read

    read = measure_disk_read(tmp_path, 8 * 1024**2, 1024**2)
    # 8 MiB paged in and then copied again: neither free nor faster than any DRAM
    assert 0.01 < read.cold_gbps < 1000 and 0.01 < read.warm_gbps < 1000
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone
    ok = check_disk_bandwidth(tmp_path, lambda p: DiskRead(1.25, 6.0))
    assert ok.status == "ok" and ok.data["gbps"] == 1.25 and ok.value.startswith("1.25 GB/s")
    assert f"{DISK_BLOCK_BYTES >> 20} MiB blocks" in ok.value
    cached = check_disk_bandwidth(tmp_path, lambda p: DiskRead(5.9, 6.0))  # the drop did not hold
    assert cached.status == "warn" and cached.data["gbps"] is None and "page cache" in cached.value
    failed = check_disk_bandwidth(tmp_path, lambda p: (_ for _ in ()).throw(OSError("no space")))
    assert failed.status == "warn" and "no space" in failed.value


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-to-device copies need CUDA")
def test_h2d_bandwidth_on_cuda_is_positive_and_pinned_is_not_slower_than_half_of_pageable():
    from dsv4serve.doctor_gpu import measure_h2d_bandwidth

    pinned, pageable = measure_h2d_bandwidth(torch, True), measure_h2d_bandwidth(torch, False)
    assert pinned > 0 and pageable > 0 and pinned > 0.5 * pageable


def test_cpu_loops_line_warns_with_a_fix_when_numba_cannot_compile(monkeypatch):
    from dsv4serve import doctor_backends
    from dsv4serve.model import head_bf16_cpu, sinkhorn_cpu

    assert doctor_backends.check_cpu_loops().status == "ok"  # numba compiles here (a dependency)

    def broken() -> None:
        raise RuntimeError("LLVM cannot target this CPU")

    monkeypatch.setattr(head_bf16_cpu, "warm_up", broken)
    check = doctor_backends.check_cpu_loops()
    assert check.status == "warn" and "LLVM cannot target this CPU" in check.value and "numba" in check.fix
    assert check.data["sinkhorn"] and not check.data["head_bf16"]
    monkeypatch.undo()
    from dsv4serve.model import compressor_cpu, fp8_cpu, hadamard_cpu, hc_cpu, moe_cpu

    loops = [
        (sinkhorn_cpu, "sinkhorn", "Sinkhorn"),
        (hadamard_cpu, "hadamard", "Hadamard"),
        (moe_cpu, "routed_experts", "routed experts"),
        (compressor_cpu, "compressor", "compressor"),
        (fp8_cpu, "fp8", "FP8"),
        (hc_cpu, "hc_gates", "mHC gates"),
    ]
    for module, key, named in loops:  # each loop standing down alone: named, and only it
        monkeypatch.setattr(module, "compiled", lambda: None)
        check = doctor_backends.check_cpu_loops()
        assert check.status == "warn" and named in check.value and not check.data[key]
        assert all(check.data[other] for _, other, _ in loops if other != key)
        monkeypatch.undo()
