"""Torch reference of the shared expert (dsv4-model.md §2.8, §2.10) with FP8 weights, step for step as
`dsv4serve.model.moe.Expert` computes it with the FP8 simulation on (fp8_act, bf16 compute dtype):

  gate = bf16(act_quant(x) @ W1^T), up = bf16(act_quant(x) @ W3^T)   fp32 sums of exact products
  gate = min(gate, limit); up = clamp(up, -limit, limit)            (when limit > 0)
  act  = bf16(silu(gate) * up)                                       silu in fp64 rounded to fp32
  out  = bf16(act_quant(act) @ W2^T)

W1, W3 e4m3 [I, D] and W2 e4m3 [D, I] with e8m0 scales per 128 x 128 block, as the checkpoint stores
them; act_quant is per token per 128 channels (fp8_gemm_ref.act_quant_fp8_ref).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4_kernels.fp8_gemm_ref import act_quant_fp8_ref, fp8_gemm_ref, fp8_linear_ref


def fp8_swiglu_ref(
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w3: torch.Tensor,
    w3_scale: torch.Tensor,
    limit: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, D] -> the FP8 input of w2: (e4m3 [M, I], fp32 scales [M, ceil(I/128)])."""
    gate = fp8_linear_ref(x, w1, w1_scale).float()
    up = fp8_linear_ref(x, w3, w3_scale).float()
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    act = F.silu(gate.double()).float() * up
    return act_quant_fp8_ref(act.to(torch.bfloat16))


def shared_expert_ref(
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w3: torch.Tensor,
    w3_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """x [M, D] -> bf16 [M, D]."""
    q, s = fp8_swiglu_ref(x, w1, w1_scale, w3, w3_scale, limit)
    return fp8_gemm_ref(q, s, w2, w2_scale).to(torch.bfloat16)
