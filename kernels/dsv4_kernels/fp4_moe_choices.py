"""Launch choices of the grouped MXFP4 GEMM (fp4_moe.py): the route-block and K tiles per phase and arch, the
warps, the K loop's form, and the card's measured choices for decode (tuning.py, tuned/<GPU>.json)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dsv4_kernels import tuning
from dsv4_kernels.split_k import k_splits_allowed


@dataclass(frozen=True)
class LoopForm:
    """How the GEMM kernel walks K (its EVEN_ODD / PREFETCH / SPLIT_K / LATE_SCALE constexprs; the kernel's doc)."""

    even_odd: bool = False
    prefetch: bool = False
    split_k: int = 1
    late_scale: bool = False

    def __post_init__(self) -> None:
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")
        if self.late_scale and (self.even_odd or self.prefetch):
            raise ValueError("late_scale is its own K loop: it takes neither even_odd nor prefetch")

    @property
    def name(self) -> str:
        forms = (("even_odd", self.even_odd), ("prefetch", self.prefetch), ("late_scale", self.late_scale))
        parts = [p for p, on in forms if on]
        return "+".join(parts + ([f"split{self.split_k}"] if self.split_k > 1 else [])) or "joined"


def pick_block_m(num_routes: int, num_experts: int) -> int:
    """Decode (a few routes per expert) takes the smallest dot tile, 16; prefill 64."""
    return 16 if num_routes <= 4 * num_experts else 64


def pick_block_k(block_m: int, gate_up: bool = False, device: torch.device | None = None) -> int:
    """The down GEMM: 128 (one activation scale block per step) for decode blocks, 64 for 64-row blocks,
    whose [BLOCK_K, BLOCK_M] activation operand each warp holds whole on mma.sync GPUs (at 128 it spills).
    The gate/up form holds two [128, BLOCK_M] fp32 accumulators and two weight tiles: 64, and 32 for
    64-row blocks on GPUs without wgmma (Hopper's wgmma reads that operand from shared memory)."""
    if not gate_up:
        return 128 if block_m < 64 else 64
    return 32 if block_m >= 64 and not _has_wgmma(device) else 64


def _has_wgmma(device: torch.device | None) -> bool:
    """True on sm_90 / sm_100 (and under the interpreter, which has no arch: the tests take the sm_90 tiles)."""
    if device is None or device.type != "cuda":
        return True
    return _sm_major(device.index if device.index is not None else torch.cuda.current_device()) in (9, 10)


@functools.cache
def _sm_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def _num_warps(gate_up: bool, block_m: int) -> int:
    """LAUNCH_OPTIONS below: 8 for the gate/up tiles (two weight tiles dequantized a step: at batch-1 decode on
    an H200, bench/gpu_fp4_sweep.py, 8 warps took 183 us where 4 took 258, the best of BLOCK_K 32 / 64 / 128
    and 2-4 stages; the 64-row prefill tile holds two [128, 64] fp32 accumulators), 4 for the down GEMM
    (8 were slower there at every tile)."""
    return 8 if gate_up else 4


def tuned_choice(gemm: str, num_routes: int, block_m: int, device: torch.device) -> dict:
    """The card's measured choice for this decode GEMM (tuning.py); {} for none, for prefill tiles, or when the
    start-up check switched the tuned forms off (split_k.allow_k_splits)."""
    if block_m != 16 or not k_splits_allowed():
        return {}
    return tuning.lookup(device, "fp4_moe", gemm, size=num_routes) or {}


def loop_form_for(choice: dict, k: int, block_k: int) -> LoopForm:
    """The choice's K loop; its split dropped where split x BLOCK_K does not divide this shape's K."""
    split = int(choice.get("split_k", 1))
    return LoopForm(
        bool(choice.get("even_odd")),
        bool(choice.get("prefetch")),
        1 if k % (split * block_k) else split,
        bool(choice.get("late_scale")),
    )
