"""The official arithmetic that the checkpoint was trained with, as switchable simulations.

DeepSeek's reference (`inference/model.py`, `kernel.py`; dsv4-model.md §2.10) runs:
- FP8 activation quantization per 128 channels before every projection the checkpoint stores in
  FP8 or FP4 (`fp8_act`);
- a quantize-dequantize of the KV nope dims to FP8 with blocks of 64 (`kv_fp8`);
- a Hadamard rotation plus an FP4 (e2m1, blocks of 32) quantize-dequantize of the indexer q and k
  (`indexer_fp4`).
Scales are ue8m0 powers of two: s = 2^ceil(log2(max(amax, floor) / max_code)).

A dimension that is not a multiple of the block size (tiny test models) quantizes its last
partial block as a block of its own; the real model never has one.

`NUMERICS_OFF` reproduces transformers' arithmetic (no simulation, fp32 activations).

`batch_invariant` makes every token's arithmetic independent of which other tokens share the
forward: projections run one token at a time (a CPU GEMM's sum order depends on the row count),
and attention gathers exactly each query's keys. With the fp64-rounded transcendental functions
(`in_fp64`, always on) and the indexer's stable tie-break, the logits are bitwise the same for any
chunking and batching, which the quantizers need (a one-ulp difference can flip an FP8 rounding).
On the CPU it costs little in decode and slows multi-token prefill; the CUDA worker turns it off
(one kernel launch per token would leave the GPU waiting on launches).

`backends` picks torch or Triton per kernel (model/backends.py); the Triton paths are not batch
invariant (their sums run in tile order) and are checked against the torch path by tolerance.
The FP8 GEMM and MXFP4 MoE kernels always quantize activations and round to bf16, so they require
`fp8_act` and a bf16 compute dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsv4_kernels.formats import E2M1_VALUES, FP4_MAX, FP8_MAX
from dsv4serve.model.backends import TORCH, KernelBackends
from dsv4serve.model.fp8_cpu import fp8_quant_dequant_cpu
from dsv4serve.model.hadamard_cpu import hadamard_cpu

FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6.0 * 2.0**-126
ACT_BLOCK = 128  # FP8 activation block along K (kernel.py act_quant)
KV_BLOCK = 64  # FP8 QAT block on the KV nope dims
FP4_BLOCK = 32  # FP4 QAT block on the indexer q / k


@dataclass(frozen=True)
class Numerics:
    fp8_act: bool = True
    kv_fp8: bool = True
    indexer_fp4: bool = True
    compute_dtype: torch.dtype = torch.bfloat16  # dtype of activations between fp32 islands
    batch_invariant: bool = True
    backends: KernelBackends = TORCH

    def __post_init__(self) -> None:
        fixed = [k for k in ("fp8_gemm", "fp4_moe") if getattr(self.backends, k) == "triton"]
        if fixed and not (self.fp8_act and self.compute_dtype == torch.bfloat16):
            raise ValueError(
                f"the Triton {', '.join(fixed)} kernel(s) quantize activations to FP8 and round to "
                "bf16: they need fp8_act=True and compute_dtype=bfloat16"
            )


NUMERICS_OFF = Numerics(fp8_act=False, kv_fp8=False, indexer_fp4=False, compute_dtype=torch.float32)
NUMERICS_ON = Numerics()


def _blocked(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """[..., K] fp32 -> [..., ceil(K/block), block], zero-padding the last partial block."""
    k = x.shape[-1]
    pad = (-k) % block
    if pad:
        x = F.pad(x, (0, pad))
    return x.unflatten(-1, (-1, block)), k


def _pow2_ceil(ratio: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= ratio, for positive normal fp32 ratios (the amax floors keep them so):
    the exponent field rounded up when a mantissa bit is set. The value of formats.pow2_ceil (frexp,
    compare, ldexp) in 3 ops instead of 6: these run before every projection of the reference path."""
    return ((ratio.view(torch.int32) + 0x7FFFFF) & -0x800000).view(torch.float32)


def _blocks_back(q: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., n, block] fp32 -> [..., k] in dtype (cutting the zero padding of a partial last block)."""
    flat = q.flatten(-2)
    return (flat if flat.shape[-1] == k else flat[..., :k]).to(dtype)


def fp8_quant_dequant(x: torch.Tensor, block: int) -> torch.Tensor:
    """Round x to e4m3 with one ue8m0 scale per `block` channels; same shape and dtype as x. On the CPU one compiled
    call (model/fp8_cpu.py), bit for bit these ops."""
    if x.device.type == "cpu" and x.numel():
        y = fp8_quant_dequant_cpu(x, block, FP8_AMAX_FLOOR, FP8_MAX)
        if y is not None:
            return y
    return fp8_quant_dequant_torch(x, block)


def fp8_quant_dequant_torch(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp8_quant_dequant as torch ops: every device's path but the CPU's compiled one, and the reference that one is
    held to (tests/unit/test_fp8_cpu.py)."""
    xb, k = _blocked(x.float(), block)
    scale = _pow2_ceil(xb.abs().amax(dim=-1, keepdim=True).clamp_min_(FP8_AMAX_FLOOR).div_(FP8_MAX))
    q = (xb / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return _blocks_back(q.mul_(scale), k, x.dtype)


@functools.cache
def _e2m1_bounds(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the 8 e2m1 magnitudes, the 7 fp32 bounds between them) on `device`, made once: a bound is the
    midpoint of two neighbours, one ulp lower where a tie must go to the upper (even) code, so that the
    number of bounds below |v| is the code round-to-nearest-even gives."""
    with torch.inference_mode(False), torch.no_grad():
        mags = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=device)
        mid = (mags[1:] + mags[:-1]) / 2  # exact: 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5
        lower = torch.nextafter(mid, torch.zeros_like(mid))
        odd = torch.arange(7, device=device) % 2 == 1  # between codes 1|2, 3|4, 5|6: the tie goes up
        return mags, torch.where(odd, lower, mid)


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """v fp32, |v| <= 6 -> the nearest e2m1 value (ties to the even code), sign kept: formats.round_e2m1's
    values in 2 ops (a bucketize) instead of its ~10 over [..., 8] distance tensors. From E2M1_ROUND_ELEMENTS
    on, the grid's steps instead (0.5 below 2, 1 below 4, 2 above: |v| / step rounded half to even is the
    code's parity, every op exact): more ops, but none a per-element binary search (8,192 values: ~60 us
    -> ~40 on this project's CPU; bit for bit, tests/unit/test_numerics_e2m1.py)."""
    if v.numel() >= E2M1_ROUND_ELEMENTS:
        a = v.abs()
        step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
        return torch.copysign(torch.round(a / step) * step, v)
    mags, bounds = _e2m1_bounds(v.device)
    return torch.copysign(mags[torch.bucketize(v.abs(), bounds)], v)


E2M1_ROUND_ELEMENTS = 4096  # below it the bucketize's 2 ops cost less than the step form's 6


def fp4_quant_dequant(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Round x to e2m1 with one ue8m0 scale per `block` channels; same shape and dtype as x."""
    xb, k = _blocked(x.float(), block)
    scale = _pow2_ceil(xb.abs().amax(dim=-1, keepdim=True).clamp_min_(FP4_AMAX_FLOOR).div_(FP4_MAX))
    q = _round_e2m1((xb / scale).clamp_(-FP4_MAX, FP4_MAX))
    return _blocks_back(q.mul_(scale), k, x.dtype)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim (a power of two), in >= fp32."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two dim, got {n}")
    y = x.to(torch.promote_types(x.dtype, torch.float32))
    if y.device.type == "cpu" and y.dtype == torch.float32 and not y.requires_grad:  # compiled (hadamard_cpu)
        fresh = y if y.data_ptr() != x.data_ptr() else y.clone()  # transformed in place: never x's memory
        flat = fresh.reshape(-1, n).contiguous()
        if hadamard_cpu(flat.numpy()):
            return flat.view(x.shape).to(x.dtype)
    h = 1
    while h < n:  # butterfly stages: pairs (i, i + h) inside blocks of 2h
        y = y.unflatten(-1, (-1, 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * n**-0.5).to(x.dtype)


def in_fp64(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) evaluated in fp64 and rounded back to x's dtype.

    CPU kernels evaluate transcendental functions (exp, sigmoid, cos, ...) with vector code for the
    bulk of a tensor and other code for its tail, so an fp32 result can differ by an ulp with the
    tensor's size. In fp64 those differences vanish in the final rounding: batch invariance.
    """
    return fn(x.double()).to(x.dtype)


def matmul(x: torch.Tensor, weight: torch.Tensor, num: Numerics) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T in x's dtype; one token at a time when batch-invariant."""
    if not num.batch_invariant:
        return F.linear(x, weight)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 1:  # decode: the very same call as one row of a prefill
        out = F.linear(rows.clone(), weight)
    else:
        out = torch.cat([F.linear(rows[i : i + 1].clone(), weight) for i in range(rows.shape[0])])
    return out.view(*x.shape[:-1], weight.shape[0])


def exact_sums(num: Numerics) -> bool:
    """Whether a row-parallel projection (`row_product`) sums its products in fp64. With FP8 activations and
    FP8 / MXFP4 weights every product has at most 8 significant bits, and their sum over K in fp64 is exact
    (the products' binades, plus 8 bits, plus log2 K of carries, stay within fp64's 53; an fp32 sum of the
    FP8-weight shared expert's w2 rounded ~5% of dsv4-tiny-split's outputs), so the order of the sum no
    longer matters: a projection split over ranks (each rank's share over its K columns, the shares added
    by the all-reduce in any order) equals the unsplit one bit for bit, which --batch-invariant promises
    (tests/e2e/test_tensor_parallel.py; an fp32 sum in MKL's order matched on an AVX2 CPU and missed one
    element of a prefill on an AVX-512 one, which turned one greedy token). Only under batch invariance."""
    return num.batch_invariant and num.fp8_act


def row_product(x: torch.Tensor, weight: torch.Tensor, num: Numerics, partial: bool) -> torch.Tensor:
    """x [..., K] (already through `act_quant`) @ weight [N, K]^T for a projection that a split model runs row
    parallel (attention's wo_b, the experts' w2). `partial`: a rank's share, uncast for the all-reduce (fp64
    under `exact_sums`, else the weight's dtype), finished by `reduced`; else the product in the compute
    dtype, through the same roundings as a reduced share (fp64 -> fp32 -> compute dtype)."""
    dtype = torch.float64 if exact_sums(num) else weight.dtype
    out = matmul(x.to(dtype), weight.to(dtype), num)  # one token at a time under batch invariance, as any projection
    return out if partial else reduced(out, num)


def as_share(part: torch.Tensor) -> torch.Tensor:
    """A row-parallel share as the all-reduce adds it: fp64 kept (`exact_sums`), anything else in fp32."""
    return part if part.dtype == torch.float64 else part.float()


def reduced(total: torch.Tensor, num: Numerics) -> torch.Tensor:
    """A row-parallel product's shares summed over the ranks (or the whole product) -> the compute dtype,
    through fp32: one rank and a split round alike."""
    return total.float().to(num.compute_dtype)


def act_quant(x: torch.Tensor, num: Numerics) -> torch.Tensor:
    """The FP8 activation simulation of an FP8/FP4 projection's input (identity when off)."""
    return fp8_quant_dequant(x, ACT_BLOCK) if num.fp8_act else x


def linear(
    x: torch.Tensor, weight: torch.Tensor, num: Numerics, fp8_act: bool, x_quantized: bool = False
) -> torch.Tensor:
    """y = x W^T, output in the compute dtype.

    `fp8_act` marks a projection the checkpoint stores in FP8/FP4: with the simulation on, its
    input is quantized per 128 channels first (`x_quantized`: the caller already did, for an input
    shared by two projections; quantizing is idempotent, so this only saves time). The product runs
    in the weight's dtype (fp32 by default: dequantized FP8/FP4 weights and e4m3 activations are
    exact there, like the kernel's fp32 accumulation).
    """
    if fp8_act and num.fp8_act and not x_quantized:
        x = fp8_quant_dequant(x, ACT_BLOCK)
    return matmul(x.to(weight.dtype), weight, num).to(num.compute_dtype)
