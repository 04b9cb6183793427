"""The GPU half of `dsv4serve doctor`: torch and its CUDA build, driver, triton, flashinfer, GPUs, pinning,
host-to-device bandwidth (pinned and pageable).

Free GPU memory comes from `worker.memory_probe.take_snapshot`, the one module that asks the device
(habit 8). The pinned-memory budget is measured with the expert bank's own probe
(`experts.pinning.measure_pin_budget`), so the doctor reports the number the server will use.
"""

from __future__ import annotations

import ctypes
import importlib.metadata as metadata
import re
import shutil
import statistics
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

from dsv4serve.doctor_check import Check
from dsv4serve.units import gib

PIN_PROBE_CAP_BYTES = 16 * 1024**3  # enough to see a WSL2 / Docker cap; never more than half the free RAM
PIN_LOW_BYTES = 1024**3  # below this, expert uploads run mostly through pageable copies


def pinned_versions() -> dict[str, str]:
    """The exact versions dsv4serve's own metadata pins (torch==..., triton==...)."""
    pins = {}
    for req in metadata.requires("dsv4serve") or []:
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^;\s]+)\s*(;|$)", req)
        if m and "extra ==" not in req:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def _version_note(package: str, found: str) -> str:
    want = pinned_versions().get(package)
    return "" if want is None or found.split("+")[0] == want else f"dsv4serve pins {package}=={want}"


def check_torch() -> tuple[Check, ModuleType | None]:
    try:
        import torch
    except ImportError as exc:
        return Check("torch", "fail", f"not importable ({exc})", "pip install -e . (it pins torch)"), None
    cuda = torch.version.cuda
    value = f"{torch.__version__}, " + (f"CUDA {cuda} build" if cuda else "CPU build (no CUDA)")
    data = {"version": torch.__version__, "cuda_build": cuda, "cuda_available": torch.cuda.is_available()}
    note = _version_note("torch", torch.__version__)
    if note:
        return Check("torch", "warn", value, f"{note}: reinstall it", data), torch
    return Check("torch", "ok", value, data=data), torch


def driver_cuda_version(library: str = "libcuda.so.1") -> tuple[int, int] | None:
    """The newest CUDA version the installed NVIDIA driver supports (cuDriverGetVersion), or None."""
    try:
        lib = ctypes.CDLL(library)
    except OSError:
        return None
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value // 1000, (version.value % 1000) // 10


def driver_release() -> str | None:
    """The driver's release number (e.g. 580.95.05) as nvidia-smi prints it; None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return lines[0] if out.returncode == 0 and lines else None


def check_driver(build: str | None, driver: tuple[int, int] | None, release: str | None = None) -> Check:
    """Can the driver (the CUDA version it supports) run torch's CUDA build (None: a CPU build)?"""
    if driver is None:
        return Check("NVIDIA driver", "ok", "none found (no libcuda): the CPU path", data={"cuda_driver": None})
    shown = (f"{release}, " if release else "") + f"supports CUDA {driver[0]}.{driver[1]}"
    data: dict[str, Any] = {"release": release, "cuda_driver": f"{driver[0]}.{driver[1]}", "torch_cuda_build": build}
    if build is None:
        return Check(
            "NVIDIA driver",
            "warn",
            f"{shown}, but torch is the CPU build",
            "install the CUDA build: pip install --force-reinstall torch==2.13.0 from PyPI (its "
            "Linux wheel is built for CUDA 13.0)",
            data,
        )
    need = tuple(int(x) for x in build.split(".")[:2])
    if driver[0] < need[0]:
        return Check(
            "NVIDIA driver",
            "warn",
            f"{shown}; torch needs CUDA {build}: the server falls back to CPU",
            f"update the NVIDIA driver to one for CUDA {need[0]}.x (R580 or newer for CUDA 13); under "
            "WSL2 update the Windows driver, never install a Linux driver inside WSL",
            data,
        )
    return Check("NVIDIA driver", "ok", f"{shown} (torch's build: CUDA {build})", data=data)


def check_triton() -> Check:
    try:
        version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        return Check("triton", "warn", "not installed", "pip install -e . (it pins triton)")
    note = _version_note("triton", version)
    return Check(
        "triton", "warn" if note else "ok", version, f"{note}: reinstall it" if note else "", {"version": version}
    )


def check_flashinfer() -> Check:
    """Optional GPU kernels (the [gpu] extra); looked up by metadata, never imported (slow, GPU-only)."""
    try:
        version = metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        hint = "optional GPU kernels: pip install -e '.[gpu]'"
        return Check("flashinfer", "ok", f"not installed ({hint})", data={"version": None})
    return Check("flashinfer", "ok", version, data={"version": version})


def arch_supported(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """True when torch ships SASS for this GPU's family (sm_XY, same major, minor <= ours) or PTX below it."""
    major, minor = capability
    for arch in arch_list:
        m = re.match(r"^(sm|compute)_(\d+)(\d)[a-z]?$", arch)
        if not m:
            continue
        a_major, a_minor = int(m.group(2)), int(m.group(3))
        if m.group(1) == "sm" and a_major == major and a_minor <= minor:
            return True
        if m.group(1) == "compute" and (a_major, a_minor) <= (major, minor):
            return True
    return False


def check_gpus(torch: ModuleType | None) -> tuple[list[Check], int]:
    """One line per visible GPU: name, total / free memory, compute capability; and the largest total."""
    if torch is None or not torch.cuda.is_available():
        return [
            Check("GPU", "ok", "no CUDA device visible to torch: the CPU path (PyTorch reference)", data={"count": 0})
        ], 0
    from dsv4serve.memory.probe import take_snapshot

    checks, largest, archs = [], 0, torch.cuda.get_arch_list()
    for i in range(torch.cuda.device_count()):
        name = f"GPU {i}"
        try:
            props = torch.cuda.get_device_properties(i)
            snap = take_snapshot(f"cuda:{i}", 1.0)
        except RuntimeError as exc:  # e.g. "device not ready" under WSL2
            checks.append(
                Check(
                    name,
                    "fail",
                    f"CUDA could not use it: {str(exc).splitlines()[0]}",
                    "see the Windows + WSL2 section of README.md; or run with --device cpu",
                )
            )
            continue
        cc = (props.major, props.minor)
        largest = max(largest, snap.total_bytes)
        data = {
            "name": props.name,
            "total_bytes": snap.total_bytes,
            "free_bytes": snap.free_bytes,
            "compute_capability": f"{cc[0]}.{cc[1]}",
        }
        value = (
            f"{props.name}: {gib(snap.total_bytes)} total, {gib(snap.free_bytes)} free, "
            f"compute capability {cc[0]}.{cc[1]}"
        )
        if not arch_supported(cc, archs):
            checks.append(
                Check(
                    name,
                    "fail",
                    value,
                    f"torch {torch.__version__} has no kernels for sm_{cc[0]}"
                    f"{cc[1]} (it ships {', '.join(archs)}): use a newer GPU, or --device cpu",
                    data,
                )
            )
        else:
            checks.append(Check(name, "ok", value, data=data))
    return checks, largest


def check_pinned(torch: ModuleType | None, platform: str, available_ram_bytes: int) -> Check:
    """Measure how much host memory CUDA lets this process pin (then release it); CPU: pageable only."""
    if torch is None or not torch.cuda.is_available():
        return Check("pinned memory", "ok", "no CUDA: pageable only", data={"budget_bytes": 0})
    from dsv4serve.experts.pinning import measure_pin_budget

    cap = min(PIN_PROBE_CAP_BYTES, available_ram_bytes // 2) if available_ram_bytes else PIN_PROBE_CAP_BYTES
    budget = measure_pin_budget(cap, platform)
    data = {"budget_bytes": budget.budget_bytes, "probe_cap_bytes": cap, "reason": budget.reason}
    value = f"{gib(budget.budget_bytes)} ({budget.reason})"
    if budget.budget_bytes < PIN_LOW_BYTES:
        fix = "expert uploads beyond the budget use pageable copies (slower)"
        if platform == "wsl2":
            fix += "; WSL2 limits pinned memory (less inside Docker): raise memory= in .wslconfig"
        return Check("pinned memory", "warn", value, fix, data)
    return Check("pinned memory", "ok", value, data=data)


def check_kernels(torch: ModuleType | None) -> Check:
    """The worker's start-up kernel check (worker/kernel_check.py), run here on GPU 0: every Triton
    kernel compiled and run on the tiny architecture against torch. A failing FP8 GEMM or FP4 MoE is
    a "fail" (the server cannot load the model packed without them); any other kernel, a "warn" (the
    worker runs it on torch)."""
    if torch is None or not torch.cuda.is_available():
        return Check("Triton kernels", "ok", "no CUDA: the CPU path runs none", data={"verdicts": []})
    import time

    from dsv4serve.model.backends import kernel_names
    from dsv4serve.worker.kernel_check import NO_FALLBACK, run_check

    start = time.monotonic()
    try:
        verdicts = run_check(list(kernel_names()), torch.device("cuda:0"))
    except Exception as exc:
        return Check(
            "Triton kernels",
            "fail",
            f"the check could not run: {type(exc).__name__}: {exc}"[:300],
            "run `dsv4serve doctor` again after the GPU and torch lines above are OK",
        )
    seconds = time.monotonic() - start
    failed = [v for v in verdicts if not v.ok]
    data = {
        "verdicts": [{"kernel": v.kernel, "ok": v.ok, "detail": v.detail} for v in verdicts],
        "seconds": round(seconds, 1),
    }
    if not failed:
        return Check(
            "Triton kernels", "ok", f"{len(verdicts)} compiled and checked against torch in {seconds:.0f} s", data=data
        )
    value = "; ".join(f"{v.kernel}: {v.detail}" for v in failed)
    blocking = [v.kernel for v in failed if v.kernel in NO_FALLBACK]
    if blocking:
        return Check(
            "Triton kernels",
            "fail",
            value,
            f"{', '.join(blocking)} must run on Triton to load the model packed: fix the error above",
            data,
        )
    return Check(
        "Triton kernels",
        "warn",
        value,
        "the server runs these on torch (slower); fix the error above to get them back",
        data,
    )


H2D_COPY_BYTES = 256 * 1024**2  # an expert is 12.75 MiB; a few hundred MB averages out the copy engine's start-up


def measure_h2d_bandwidth(torch: ModuleType, pinned: bool, n_bytes: int = H2D_COPY_BYTES, repeats: int = 5) -> float:
    """Host-to-device copy GB/s on GPU 0 from pinned or pageable memory, median of `repeats` (one warm-up
    copy first), each timed with CUDA events around one copy."""
    src = torch.empty(n_bytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(n_bytes, dtype=torch.uint8, device="cuda:0")
    dst.copy_(src, non_blocking=pinned)
    seconds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=pinned)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return n_bytes / statistics.median(seconds) / 1e9


def check_bandwidths(
    torch: ModuleType | None, measure_host=None, disk_folder: Path | None = None, measure_disk=None
) -> list[Check]:
    """Host memory, host-to-device and disk read bandwidth, measured, and the `plan` line that projects decode
    speed with them (memory/decode_speed.py: misses are copied over PCIe, computed on the CPU, or paged in from
    the disk where RAM cannot hold the bank). `disk_folder`: where the checkpoint lives (the Hugging Face cache)."""
    from dsv4serve.doctor_disk import check_disk_bandwidth
    from dsv4serve.doctor_host import check_host_bandwidth, plan_command

    host = check_host_bandwidth(measure_host) if measure_host else check_host_bandwidth()
    if disk_folder is None:
        from huggingface_hub import constants

        disk_folder = Path(constants.HF_HUB_CACHE)
    disk = check_disk_bandwidth(disk_folder, measure_disk) if measure_disk else check_disk_bandwidth(disk_folder)
    gpu = torch is not None and torch.cuda.is_available()
    if not gpu:
        h2d = Check("host-to-device", "ok", "no GPU: not measured", data={"pinned_gbps": None, "pageable_gbps": None})
    else:
        assert torch is not None
        try:
            pinned, pageable = measure_h2d_bandwidth(torch, True), measure_h2d_bandwidth(torch, False)
        except RuntimeError as exc:
            h2d = Check("host-to-device", "warn", f"not measured ({str(exc).splitlines()[0]})", data={})
        else:
            value = f"pinned {pinned:.1f} GB/s, pageable {pageable:.1f} GB/s (GPU 0, {H2D_COPY_BYTES >> 20} MiB copies)"
            h2d = Check("host-to-device", "ok", value, data={"pinned_gbps": pinned, "pageable_gbps": pageable})
    command = plan_command(host.data.get("gbps"), h2d.data.get("pinned_gbps"), gpu, disk.data.get("gbps"))
    plan = Check("decode projection", "ok", command, data={"command": command})
    return [host, h2d, disk, plan]
