"""Torch reference of the routed-expert MoE with MXFP4 weights (dsv4-model.md §2.8, §2.10, §3.4),
step for step as `dsv4serve.model.moe.MoE` / `Expert` compute it with the FP8 simulation on:

  x_q, x_s = act_quant(x)                               per token, per 128 channels (e4m3, pow2 fp32)
  gate = bf16(x_deq @ W1[e]^T), up = bf16(x_deq @ W3[e]^T)    fp32 products, bf16 outputs
  gate = min(gate, limit); up = clamp(up, -limit, limit)      (when limit > 0)
  act  = bf16(w_route * (silu(gate) * up))                    fp32, silu in fp64 rounded to fp32
  y_e  = bf16(act_quant(act)_deq @ W2[e]^T)
  out[t] = sum over the token's k experts of y_e, in fp32  (the routed part; the caller adds the
           shared expert and rounds to bf16)

Weights: packed e2m1 int8/uint8 [E, N, K/2] (low nibble = even K) with e8m0 scales [E, N, K/32];
W1, W3 are [E, I, D/2], W2 is [E, D, I/2]. Routes are numbered flat = token * k + j (j < k).

`moe_align_ref` is the reference of the device-side route layout (dsv4_kernels.moe_align), written
plainly with host reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4_kernels.formats import dequant_fp4
from dsv4_kernels.fp8_gemm_ref import act_quant_fp8_ref, dequant_act_fp8_ref


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted route ids int32 [B * block_m], expert per block int32 [B]) with
    B = cdiv(T*k, block_m) + min(T*k, E): each used expert's routes in route order, padded to a multiple
    of block_m with the id T*k, experts in ascending order; the blocks past the used ones get expert -1."""
    flat = topk_ids.flatten().tolist()
    num_routes = len(flat)
    num_blocks = -(-num_routes // block_m) + min(num_routes, num_experts)
    sorted_ids = [num_routes] * (num_blocks * block_m)
    expert_ids = [-1] * num_blocks
    block = 0
    for e in range(num_experts):
        routes = [r for r, expert in enumerate(flat) if expert == e]
        n_blocks = -(-len(routes) // block_m)
        sorted_ids[block * block_m : block * block_m + len(routes)] = routes
        expert_ids[block : block + n_blocks] = [e] * n_blocks
        block += n_blocks
    return torch.tensor(sorted_ids, dtype=torch.int32), torch.tensor(expert_ids, dtype=torch.int32)


def _expert_weight(packed: torch.Tensor, scale: torch.Tensor, e: int) -> torch.Tensor:
    return dequant_fp4(packed[e], scale[e])  # exact fp32 [N, K]


def gate_up_ref(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w3: torch.Tensor,
    w3_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """x_q e4m3 [T, D], x_scale fp32 [T, ceil(D/128)], topk [T, k] -> act [T*k, I] fp32 holding
    bf16-rounded values (the input of w2 before its FP8 quantization)."""
    t, k = topk_ids.shape
    x = dequant_act_fp8_ref(x_q, x_scale)
    act = torch.empty(t * k, w1.shape[1], dtype=torch.float32, device=x_q.device)
    for e in topk_ids.unique().tolist():
        rows, slot = torch.where(topk_ids == e)
        xe = x[rows]
        gate = xe.matmul(_expert_weight(w1, w1_scale, e).t()).to(torch.bfloat16).float()
        up = xe.matmul(_expert_weight(w3, w3_scale, e).t()).to(torch.bfloat16).float()
        if limit > 0:
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
        a = F.silu(gate.double()).float() * up
        a = topk_weights[rows, slot, None].float() * a
        act[rows * k + slot] = a.to(torch.bfloat16).float()
    return act


def down_ref(
    act_q: torch.Tensor, act_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """act_q e4m3 [T*k, I], act_scale fp32 [T*k, ceil(I/128)] -> per-slot expert outputs bf16 [T*k, D]."""
    flat_ids = topk_ids.flatten()
    a = dequant_act_fp8_ref(act_q, act_scale)
    y = torch.empty(flat_ids.numel(), w2.shape[1], dtype=torch.bfloat16, device=act_q.device)
    for e in flat_ids.unique().tolist():
        slots = torch.where(flat_ids == e)[0]
        y[slots] = a[slots].matmul(_expert_weight(w2, w2_scale, e).t()).to(torch.bfloat16)
    return y


def fp4_moe_ref(
    x: torch.Tensor,
    w1: torch.Tensor,
    w1_scale: torch.Tensor,
    w3: torch.Tensor,
    w3_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """x [T, D] (bf16) -> routed-expert sum fp32 [T, D]."""
    t, k = topk_ids.shape
    x_q, x_s = act_quant_fp8_ref(x)
    act = gate_up_ref(x_q, x_s, w1, w1_scale, w3, w3_scale, topk_weights, topk_ids, limit)
    act_q, act_s = act_quant_fp8_ref(act)
    y = down_ref(act_q, act_s, w2, w2_scale, topk_ids)
    return y.float().view(t, k, -1).sum(dim=1)
