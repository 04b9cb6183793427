"""The host half of `dsv4serve doctor`: Python, WSL2 / container, host RAM and its bandwidth, the caches and
their disks.

The DeepSeek-V4-Flash sizes below are sums over its real tensor list (tests/data, the same
numbers `dsv4serve plan` prints; tests/unit/test_doctor.py recomputes them from the real config).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dsv4serve.container import detect_container
from dsv4serve.doctor_check import Check
from dsv4serve.env import Environment
from dsv4serve.memory.chunk_planner import PLATFORM_MARGIN_BYTES
from dsv4serve.memory.probe import PROC_MEMINFO, detect_platform, host_snapshot
from dsv4serve.units import gib

DSV4_FLASH_CHECKPOINT_BYTES = 159_609_485_896  # every tensor, MTP included (~149 GiB)
DSV4_FLASH_EXPERT_BANK_BYTES = 147_169_738_752  # routed experts of the main layers (~137 GiB)
DSV4_FLASH_HUB_FOLDER = "models--deepseek-ai--DeepSeek-V4-Flash"  # its folder in the HF hub cache
MIN_PYTHON = (3, 10)


def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    data = {"version": version, "executable": sys.executable}
    if sys.version_info[:2] < MIN_PYTHON:
        return Check("python", "fail", f"{version} ({sys.executable})", "dsv4serve needs Python 3.10 or newer", data)
    return Check("python", "ok", f"{version} ({sys.executable})", data=data)


def check_platform(proc_version: Path = Path("/proc/version"), root: Path = Path("/")) -> tuple[Check, str]:
    """WSL2 or native (the chunk planner's margin depends on it), and the container runtime if any."""
    platform = detect_platform(proc_version)
    container = detect_container(root)
    margin = gib(PLATFORM_MARGIN_BYTES[platform])
    where = "WSL2" if platform == "wsl2" else "native Linux"
    inside = f", inside {container.runtime} ({container.evidence})" if container else ", not in a container"
    data = {
        "platform": platform,
        "container": container.runtime if container else None,
        "margin_bytes": PLATFORM_MARGIN_BYTES[platform],
    }
    return Check(
        "platform",
        "ok",
        f"{where}{inside}; the chunk planner keeps a {margin} {platform} margin of free GPU memory",
        data=data,
    ), platform


def check_host_ram(platform: str, largest_gpu_bytes: int, meminfo: Path = PROC_MEMINFO) -> Check:
    """Host RAM: where the expert bank of DeepSeek-V4-Flash lives when the GPU cannot hold the model."""
    try:
        snap = host_snapshot(1.0, meminfo)
    except (OSError, KeyError, ValueError) as exc:
        return Check("host RAM", "warn", f"unknown ({meminfo}: {exc})", "the memory plan cannot see host RAM")
    data = {"total_bytes": snap.total_bytes, "available_bytes": snap.free_bytes}
    value = f"{gib(snap.total_bytes)} total, {gib(snap.free_bytes)} available"
    if largest_gpu_bytes >= DSV4_FLASH_CHECKPOINT_BYTES or snap.total_bytes >= DSV4_FLASH_EXPERT_BANK_BYTES:
        return Check("host RAM", "ok", value, data=data)
    fix = (
        f"DeepSeek-V4-Flash keeps its {gib(DSV4_FLASH_EXPERT_BANK_BYTES)} expert bank in host RAM on a GPU "
        "that cannot hold the model; with less RAM, experts page in from disk and decode slows "
        "(dsv4-tiny is not affected)"
    )
    if platform == "wsl2":
        fix += "; WSL2 gets half of the Windows RAM by default: raise memory= in %UserProfile%\\.wslconfig"
    return Check("host RAM", "warn", value, fix, data)


def existing_ancestor(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path("/")


def _on_windows_drive(path: Path) -> bool:
    parts = path.resolve().parts
    return len(parts) >= 3 and parts[1] == "mnt" and len(parts[2]) == 1


def check_hf_cache(hub_cache: Path, platform: str) -> Check:
    """Free space where the ~149 GiB checkpoint would be downloaded, unless it is already there."""
    base = existing_ancestor(hub_cache)
    free = shutil.disk_usage(base).free
    cached = (hub_cache / DSV4_FLASH_HUB_FOLDER).is_dir()
    data = {
        "path": str(hub_cache),
        "free_bytes": free,
        "dsv4_flash_cached": cached,
        "checkpoint_bytes": DSV4_FLASH_CHECKPOINT_BYTES,
    }
    value = f"{hub_cache}: {gib(free)} free" + ("; DeepSeek-V4-Flash is in it" if cached else "")
    if platform == "wsl2" and _on_windows_drive(hub_cache):
        return Check(
            "HF cache",
            "warn",
            value,
            "the cache is on a Windows drive (/mnt/...): reading the "
            "checkpoint through WSL2's file bridge is slow; set HF_HOME to a folder inside the WSL2 "
            "file system",
            data,
        )
    if cached or free >= DSV4_FLASH_CHECKPOINT_BYTES:
        return Check("HF cache", "ok", value, data=data)
    return Check(
        "HF cache",
        "warn",
        value,
        f"DeepSeek-V4-Flash needs {gib(DSV4_FLASH_CHECKPOINT_BYTES)}: point "
        "HF_HOME (or HF_HUB_CACHE) at a larger disk, or download it elsewhere and pass --model DIR",
        data,
    )


def check_tiny_cache(cache_dir: Path) -> Check:
    """DSV4SERVE_CACHE_DIR: where dsv4-tiny is built on first use; it must be writable."""
    base = existing_ancestor(cache_dir)
    data = {"path": str(cache_dir), "writable": os.access(base, os.W_OK)}
    if not data["writable"]:
        return Check(
            "dsv4serve cache",
            "warn",
            f"{cache_dir}: {base} is not writable",
            "set DSV4SERVE_CACHE_DIR to a writable folder (dsv4-tiny is built there)",
            data,
        )
    return Check("dsv4serve cache", "ok", f"{cache_dir} (dsv4-tiny is built here)", data=data)


def check_storage(env: Environment, platform: str) -> list[Check]:
    from huggingface_hub import constants

    return [check_hf_cache(Path(constants.HF_HUB_CACHE), platform), check_tiny_cache(env.cache_dir)]


HOST_COPY_BYTES = 256 * 1024**2  # large enough to leave every cache behind, small enough to take ~10 ms
BANDWIDTH_REPEATS = 5


def median_gbps(n_bytes: int, seconds: list[float]) -> float:
    """GB/s (10^9 bytes) of the median of timed repeats that each moved n_bytes."""
    return n_bytes / statistics.median(seconds) / 1e9


def _timed_copies(src, dst, n_threads: int, repeats: int) -> list[float]:
    """Seconds per copy of src into dst split into n_threads slices, one per thread (numpy's copy releases
    the GIL, so the slices move at once)."""
    import numpy as np

    n = src.size
    slices = [slice(i * n // n_threads, (i + 1) * n // n_threads) for i in range(n_threads)]
    with ThreadPoolExecutor(n_threads) as pool:

        def copy_all() -> None:
            list(pool.map(lambda s: np.copyto(dst[s], src[s]), slices))

        copy_all()  # faults the pages in and starts the threads
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            copy_all()
            seconds.append(time.perf_counter() - start)
    return seconds


def measure_host_bandwidth(n_bytes: int = HOST_COPY_BYTES, repeats: int = BANDWIDTH_REPEATS) -> tuple[float, int]:
    """Host memory bandwidth in GB/s and the thread count that reached it: one buffer copied into another,
    counted as STREAM counts a copy (bytes read + bytes written), median of `repeats`, with one thread and with
    one per CPU; the faster of the two (on a loaded machine a second thread can only wait for a core)."""
    import numpy as np

    src = np.ones(n_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = (0.0, 1)
    for n_threads in sorted({1, os.cpu_count() or 1}):
        gbps = median_gbps(2 * n_bytes, _timed_copies(src, dst, n_threads, repeats))
        best = max(best, (gbps, n_threads))
    return best


def check_host_bandwidth(measure=measure_host_bandwidth) -> Check:
    """What CPU experts can stream at most: `plan --host-bandwidth` takes this number."""
    try:
        gbps, n_threads = measure()
    except (RuntimeError, MemoryError) as exc:
        return Check("host memory bandwidth", "warn", f"not measured ({exc})", data={"gbps": None})
    value = (
        f"{gbps:.1f} GB/s (a {HOST_COPY_BYTES >> 20} MiB copy counted read + write, median of {BANDWIDTH_REPEATS}, "
        f"{n_threads} of {os.cpu_count()} CPUs)"
    )
    data = {"gbps": gbps, "threads": n_threads, "copy_bytes": HOST_COPY_BYTES}
    return Check("host memory bandwidth", "ok", value, data=data)


def plan_command(
    host_gbps: float | None, h2d_gbps: float | None, gpu_present: bool, disk_gbps: float | None = None
) -> str:
    """The `dsv4serve plan` line that projects decode speed with the measured bandwidths."""
    parts = ["dsv4serve plan --model DeepSeek-V4-Flash"]
    if not gpu_present:  # without --gpu-memory the plan is for this machine's CPU, which has no projection
        parts.append("--gpu-memory 32GiB")
    if h2d_gbps is not None:
        parts.append(f"--h2d-bandwidth {h2d_gbps:.1f}")
    if host_gbps is not None:
        parts.append(f"--host-bandwidth {host_gbps:.1f}")
    if disk_gbps is not None:
        parts.append(f"--disk-bandwidth {disk_gbps:.2f}")
    return " ".join(parts)
