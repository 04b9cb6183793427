"""Routed experts computed on the CPU by kt-kernel (KTransformers' CPU MoE kernels), from host memory.

    ok, why = kt_kernel_available()     # no import of kt-kernel (nor torch) here
    threads = kt_threads()              # every usable core but one, a subpool per NUMA node
    ext, build = load_kt()              # the extension, and its CPU build (avx2, avx512_*, amx)

kt_experts.KtExperts holds the MoE objects (one per layer) and runs the forwards.

The low-level `kt_kernel_ext` API only (a CPUInfer over a WorkerPoolConfig, one MXFP4 MoE object per
layer); never `KTMoEWrapper`, which loads only from safetensors files, assumes an accelerator, and
with CPU tensors silently returns zeros unless KT_FORCE_SYNC_SUBMIT=1.

Numerics (checked bit for bit in tests/unit/test_kt_experts.py): the weights are the checkpoint's
MXFP4 as the bank holds them (int8 [out, in/2], low nibble first) with the E8M0 scale bytes shifted
into bf16 bit patterns (byte << 7: sign 0, the byte as exponent, mantissa 0; exact for bytes 1..254;
byte 0, 2^-127, is the bf16 subnormal 0x0040). Per expert gate and up are rounded to bf16, clamped
(swiglu_limit), SwiGLU'd and rounded to bf16, projected down and rounded to bf16; the experts'
outputs are then summed with the routing weights (fp32 in) and rounded to bf16. Unlike the device
path (the SwiGLU output scaled by the routing weight and quantized to FP8 before w2, model/moe.py) the
down projection's input stays bf16, so the two paths agree within that FP8 rounding, not bit for bit.

`on_device` [E] bool is the layer's GPU-expert mask, which kt-kernel reads live at every forward: the
experts marked there are skipped (computed on the device path). kt-kernel keeps its own copy of the
weights (about 1.3x the packed bytes, memory/host_plan.py counts it), so the bank may drop a layer
after the hand-over.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("dsv4serve.worker")

KT_VERSION = "0.7.2"  # the version the numerics above were checked against
KT_MAX_TOKENS = 256  # tokens per kt-kernel forward (its buffers are sized for it; longer inputs go in pieces)
KT_GROUP = 32  # MXFP4 group size: both expert dims must be multiples of it
_EXTRA_MODULES = ("gguf",)  # kt_kernel imports it at load (its GGUF loader) though we never use it


def kt_kernel_available() -> tuple[bool, str]:
    """(installed, why): looks for the package and the modules it imports at load without importing any."""
    if importlib.util.find_spec("kt_kernel") is None:
        return False, f"kt-kernel is not installed (pip install --no-deps kt-kernel=={KT_VERSION} gguf)"
    missing = [m for m in _EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return False, f"kt-kernel is installed but imports {', '.join(missing)} at load: pip install --no-deps gguf"
    return True, "kt-kernel installed"


def kt_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kt-kernel")
    except PackageNotFoundError:
        return None


def load_kt():
    """The extension module (kt_kernel_ext) and its CPU build ('avx2', 'avx512_bf16', 'amx', ...)."""
    import kt_kernel  # imports torch, numpy, safetensors, gguf; picks the build for this CPU
    import torch

    # the import turns on flush-to-zero / denormals-are-zero on the importing thread (kt-kernel 0.7.2): put
    # torch's default back, so the device path's CPU arithmetic (and the tests' oracles) keep subnormals
    torch.set_flush_denormal(False)
    return kt_kernel.kt_kernel_ext, str(kt_kernel.__cpu_variant__)


# --------------------------------------------------------------------------------------- threads


@dataclass(frozen=True)
class KtThreads:
    numa_nodes: tuple[int, ...]  # one worker subpool per node
    threads: tuple[int, ...]  # threads per subpool

    @property
    def total(self) -> int:
        return sum(self.threads)

    def describe(self) -> str:
        per = ", ".join(f"node {n}: {t}" for n, t in zip(self.numa_nodes, self.threads, strict=True))
        return f"{self.total} thread(s) ({per})"


def _cpulist(text: str) -> set[int]:
    """`0-3,8,10-11` -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_cpus(root: Path = Path("/sys/devices/system/node")) -> dict[int, set[int]]:
    """NUMA node -> its CPUs, from sysfs ({} when the machine does not say)."""
    nodes = {}
    for path in sorted(root.glob("node[0-9]*")):
        cpulist = path / "cpulist"
        if cpulist.exists():
            nodes[int(path.name[4:])] = _cpulist(cpulist.read_text())
    return nodes


def kt_threads(usable: set[int] | None = None, nodes: dict[int, set[int]] | None = None) -> KtThreads:
    """Every usable core but one (the worker's own loop drives the device and submits to kt-kernel), in
    one subpool per NUMA node that has usable cores, each node's share in proportion to its cores."""
    usable = usable if usable is not None else set(os.sched_getaffinity(0))
    nodes = numa_cpus() if nodes is None else nodes
    per_node = {n: len(cpus & usable) for n, cpus in sorted(nodes.items()) if cpus & usable}
    total = max(1, len(usable) - 1)
    if len(per_node) <= 1:
        return KtThreads((next(iter(per_node), 0),), (total,))
    shares = {n: max(1, total * c // len(usable)) for n, c in per_node.items()}
    first = next(iter(shares))
    shares[first] += max(0, total - sum(shares.values()))  # the rounding's remainder
    return KtThreads(tuple(shares), tuple(shares.values()))


# --------------------------------------------------------------------------------------- experts


@dataclass(frozen=True)
class KtGeometry:
    n_experts: int
    topk: int
    dim: int  # hidden size D
    inter_dim: int  # expert intermediate size I
    swiglu_limit: float

    def check(self) -> None:
        bad = [f"{n} {v}" for n, v in (("dim", self.dim), ("moe_inter_dim", self.inter_dim)) if v % KT_GROUP]
        if bad:
            raise ValueError(f"kt-kernel's MXFP4 experts need dims that are multiples of {KT_GROUP}: {', '.join(bad)}")


def e8m0_as_bf16(scale):
    """E8M0 bytes uint8 [...] -> the same powers of two as bf16 [...], by moving the byte into bf16's
    exponent field (exact; byte 0 = 2^-127 is the bf16 subnormal 0x0040)."""
    import torch

    bits = scale.view(torch.uint8).to(torch.int32) << 7
    bits = torch.where(bits == 0, 0x0040, bits)
    return bits.to(torch.int16).view(torch.bfloat16).contiguous()
