"""Mixture of experts (dsv4-model.md §2.8): sqrt-softplus router, bias-only selection, hash routing
on the first `n_hash_layers` layers, clamped SwiGLU experts, routed scaling, one shared expert.

The routed experts are either resident modules (`experts`) or, when the memory plan offloads them,
packed MXFP4 slots lent one at a time by an expert-slot cache (`use_expert_cache`, see
dsv4serve/experts/). The two paths run the same expert arithmetic on the same dequantized values
and sum the experts' outputs in the same (ascending expert) order, so their results are identical.
"""

from __future__ import annotations

from typing import Iterator, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dsv4serve.model.args import ModelArgs
from dsv4serve.model.layers import Linear
from dsv4serve.model.numerics import Numerics, act_quant, in_fp64, linear, matmul
from dsv4serve.model.quant import dequant_fp4


class ExpertSource(Protocol):
    """Lends each routed expert's packed MXFP4 parts (`w1`, `w1_scale`, ... as the checkpoint stores
    them), in an order of its choosing; a lent slot stays valid until the next one is asked for."""

    def layer_experts(self, layer: int, experts: list[int],
                      token_ids: torch.Tensor) -> Iterator[tuple[int, dict[str, torch.Tensor]]]: ...


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
        return swiglu_expert(x, self.w1.weight, self.w3.weight, self.w2.weight, self.swiglu_limit, num, weights)


def swiglu_expert(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, swiglu_limit: float,
                  num: Numerics, weights: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, D] already through `act_quant` -> [n, D] compute dtype; the routing weight [n, 1]
    scales before w2, in fp32. w1, w3 [I, D], w2 [D, I] dense."""
    gate = linear(x, w1, num, True, x_quantized=True).float()
    up = linear(x, w3, num, True, x_quantized=True).float()
    if swiglu_limit > 0:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    act = in_fp64(F.silu, gate) * up
    if weights is not None:
        act = weights * act
    return linear(act.to(num.compute_dtype), w2, num, True)


class MoE(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.n_routed_experts = args.n_routed_experts
        self.swiglu_limit = args.swiglu_limit
        self.gate = Gate(layer_id, args)
        self.experts = nn.ModuleList(Expert(args.dim, args.moe_inter_dim, args.swiglu_limit)
                                     for _ in range(args.n_routed_experts))
        shared_dim = args.n_shared_experts * args.moe_inter_dim
        self.shared_experts = Expert(args.dim, shared_dim, args.swiglu_limit)
        self.expert_source: ExpertSource | None = None

    def use_expert_cache(self, source: ExpertSource) -> None:
        """From now on the routed experts come from `source`; the resident copies are dropped (their
        weights are then no longer part of the state dict)."""
        self.experts = nn.ModuleList()
        self.expert_source = source

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor, num: Numerics) -> torch.Tensor:
        """x [N, D] compute dtype, token_ids [N] -> [N, D] compute dtype."""
        weights, ids = self.gate(x, token_ids, num)
        x = act_quant(x, num)  # the FP8 input of every expert, quantized once
        y = torch.zeros(x.shape, dtype=torch.float32)
        counts = torch.bincount(ids.flatten(), minlength=self.n_routed_experts).tolist()
        used = [e for e, count in enumerate(counts) if count]
        outs = self._cached(x, token_ids, ids, weights, used, num) if self.expert_source is not None else None
        for e in used:
            rows, slot = torch.where(ids == e)
            out = outs.pop(e) if outs is not None else self.experts[e](x[rows], num, weights[rows, slot, None])
            y.index_add_(0, rows, out.float())
        y += self.shared_experts(x, num).float()
        return y.to(num.compute_dtype)

    def _cached(self, x: torch.Tensor, token_ids: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                used: list[int], num: Numerics) -> dict[int, torch.Tensor]:
        """Each used expert's output [n_e, D], computed in the order the cache lends the slots."""
        assert self.expert_source is not None
        dtype = self.shared_experts.w1.weight.dtype  # the dtype the resident experts would be loaded in
        outs: dict[int, torch.Tensor] = {}
        for e, p in self.expert_source.layer_experts(self.layer_id, used, token_ids):
            w1, w3, w2 = (dequant_fp4(p[w], p[f"{w}_scale"], dtype) for w in ("w1", "w3", "w2"))
            rows, slot = torch.where(ids == e)
            outs[e] = swiglu_expert(x[rows], w1, w3, w2, self.swiglu_limit, num, weights[rows, slot, None])
        return outs
