"""Attention (dsv4-model.md §2.2-2.7): low-rank Q, one shared K=V head, a sliding window plus the
compressed entries of CSA / HCA layers, a per-head sink in the softmax denominator, inverse RoPE on
the output and the grouped low-rank output projection.

Projections run on all tokens of a batch at once; the stateful part (window, compressors, indexer,
core attention) runs row by row over `RowSpan`s of the packed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsv4serve.model.args import ModelArgs
from dsv4serve.model.compressor import Compressor
from dsv4serve.model.indexer import Indexer
from dsv4serve.model.layers import Linear, RMSNorm
from dsv4serve.model.numerics import KV_BLOCK, Numerics, act_quant, fp8_quant_dequant
from dsv4serve.model.rope import apply_rope, inv_freq, rope_cos_sin
from dsv4serve.model.kv_pool import LayerCache


@dataclass(frozen=True)
class RowSpan:
    begin: int  # first packed token of the row
    end: int
    start_pos: int  # absolute position of the row's first token
    slot: int  # the row's sequence slot in the KV pool
    pages: torch.Tensor  # [num_pages] int64, the row's page table


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [T, H, d], keys (= values) [L, d], allowed [T, L] bool, sink [H] -> [T, H, d] fp32.

    The sink logit joins only the denominator: o = sum_j e^(s_j - M) v_j / (sum_j e^(s_j - M) + e^(sink - M)).
    """
    kf = keys.float()
    s = torch.einsum("thd,ld->thl", q.float(), kf) * scale
    s = s.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    sink = sink.float().view(1, -1)
    m = torch.maximum(s.amax(dim=-1), sink)  # [T, H]
    p = torch.exp(s - m.unsqueeze(-1))
    denom = p.sum(dim=-1) + torch.exp(sink - m)
    return torch.einsum("thl,ld->thd", p, kf) / denom.unsqueeze(-1)


class Attention(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_head_dim = args.n_heads, args.head_dim, args.rope_head_dim
        self.window_size, self.eps = args.window_size, args.norm_eps
        self.n_groups, self.o_lora_rank = args.o_groups, args.o_lora_rank
        self.compress_ratio = args.compress_ratios[layer_id]
        self.softmax_scale = self.head_dim ** -0.5
        self.attn_sink = nn.Parameter(torch.empty(self.n_heads))
        self.wq_a = Linear(args.dim, args.q_lora_rank, fp8_act=True)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, fp8_act=True)
        self.wkv = Linear(args.dim, self.head_dim, fp8_act=True)
        self.kv_norm = RMSNorm(self.head_dim, args.norm_eps)
        # the reference dequantizes wo_a to bf16 and runs it as a plain grouped einsum
        self.wo_a = Linear(self.n_heads * self.head_dim // self.n_groups, self.n_groups * self.o_lora_rank, False)
        self.wo_b = Linear(self.n_groups * self.o_lora_rank, args.dim, fp8_act=True)
        self.compressor = Compressor(args, self.compress_ratio, self.head_dim, False) if self.compress_ratio else None
        self.indexer = Indexer(args, self.compress_ratio) if args.kind(layer_id) == "csa" else None
        self.register_buffer("freqs", inv_freq(args, bool(self.compress_ratio)), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, spans: list[RowSpan], cache: LayerCache,
                num: Numerics) -> torch.Tensor:
        """x [N, D] compute dtype (attn_norm output), positions [N] -> [N, D] compute dtype."""
        cos, sin = rope_cos_sin(self.freqs, positions)
        xq = act_quant(x, num)  # shared by wq_a and wkv
        qr = self.q_norm(self.wq_a(xq, num, x_quantized=True))  # [N, q_lora]
        q = self.wq_b(qr, num).unflatten(-1, (self.n_heads, self.head_dim))
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)
        q = apply_rope(q, cos, sin)  # [N, H, d]
        kv = apply_rope(self.kv_norm(self.wkv(xq, num, x_quantized=True)), cos, sin)  # [N, d]
        if num.kv_fp8:
            nope = self.head_dim - self.rope_head_dim
            kv = torch.cat((fp8_quant_dequant(kv[:, :nope], KV_BLOCK), kv[:, nope:]), dim=1)
        extras = self._compressed_inputs(x, qr, cos, sin, num)
        o = torch.empty(q.shape, dtype=num.compute_dtype, device=q.device)
        for span in spans:
            rows = slice(span.begin, span.end)
            o[rows] = self._attend_row(q[rows], kv[rows], span, cache, {k: v[rows] for k, v in extras.items()}, num)
        o = apply_rope(o, cos, sin, inverse=True)
        return self._project_out(o, num)

    def _compressed_inputs(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           num: Numerics) -> dict[str, torch.Tensor]:
        """Per-token inputs of the compressors and indexer, computed on all packed tokens at once."""
        out: dict[str, torch.Tensor] = {}
        if self.compressor is not None:
            out["kv"], out["gate"] = self.compressor.project(x, num)
        if self.indexer is not None:
            out["iq"], out["iw"] = self.indexer.queries(x, qr, cos, sin, num)
            out["ikv"], out["igate"] = self.indexer.compressor.project(x, num)
        return out

    def _attend_row(self, q: torch.Tensor, kv: torch.Tensor, span: RowSpan, cache: LayerCache,
                    extras: dict[str, torch.Tensor], num: Numerics) -> torch.Tensor:
        """One row's T tokens: q [T, H, d], kv [T, d] -> [T, H, d]; updates the row's cache."""
        start_pos, slot, dev = span.start_pos, span.slot, kv.device
        window = self.window_size
        n_new, n_prev = kv.shape[0], min(start_pos, window - 1)
        ring = cache.swa[slot]
        prev_pos = torch.arange(start_pos - n_prev, start_pos, device=dev)
        keys = torch.cat((ring[prev_pos % window], kv))
        q_pos = start_pos + torch.arange(n_new, device=dev)
        k_pos = start_pos - n_prev + torch.arange(n_prev + n_new, device=dev)
        delta = q_pos[:, None] - k_pos[None, :]
        allowed = (delta >= 0) & (delta < window)  # the window includes the query itself
        kept = q_pos[-window:]  # the ring's content for the next step
        ring[kept % window] = kv[-window:].to(ring.dtype)
        if self.compressor is not None:
            self.compressor.update(extras["kv"], extras["gate"], start_pos, cache.comp, slot, span.pages,
                                   self.freqs, num)
            entries = cache.comp.read(span.pages, (start_pos + n_new) // self.compress_ratio)
            n_ready = (q_pos + 1) // self.compress_ratio  # entries a query may use: w < (t+1)/ratio
            visible = torch.arange(entries.shape[0], device=dev)[None, :] < n_ready[:, None]
            if self.indexer is not None:
                self.indexer.compressor.update(extras["ikv"], extras["igate"], start_pos, cache.idx, slot,
                                               span.pages, self.freqs, num)
                idx_keys = cache.idx.read(span.pages, (start_pos + n_new) // self.compress_ratio)
                visible = self.indexer.select(extras["iq"], extras["iw"], idx_keys, visible)
            keys = torch.cat((keys, entries))
            allowed = torch.cat((allowed, visible), dim=1)
        if not num.batch_invariant:
            return sparse_attention(q, keys, allowed, self.attn_sink, self.softmax_scale).to(num.compute_dtype)
        out = torch.empty(q.shape, dtype=num.compute_dtype, device=q.device)
        for t in range(n_new):  # each query over exactly its own keys, in position / entry order
            mine = keys[allowed[t].nonzero().squeeze(1)]
            every = torch.ones(1, mine.shape[0], dtype=torch.bool, device=q.device)
            out[t] = sparse_attention(q[t:t + 1], mine, every, self.attn_sink, self.softmax_scale)[0]
        return out

    def _project_out(self, o: torch.Tensor, num: Numerics) -> torch.Tensor:
        """o [N, H, d] -> grouped wo_a [N, G, o_lora] -> wo_b [N, D]."""
        n_tokens = o.shape[0]
        grouped = o.reshape(n_tokens, self.n_groups, -1)
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        grouped = grouped.to(wo_a.dtype)
        if num.batch_invariant:  # per token, decode included, so that every token takes the same path
            z = torch.stack([torch.einsum("gd,grd->gr", grouped[i].clone(), wo_a) for i in range(n_tokens)])
        else:
            z = torch.einsum("ngd,grd->ngr", grouped, wo_a)
        z = z.to(num.compute_dtype)
        return self.wo_b(z.flatten(1), num)
