"""The cases `bench/gpu_check.py` runs: one module per kernel (or end-to-end check) in this folder.

Each module defines `cases(device: torch.device) -> list[GpuCase]`, building its inputs at
DeepSeek-V4-Flash's real dimensions on `device`. gpu_check.py checks `run()` against `reference()`
with the stated tolerance, times `run` (and `baseline` when there is one) with CUDA events, and turns
`bytes_moved` / `flops` into GB/s and TFLOP/s against the card's measured ceilings.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


def real_config_dir() -> Path:
    """The folder holding DeepSeek-V4-Flash's config.json: $DSV4_REAL_CONFIG_DIR when set (another
    checkpoint's config), else the copy in tests/data, which travels with the repository to a device
    machine."""
    default = Path(__file__).resolve().parents[2] / "tests" / "data" / "DeepSeek-V4-Flash"
    return Path(os.environ.get("DSV4_REAL_CONFIG_DIR") or default)


def two_layer_model(cpu_smoke: bool):
    """(device, ModelArgs) of the GPU diagnostics (bench/gpu_profile.py, gpu_diverge.py): DeepSeek-V4-Flash cut to
    one CSA and one HCA layer on CUDA (end_to_end.bench_args), or dsv4-tiny cut so on the CPU for a smoke run
    (the caller sets TRITON_INTERPRET first). Exits with a message when neither applies."""
    import sys

    from bench.gpu_cases.end_to_end import bench_args
    from dsv4serve.model.args import read_model_args

    if cpu_smoke:
        from dsv4serve.env import read_environment
        from dsv4serve.tiny.builder import ensure_tiny

        return torch.device("cpu"), bench_args(read_model_args(ensure_tiny(read_environment().cache_dir)))
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: pass --cpu-smoke to check the code path")
    return torch.device("cuda"), bench_args(read_model_args(real_config_dir()))


@dataclass(frozen=True)
class GpuCase:
    name: str  # e.g. "fp4_moe decode m=1"
    run: Callable[[], torch.Tensor]  # the kernel under test; returns its output
    reference: Callable[[], torch.Tensor]  # the torch reference on the same inputs
    atol: float
    rtol: float
    bytes_moved: int  # minimum bytes the kernel must read + write (for GB/s)
    flops: int = 0  # useful floating-point operations (for TFLOP/s); 0 when memory-bound only
    baseline: Callable[[], torch.Tensor] | None = None  # flashinfer / torch equivalent, when there is one
    baseline_name: str = ""
    bound: str = "memory"  # "memory" or "compute": which ceiling the ratio is taken against
