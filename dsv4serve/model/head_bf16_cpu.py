"""The output head's product on the CPU from a bf16 copy of the head, for any number of rows: two kernels
(model/head_bf16_ir.py) compiled once per process by LLVM through llvmlite (numba's compiler, a dependency).

A checkpoint stores the head in bf16, so its fp32 values are exact in half the bytes. One decode row reads the
whole head (dsv4-tiny: 129,280 x 128) for 2 FLOPs a weight: memory-bound, and the bf16 copy halves the stream
(33 MB instead of 66). Sixteen rows are compute-bound: there oneDNN's fp32 kernel ran at this core's fp32 rate;
a bf16 row of y (the engine's: the final norm's output) goes through `vdpbf16ps`, two multiplies per lane an
instruction, and an fp32 row through fused multiply-adds with the accumulators held in registers. Both sum each
logit in one fixed order whatever the batch (module doc of head_bf16_ir.py; tests/unit/test_cpu_head.py holds
them bit for bit to that arithmetic), so a row's logits never depend on the rows beside it. Measured side by
side against MKL and oneDNN: `python bench/bench_cpu_head.py`.

Where llvmlite cannot compile (or the start-up probe in model/cpu_head.py finds the logits off MKL's), the fp32
head serves: MKL and oneDNN's blocked copy.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dsv4serve.model.head_bf16_ir import BLOCK, module_ir
from dsv4serve.model.numba_loops import failure, record_failure

log = logging.getLogger(__name__)

WHAT = "bf16 head"  # its name in the log and doctor's line
FMA_TILE = 4  # rows a tile in head_fma: 16 accumulators + 8 widened weights of AVX-512's 32 registers
DOT_TILE = 6  # rows a tile in head_dot: 24 accumulators + 4 weights (tiles of 4 / 6 / 7 timed: 6 best at 16 rows)
NARROW_TILE = 1  # without AVX-512 (16 registers of 8 lanes): one row a tile

_SIGNATURE = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
    ctypes.c_int64,
)  # fmt: skip


@dataclass(frozen=True)
class Kernels:
    """The compiled kernels (head_bf16_ir's `head_fma`, and `head_dot` where the CPU has AVX512_BF16) and the JIT
    engine that owns their code."""

    fma: Callable[..., None]
    dot: Callable[..., None] | None
    engine: object


@functools.cache
def compiled() -> Kernels | None:
    """The kernels, compiled for this CPU on the first call (~0.3 s); None where llvmlite cannot (logged once, the
    reason kept for numba_loops.failure(WHAT))."""
    try:
        kernels = _compile()
        log.debug("%s: compiled (%s)", WHAT, "fma and dot" if kernels.dot else "fma")
        return kernels
    except Exception as exc:  # llvmlite missing or failing on this machine: the fp32 head serves
        log.warning("llvmlite cannot compile the CPU's %s (%s); the fp32 head serves", WHAT, record_failure(WHAT, exc))
        return None


def _compile(avx2_only: bool = False) -> Kernels:
    """The kernels for this CPU, or with `avx2_only` for any x86-64 with AVX2 and FMA (LLVM's x86-64-v3: what a CPU
    without AVX-512 runs; the tests run it here)."""
    import llvmlite.binding as llvm  # lazy: only the CPU's torch path needs it

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    host = llvm.get_host_cpu_features()
    wide = not avx2_only and bool(host.get("avx512f"))
    dot = wide and bool(host.get("avx512bf16"))
    cpu, features = ("x86-64-v3", "") if avx2_only else (llvm.get_host_cpu_name(), host.flatten())
    source = module_ir(llvm.get_process_triple(), FMA_TILE if wide else NARROW_TILE, DOT_TILE if dot else None)
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=cpu, features=features, opt=3, codemodel="jitdefault"
    )
    module = llvm.parse_assembly(source)
    module.verify()
    passes = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
    passes.getModulePassManager().run(module, passes)
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    fma = _SIGNATURE(engine.get_function_address("head_fma"))
    return Kernels(fma, _SIGNATURE(engine.get_function_address("head_dot")) if dot else None, engine)


def warm_up() -> None:
    """Compile the kernels (raises where llvmlite cannot) and run each once."""
    if compiled() is None:
        raise RuntimeError(f"llvmlite could not compile the {WHAT}: {failure(WHAT)}")
    packed = pack(torch.zeros(BLOCK, 4))
    for dtype in (torch.float32, torch.bfloat16):
        logits(torch.zeros(3, 4, dtype=dtype), packed, BLOCK)


def exact_in_bf16(weight: torch.Tensor) -> bool:
    return bool(torch.equal(weight.to(torch.bfloat16).to(weight.dtype), weight))


def pack(weight: torch.Tensor) -> np.ndarray:
    """An fp32 head [vocab, dim] whose values are bf16 (`exact_in_bf16`), dim even -> its bf16 bits as pairs of
    channels [blocks, dim / 2, BLOCK] uint32 (channel 2k in the low half), the vocabulary zero-padded to whole
    blocks."""
    vocab, dim = weight.shape
    if dim % 2:
        raise ValueError(f"the bf16 head packs channels in pairs: dim {dim} is odd")
    n_blocks = -(-vocab // BLOCK)
    bits = torch.zeros(n_blocks * BLOCK, dim, dtype=torch.bfloat16, device=weight.device)
    bits[:vocab] = weight.detach().to(torch.bfloat16)
    pairs = bits.view(torch.int32).view(n_blocks, BLOCK, dim // 2).transpose(1, 2).contiguous()
    return pairs.numpy().view(np.uint32)


def logits(y: torch.Tensor, packed: np.ndarray, vocab: int) -> torch.Tensor:
    """y [rows, dim] fp32 or bf16 (rows >= 1) -> [rows, vocab] fp32 through the packed head: bf16 rows through
    `head_dot` where the CPU has it, every other row through `head_fma` (in fp32)."""
    rows, dim = y.shape
    if rows < 1 or dim != 2 * packed.shape[1] or y.dtype not in (torch.float32, torch.bfloat16) or y.is_cuda:
        raise ValueError(
            f"the bf16 head takes CPU rows of {2 * packed.shape[1]} in fp32 or bf16, not {tuple(y.shape)} {y.dtype}"
        )
    kernels = compiled()
    if kernels is None:
        raise RuntimeError(f"llvmlite could not compile the {WHAT}: {failure(WHAT)}")
    width = packed.shape[0] * BLOCK
    out = torch.empty(rows, width, dtype=torch.float32, device=y.device)
    if y.dtype == torch.bfloat16 and kernels.dot is not None:
        kernel, x = kernels.dot, y.detach().contiguous()
    else:
        kernel, x = kernels.fma, y.detach().float().contiguous()
    kernel(x.data_ptr(), rows, dim, packed.ctypes.data, packed.shape[0], out.data_ptr(), width)
    return out if width == vocab else out[:, :vocab].contiguous()
