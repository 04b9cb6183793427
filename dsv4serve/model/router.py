"""The MoE router (dsv4-model.md §2.8): which routed experts each token takes, and with which weights.

fp32 logits of x against the gate weight, the score function in fp64 (sqrt-softplus for DeepSeek-V4, softmax or
sigmoid), top-k by score + bias (the bias only selects) or, on the first `n_hash_layers` layers, the token id's
fixed experts (`tid2eid`); the chosen scores normalized (not after softmax) and times the routed scaling.

With `num.backends.router == "triton"` it is dsv4_kernels.router (two launches, one on a hash layer, no host
sync); this torch path is its reference (kernels/dsv4_kernels/router_ref.py mirrors it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv4serve.model.args import ModelArgs
from dsv4serve.model.numerics import Numerics, in_fp64, matmul


class Gate(nn.Module):
    tid2eid: torch.Tensor  # hash layers: [vocab, k] int64, a buffer

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.topk = args.n_activated_experts
        self.score_func = args.score_func
        self.route_scale = args.route_scale
        self.norm_topk_prob = args.norm_topk_prob
        self.hash = args.is_hash_layer(layer_id)
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim))
        self.bias: nn.Parameter | None
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, self.topk, dtype=torch.int64))
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(args.n_routed_experts))

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor, num: Numerics, route_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k] fp32, expert ids [N, k] int64); `route_rows` [N] int32: token t takes
        token route_rows[t]'s routing (model/batch.py's BatchLayout.route_rows)."""
        if num.backends.router == "triton":
            return self._kernel(x, token_ids, route_rows)
        if route_rows is not None:  # two gathers: the torch path runs padded buckets only on the CPU
            x, token_ids = x.index_select(0, route_rows), token_ids.index_select(0, route_rows)
        logits = matmul(x.float(), self.weight.float(), num)
        if self.score_func == "softmax":
            scores = in_fp64(lambda z: z.softmax(dim=-1), logits)
        elif self.score_func == "sigmoid":
            scores = in_fp64(torch.sigmoid, logits)
        else:
            scores = in_fp64(lambda z: F.softplus(z).sqrt(), logits)
        if self.bias is None:
            ids = self.tid2eid[token_ids].long()
        else:
            ids = (scores + self.bias.float()).topk(self.topk, dim=-1).indices  # bias selects only
        weights = scores.gather(1, ids)
        if self.score_func != "softmax" and self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.route_scale, ids

    def _kernel(
        self, x: torch.Tensor, token_ids: torch.Tensor, route_rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same in two Triton launches (one on a hash layer without softmax), no host sync. Exact
        ties of score + bias go to the lower expert id (torch's CPU topk orders them arbitrarily)."""
        from dsv4_kernels.router import router  # lazy: kernel modules build their kernels on import

        table, tokens = (self.tid2eid, token_ids) if self.hash else (None, None)
        return router(
            x,
            self.weight,
            self.bias,
            self.topk,
            self.score_func,
            self.route_scale,
            self.norm_topk_prob,
            table,
            tokens,
            route_rows=route_rows,
        )
