"""The ONE module that asks the device how much memory is free (habit 8).

    take_snapshot(device, memory_ratio, simulated=None) -> MemorySnapshot
    measure_activation_bytes(run_chunk_fn, n_tokens, device) -> bytes per token | None
    detect_platform() -> "wsl2" | "native"

On CUDA the snapshot is measured with torch.cuda.mem_get_info after the weights, expert slots and KV
are allocated, limited by --memory-ratio (free may not exceed ratio x total minus what this process
has already reserved). On CPU there is no device memory to measure: the snapshot comes from a
`SimulatedBudget` (tests, and the CPU path), so the chunk planner runs the same code everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsv4serve.memory.chunk_planner import MemorySnapshot, Platform

PROC_VERSION = Path("/proc/version")
PROC_MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class SimulatedBudget:
    """A GPU that is not here: what a CPU run (or a test) pretends is free and total."""

    free_bytes: int
    total_bytes: int
    platform: Platform = "native"
    activation_bytes_per_token: int | None = None


def detect_platform(proc_version: Path = PROC_VERSION) -> Platform:
    """WSL2 kernels name themselves in /proc/version ("...microsoft-standard-WSL2...")."""
    try:
        text = proc_version.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "native"
    return "wsl2" if ("microsoft" in text.lower() or "wsl" in text.lower()) else "native"


def take_snapshot(
    device: str = "cuda",
    memory_ratio: float = 1.0,
    simulated: SimulatedBudget | None = None,
    measured_activation_bytes_per_token: int | None = None,
) -> MemorySnapshot:
    if simulated is not None or device == "cpu":
        if simulated is None:
            raise ValueError("a CPU snapshot needs a SimulatedBudget: there is no device memory to measure")
        return MemorySnapshot(
            simulated.free_bytes,
            simulated.total_bytes,
            simulated.platform,
            measured_activation_bytes_per_token or simulated.activation_bytes_per_token,
            "simulated",
        )
    import torch

    free, total = torch.cuda.mem_get_info(device)
    # the cached-but-unused part of torch's pool is free for this process too
    reserved = torch.cuda.memory_reserved(device)
    idle_in_pool = reserved - torch.cuda.memory_allocated(device)
    allowed = int(total * memory_ratio) - reserved  # the ratio caps what this process may hold in all
    usable = max(0, min(free + idle_in_pool, allowed + idle_in_pool))
    return MemorySnapshot(usable, total, detect_platform(), measured_activation_bytes_per_token, "measured")


def host_snapshot(memory_ratio: float = 1.0, meminfo: Path = PROC_MEMINFO) -> MemorySnapshot:
    """The CPU path's working memory is host RAM: MemAvailable, limited by --memory-ratio of MemTotal."""
    fields: dict[str, int] = {}
    for line in meminfo.read_text(encoding="utf-8").splitlines():
        name, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            fields[name] = int(rest.split()[0]) * 1024
    total, available = fields["MemTotal"], fields.get("MemAvailable", fields.get("MemFree", 0))
    return MemorySnapshot(min(available, int(total * memory_ratio)), total, "native", None, "measured host RAM")


def measure_activation_bytes(run_chunk_fn: Callable[[int], object], n_tokens: int, device: str = "cuda") -> int | None:
    """Run one probe prefill of `n_tokens` and return its peak activation bytes per token.

    The peak is torch.cuda.max_memory_allocated during the call minus what was allocated before it
    (weights, slots, KV are already there), divided by n_tokens and rounded up. The probe should run
    at the chunk size the plan intends, so that anything that grows faster than linearly shows up.
    On CPU this is a documented no-op that returns None: the planner then uses the geometry estimate.
    """
    if device == "cpu" or n_tokens <= 0:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_chunk_fn(n_tokens)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    return max(1, -(-peak // n_tokens))
