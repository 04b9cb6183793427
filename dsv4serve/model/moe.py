"""Mixture of experts (dsv4-model.md §2.8): sqrt-softplus router, bias-only selection, hash routing
on the first `n_hash_layers` layers, clamped SwiGLU experts, routed scaling, one shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4serve.model.args import ModelArgs
from dsv4serve.model.layers import Linear
from dsv4serve.model.numerics import Numerics, act_quant, in_fp64, matmul


class Gate(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.topk = args.n_activated_experts
        self.score_func = args.score_func
        self.route_scale = args.route_scale
        self.norm_topk_prob = args.norm_topk_prob
        self.hash = args.is_hash_layer(layer_id)
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim))
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, self.topk, dtype=torch.int64))
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(args.n_routed_experts))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor,
                num: Numerics) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k] fp32, expert ids [N, k] int64)."""
        logits = matmul(x.float(), self.weight.float(), num)
        if self.score_func == "softmax":
            scores = in_fp64(lambda z: z.softmax(dim=-1), logits)
        elif self.score_func == "sigmoid":
            scores = in_fp64(torch.sigmoid, logits)
        else:
            scores = in_fp64(lambda z: F.softplus(z).sqrt(), logits)
        if self.hash:
            ids = self.tid2eid[token_ids].long()
        else:
            ids = (scores + self.bias.float()).topk(self.topk, dim=-1).indices  # bias selects only
        weights = scores.gather(1, ids)
        if self.score_func != "softmax" and self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.route_scale, ids


class Expert(nn.Module):
    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, fp8_act=True)
        self.w2 = Linear(inter_dim, dim, fp8_act=True)
        self.w3 = Linear(dim, inter_dim, fp8_act=True)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor, num: Numerics, weights: torch.Tensor | None = None) -> torch.Tensor:
        """x [n, D] already through `act_quant` -> [n, D] compute dtype; the routing weight [n, 1]
        scales before w2, in fp32."""
        gate = self.w1(x, num, x_quantized=True).float()
        up = self.w3(x, num, x_quantized=True).float()
        if self.swiglu_limit > 0:
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        act = in_fp64(F.silu, gate) * up
        if weights is not None:
            act = weights * act
        return self.w2(act.to(num.compute_dtype), num)


class MoE(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.gate = Gate(layer_id, args)
        self.experts = nn.ModuleList(Expert(args.dim, args.moe_inter_dim, args.swiglu_limit)
                                     for _ in range(args.n_routed_experts))
        shared_dim = args.n_shared_experts * args.moe_inter_dim
        self.shared_experts = Expert(args.dim, shared_dim, args.swiglu_limit)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, num: Numerics) -> torch.Tensor:
        """x [N, D] compute dtype, token_ids [N] -> [N, D] compute dtype."""
        weights, ids = self.gate(x, token_ids, num)
        x = act_quant(x, num)  # the FP8 input of every expert, quantized once
        y = torch.zeros(x.shape, dtype=torch.float32)
        counts = torch.bincount(ids.flatten(), minlength=len(self.experts)).tolist()
        for e, count in enumerate(counts):
            if count == 0:
                continue
            rows, slot = torch.where(ids == e)
            y.index_add_(0, rows, self.experts[e](x[rows], num, weights[rows, slot, None]).float())
        y += self.shared_experts(x, num).float()
        return y.to(num.compute_dtype)
