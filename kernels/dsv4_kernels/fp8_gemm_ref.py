"""Torch reference of the FP8 block-scaled GEMM (dsv4-model.md §2.10, §3.3).

out[M, N] = sum over 128-wide K blocks kb of (A[:, kb] @ B[:, kb]^T) * a_scale[:, kb] * b_scale[n//128, kb]

Every e4m3 value times a power-of-two scale is exact in fp32, and so is the product of two of them
(4 + 4 significant bits), so dequantize-then-fp32-matmul equals the blocked sum up to fp32 summation
order: the kernel and this reference differ only by that order and by the final bf16 rounding.
"""

from __future__ import annotations

import torch

from dsv4_kernels.formats import FP8_MAX, dequant_fp8_block, pow2_ceil

FP8_BLOCK = 128  # K block of both scales, N block of the weight scale
FP8_AMAX_FLOOR = 1e-4  # dsv4serve.model.numerics.FP8_AMAX_FLOOR (the reference's act_quant floor)


def act_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (e4m3 [M, K], fp32 power-of-two scales [M, ceil(K/128)]).

    The same rule as `numerics.fp8_quant_dequant`: s = 2^ceil(log2(max(amax, 1e-4) / 448)) per token
    per 128 channels, the last partial block quantized on its own, q = e4m3(clamp(x / s, +-448)).
    """
    m, k = x.shape
    nkb = -(-k // FP8_BLOCK)
    padded = torch.zeros(m, nkb * FP8_BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    blocks = padded.view(m, nkb, FP8_BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp_min(FP8_AMAX_FLOOR)
    scale = pow2_ceil(amax / FP8_MAX)  # [M, nkb]
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(1)[:, :k].contiguous(), scale


def dequant_act_fp8_ref(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [M, K] with fp32 scales [M, ceil(K/128)] -> fp32 [M, K] (exact)."""
    k = q.shape[1]
    return q.float() * scale.repeat_interleave(FP8_BLOCK, 1)[:, :k]


def fp8_gemm_ref(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """a e4m3 [M, K], a_scale fp32 [M, ceil(K/128)], b e4m3 [N, K], b_scale e8m0 [ceil(N/128), ceil(K/128)]
    -> fp32 [M, N] (callers round to bf16, as the kernel's output does)."""
    a_deq = dequant_act_fp8_ref(a, a_scale)
    b_deq = dequant_fp8_block(b, b_scale)  # exact fp32
    return a_deq.double().matmul(b_deq.double().t()).float()  # fp64: the exact sum, rounded once


def fp8_linear_ref(x: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    """The whole FP8 projection as `numerics.linear` runs it: x [M, K] -> bf16 [M, N]."""
    q, s = act_quant_fp8_ref(x)
    return fp8_gemm_ref(q, s, b, b_scale).to(torch.bfloat16)
