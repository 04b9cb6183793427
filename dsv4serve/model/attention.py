"""Attention (dsv4-model.md §2.2-2.7): low-rank Q, one shared K=V head, a sliding window plus the
compressed entries of CSA / HCA layers, a per-head sink in the softmax denominator, inverse RoPE on
the output and the grouped low-rank output projection.

Projections run on all tokens of a batch at once. Then, per layer: the compressors update the pool
(row by row over the `RowSpan`s of the packed tokens; without batch invariance, a decode step all rows at
once, attention_decode.py, and equal short rows, a verify step's, as T such decode sub-steps: launches that
grow with T, never with the batch); the indexer picks each CSA query's entries (torch, or one indexer_topk kernel
call for the batch: `num.backends.indexer`); the core attention runs in torch, or as one paged sparse
attention kernel call for the batch that reads the pool through the `BatchLayout`
(`num.backends.attention`). The torch per-row path gathers a row's previous keys before writing its new
ones into the window ring; the kernel reads the ring itself, so there the ring is written after the call.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4serve.model.args import ModelArgs
from dsv4serve.model.attention_decode import attend_decode, select_decode, store_window
from dsv4serve.model.batch import BatchLayout, RowSpan
from dsv4serve.model.compressor import Compressor
from dsv4serve.model.indexer import Indexer
from dsv4serve.model.joined_fp8 import JoinedFp8
from dsv4serve.model.kv_pool import LayerCache
from dsv4serve.model.layers import Linear, Normed, RMSNorm, TensorParallel
from dsv4serve.model.numerics import KV_BLOCK, Numerics, act_quant, as_share, fp8_quant_dequant, reduced
from dsv4serve.model.rope import Rotation, inv_freq


def sparse_attention(
    q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor, scale: float, per_head: bool = False
) -> torch.Tensor:
    """q [T, H, d], keys (= values) [L, d], allowed [T, L] bool, sink [H] -> [T, H, d] fp32.

    The sink logit joins only the denominator: o = sum_j e^(s_j - M) v_j / (sum_j e^(s_j - M) + e^(sink - M)).
    `per_head`: the two products run one head at a time, so that a head's bits do not depend on how many heads
    share the call (a GEMM over H rows sums in an order that depends on H): with --batch-invariant a
    tensor-parallel rank's heads then equal one rank's (bench/RESULTS.md, issue 21).
    """
    kf = keys.float()
    s = _heads("thd,ld->thl", q.float(), kf, per_head) * scale
    s = s.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    sink = sink.float().view(1, -1)
    m = torch.maximum(s.amax(dim=-1), sink)  # [T, H]
    p = torch.exp(s - m.unsqueeze(-1))
    denom = p.sum(dim=-1) + torch.exp(sink - m)
    return _heads("thl,ld->thd", p, kf, per_head) / denom.unsqueeze(-1)


def _heads(equation: str, a: torch.Tensor, b: torch.Tensor, per_head: bool) -> torch.Tensor:
    """einsum over a [T, H, ...] and b, all heads at once or one head at a time (stacked back on dim 1)."""
    if not per_head:
        return torch.einsum(equation, a, b)
    one = equation.replace("h", "")
    return torch.stack([torch.einsum(one, a[:, h], b) for h in range(a.shape[1])], dim=1)


class Attention(nn.Module):
    freqs: torch.Tensor  # a registered buffer: [rope_head_dim / 2] fp32

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.head_dim, self.rope_head_dim = args.n_heads, args.head_dim, args.rope_head_dim
        self.window_size, self.eps = args.window_size, args.norm_eps
        self.n_groups, self.o_lora_rank = args.o_groups, args.o_lora_rank
        self.compress_ratio = args.compress_ratios[layer_id]
        self.softmax_scale = self.head_dim**-0.5
        self.attn_sink = nn.Parameter(torch.empty(self.n_heads))
        self.wq_a = Linear(args.dim, args.q_lora_rank, fp8_act=True)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, fp8_act=True)
        self.wkv = Linear(args.dim, self.head_dim, fp8_act=True)
        self.kv_norm = RMSNorm(self.head_dim, args.norm_eps)
        # the reference dequantizes wo_a to bf16 and runs it as a plain grouped einsum
        self.wo_a = Linear(self.n_heads * self.head_dim // self.n_groups, self.n_groups * self.o_lora_rank, False)
        self.wo_b = Linear(self.n_groups * self.o_lora_rank, args.dim, fp8_act=True, row_parallel=True)
        self.compressor = Compressor(args, self.compress_ratio, self.head_dim, False) if self.compress_ratio else None
        self.indexer = Indexer(args, self.compress_ratio) if args.kind(layer_id) == "csa" else None
        self.register_buffer("freqs", inv_freq(args, bool(self.compress_ratio)), persistent=False)
        # equal rows of at most this many tokens (a verify step's) run as decode sub-steps: no more than the
        # smallest compress ratio (what a rollback can undo) nor the window (one ring entry per key of a row)
        self.max_substeps = min([r for r in args.compress_ratios if r] + [args.window_size])
        # split over ranks (dsv4serve/parallel/shard_model.py): n_heads / n_groups are then this rank's
        self.tp: TensorParallel | None = None
        self._joint: JoinedFp8 | None = None  # wq_a and wkv packed as one weight (`join_projections`)

    def join_projections(self) -> None:
        """Hold wq_a's and wkv's packed FP8 weights as one (model/joined_fp8.py): with the FP8 GEMM on Triton
        their shared input then takes one launch, not two. After packing (Transformer.use_kernels); again
        after a reload is harmless."""
        if self._joint is not None and self._joint.holds():
            return
        self._joint = JoinedFp8(self.wq_a, self.wkv) if JoinedFp8.fits(self.wq_a, self.wkv) else None

    def forward(self, x: torch.Tensor, layout: BatchLayout, cache: LayerCache, num: Numerics) -> torch.Tensor:
        """x [N, D] compute dtype (attn_norm output) -> [N, D] compute dtype."""
        kernels = num.backends.token_ops == "triton"
        rot = Rotation.of(self.freqs, layout.positions if kernels else layout.positions64, kernels)
        # shared by wq_a and wkv; the FP8 GEMM kernel quantizes its input itself (never twice)
        in_kernel = self.wq_a.quantizes_in_kernel(num) and self.wkv.quantizes_in_kernel(num)
        if in_kernel and self._joint is not None and self._joint.holds():
            q_lat, kv = self._joint(x)  # one launch: [N, q_lora] and [N, d] column views of its output
        else:
            xq = x if in_kernel else act_quant(x, num)
            q_lat, kv = self.wq_a(xq, num, x_quantized=True), self.wkv(xq, num, x_quantized=True)
        # q_norm(q_lat) [N, q_lora], read by wq_b and the indexer's wq_b: on the FP8 kernel each applies the norm
        # in its own launch (layers.Normed), else the norm runs once
        qr = Normed(q_lat, self.q_norm, num)
        q = self.wq_b(qr, num).unflatten(-1, (self.n_heads, self.head_dim))
        nope = self.head_dim - self.rope_head_dim
        ring = None
        if kernels:  # one launch each: the per-head RMS + RoPE; the kv norm + RoPE + FP8 simulation
            from dsv4_kernels.token_ops import Ring, kv_norm_rope_quant, q_head_norm_rope

            if layout.is_decode and num.backends.attention == "triton":  # its keys go into the rings here too
                ring = Ring(cache.swa, layout.seq_slot, layout.positions)
            q = q_head_norm_rope(q, rot.angles, self.eps)
            kv = kv_norm_rope_quant(
                kv, self.kv_norm.weight, self.kv_norm.eps, rot.angles, nope, KV_BLOCK, num.kv_fp8, ring=ring
            )
        else:
            q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)
            q = rot.apply(q)  # [N, H, d]
            kv = rot.apply(self.kv_norm(kv))
            if num.kv_fp8:
                kv = torch.cat((fp8_quant_dequant(kv[:, :nope], KV_BLOCK), kv[:, nope:]), dim=1)
        extras = self._compressed_inputs(x, qr, rot, num)
        # without batch invariance, a decode step and equal short rows run the vectorized paths
        # (attention_decode.py): as decode sub-steps, token t of every row at once (`BatchLayout.substeps`)
        vector = not num.batch_invariant and 1 <= layout.tokens_per_row <= self.max_substeps
        self._update_compressors(layout, cache, extras, num, vector)
        topk = self._select(layout, cache, extras, num, vector) if self.indexer is not None else None
        if num.backends.attention == "triton":
            o = self._attend_kernel(q, kv, layout, cache, topk, num, vector, stored=ring is not None)
        elif vector:
            o = self._attend_substeps(q, kv, layout, cache, topk).to(num.compute_dtype)
        else:
            o = torch.empty(q.shape, dtype=num.compute_dtype, device=q.device)
            for span in layout.spans:
                rows = slice(span.begin, span.end)
                row_topk = None if topk is None else topk[rows]
                o[rows] = self._attend_row(q[rows], kv[rows], span, layout, cache, row_topk, num)
        o = rot.apply(o, inverse=True)
        return self._project_out(o, num)

    def _compressed_inputs(self, x: torch.Tensor, qr: Normed, rot: Rotation, num: Numerics) -> dict[str, torch.Tensor]:
        """Per-token inputs of the compressors and indexer, computed on all packed tokens at once."""
        out: dict[str, torch.Tensor] = {}
        if self.compressor is not None:  # x as it is: the head kernel upcasts bf16 itself, torch casts once a call
            out["kv"], out["gate"] = self.compressor.project(x, num)
        if self.indexer is not None:  # its head weights ride in its compressor's launch when that holds them
            out["ikv"], out["igate"], weights = self.indexer.compressor.project_with_tail(x, num)
            out["iq"], out["iw"] = self.indexer.queries(x, qr, rot, num, weights)
        return out

    def _update_compressors(
        self, layout: BatchLayout, cache: LayerCache, extras: dict[str, torch.Tensor], num: Numerics, vector: bool
    ) -> None:
        """Feed each row's tokens to the compressors: closed windows become entries in the row's pages
        (rows are separate sequences, so all are written before any row attends). `vector`: token by token
        over all rows (`BatchLayout.substeps`), the same writes as row by row."""
        pairs = []
        if self.compressor is not None:
            pairs.append((self.compressor, extras["kv"], extras["gate"], cache.comp))
        if self.indexer is not None:
            pairs.append((self.indexer.compressor, extras["ikv"], extras["igate"], cache.idx))
        for compressor, kv, gate, target in pairs:
            assert target is not None, "a layer with a compressor has that compressor's cache tier"
            if vector:  # T sub-steps over all rows: token t of every row at position start + t
                for t, step in enumerate(_steps(layout)):
                    compressor.update_decode(
                        _token(kv, layout, t), _token(gate, layout, t), step, target, self.freqs, num
                    )
                continue
            for span in layout.spans:
                rows = slice(span.begin, span.end)
                compressor.update(
                    kv[rows], gate[rows], span.start_pos, target, span.slot, layout.pages(span), self.freqs, num
                )

    def _attend_row(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        span: RowSpan,
        layout: BatchLayout,
        cache: LayerCache,
        topk: torch.Tensor | None,
        num: Numerics,
    ) -> torch.Tensor:
        """One row's T tokens: q [T, H, d], kv [T, d], the indexer's choice topk [T, index_topk] (CSA)
        -> [T, H, d]; writes the row's keys into its window ring."""
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
        self._store_window(ring, kv, start_pos)
        if self.compressor is not None:
            assert cache.comp is not None, "a layer with a compressor has its compressed cache tier"
            entries = cache.comp.read(layout.pages(span), (start_pos + n_new) // self.compress_ratio)
            n_ready = (q_pos + 1) // self.compress_ratio  # entries a query may use: w < (t+1)/ratio
            visible = torch.arange(entries.shape[0], device=dev)[None, :] < n_ready[:, None]
            if topk is not None:
                visible = Indexer.chosen(topk, visible)
            keys = torch.cat((keys, entries))
            allowed = torch.cat((allowed, visible), dim=1)
        if not num.batch_invariant:
            return sparse_attention(q, keys, allowed, self.attn_sink, self.softmax_scale).to(num.compute_dtype)
        out = torch.empty(q.shape, dtype=num.compute_dtype, device=q.device)
        for t in range(n_new):  # each query over exactly its own keys, in position / entry order
            mine = keys[allowed[t].nonzero().squeeze(1)]
            every = torch.ones(1, mine.shape[0], dtype=torch.bool, device=q.device)
            out[t] = sparse_attention(q[t : t + 1], mine, every, self.attn_sink, self.softmax_scale, per_head=True)[0]
        return out

    def _store_window(self, ring: torch.Tensor, kv: torch.Tensor, start_pos: int) -> None:
        """Keep a row's last `window` keys kv [T, d] (positions start_pos..) in its ring [W, d]."""
        kept = start_pos + torch.arange(max(0, kv.shape[0] - self.window_size), kv.shape[0], device=kv.device)
        ring[kept % self.window_size] = kv[-self.window_size :].to(ring.dtype)

    def _attend_kernel(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        layout: BatchLayout,
        cache: LayerCache,
        topk: torch.Tensor | None,
        num: Numerics,
        vector: bool,
        stored: bool = False,
    ) -> torch.Tensor:
        """Every row at once: q [N, H, d], kv [N, d], topk [N, index_topk] int32 (CSA) -> [N, H, d] compute
        dtype; then writes the rows' keys into their window rings, unless `stored` (a decode step's kv launch
        wrote them: token_ops.Ring)."""
        from dsv4_kernels.outputs import as_gpu_stored
        from dsv4_kernels.sparse_attention import paged_sparse_attention  # lazy: kernels build on import

        comp = cache.comp.entries if cache.comp is not None else None
        o = paged_sparse_attention(
            q,
            kv,
            cache.swa,
            layout.cu_seqlens,
            layout.start_pos,
            layout.seq_slot,
            self.attn_sink,
            self.softmax_scale,
            comp_kv=comp,
            block_table=layout.block_table if comp is not None else None,
            topk_idx=topk,
            ratio=self.compress_ratio,
            token_rows=layout.token_rows,
        )
        if not stored:  # after the kernel: it reads the ring as it was before this step
            if vector or layout.is_decode:
                store_window(cache.swa, kv, layout)
            else:
                for span in layout.spans:
                    self._store_window(cache.swa[span.slot], kv[span.begin : span.end], span.start_pos)
        return as_gpu_stored(o, num.compute_dtype)  # the interpreter stores fp32 (a GPU stores bf16)

    def _select(
        self, layout: BatchLayout, cache: LayerCache, extras: dict[str, torch.Tensor], num: Numerics, vector: bool
    ) -> torch.Tensor:
        """The indexer's choice for every packed row: [N, index_topk] int32 entry indices, -1 padded."""
        assert self.indexer is not None and cache.idx is not None
        ratio, topk = self.compress_ratio, self.indexer.index_topk
        if num.backends.indexer == "triton":
            from dsv4_kernels.indexer_topk import indexer_topk  # lazy: kernels build on import

            return indexer_topk(
                extras["iq"],
                extras["iw"],
                cache.idx.entries,
                layout.block_table,
                layout.cu_seqlens,
                layout.start_pos,
                ratio,
                topk,
                layout.max_rows,
                layout.max_end // ratio,
            )
        if vector:  # [B, T, K] by sub-step -> packed [N, K]
            steps = _steps(layout)
            chosen_by_token = [
                select_decode(_token(extras["iq"], layout, t), _token(extras["iw"], layout, t), cache.idx, step, topk)
                for t, step in enumerate(steps)
            ]
            return chosen_by_token[0] if len(steps) == 1 else torch.stack(chosen_by_token, dim=1).flatten(0, 1)
        chosen = []
        for span in layout.spans:
            rows, dev = slice(span.begin, span.end), layout.cu_seqlens.device
            q_pos = span.start_pos + torch.arange(span.end - span.begin, device=dev)
            n_entries = (span.start_pos + span.end - span.begin) // ratio
            visible = torch.arange(n_entries, device=dev)[None, :] < ((q_pos + 1) // ratio)[:, None]
            keys = cache.idx.read(layout.pages(span), n_entries)
            chosen.append(
                self.indexer.as_indices(self.indexer.select(extras["iq"][rows], extras["iw"][rows], keys, visible))
            )
        return torch.cat(chosen)

    def _attend_substeps(
        self, q: torch.Tensor, kv: torch.Tensor, layout: BatchLayout, cache: LayerCache, topk: torch.Tensor | None
    ) -> torch.Tensor:
        """The torch path of equal rows: q [N, H, d], kv [N, d] -> [N, H, d] fp32. Token t of every row
        stores its key, then attends over its window (positions p - W + 1 .. p: the keys of tokens t + 1.. of
        this step land on positions older than that, so storing them later changes nothing it reads)."""
        steps = _steps(layout)
        outs = []
        for t, step in enumerate(steps):
            store_window(cache.swa, _token(kv, layout, t), step)
            row_topk = None if topk is None else _token(topk, layout, t)
            q_t = _token(q, layout, t)
            outs.append(attend_decode(q_t, cache.swa, cache.comp, row_topk, step, self.attn_sink, self.softmax_scale))
        return outs[0] if len(steps) == 1 else torch.stack(outs, dim=1).flatten(0, 1)

    def _project_out(self, o: torch.Tensor, num: Numerics) -> torch.Tensor:
        """o [N, H, d] -> grouped wo_a [N, G, o_lora] -> wo_b [N, D]. The GEMM runs in wo_a's dtype: fp32
        as the dense loader gives it, bf16 as the packed loader holds it (exact; memory/weights.HELD_BF16)."""
        n_tokens = o.shape[0]
        grouped = o.reshape(n_tokens, self.n_groups, -1)
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        grouped = grouped.to(wo_a.dtype)
        if num.batch_invariant:  # per token, decode included, so that every token takes the same path
            z = torch.stack([torch.einsum("gd,grd->gr", grouped[i].clone(), wo_a) for i in range(n_tokens)])
        else:  # one batched GEMM over the groups, written straight into [N, G, o_lora]: flatten(1) below is
            # then a view at every N (an einsum's [G, N, o_lora] result, permuted, needs a copy once N > 1)
            z = grouped.new_empty(n_tokens, self.n_groups, wo_a.shape[1])
            torch.bmm(grouped.transpose(0, 1), wo_a.transpose(1, 2), out=z.transpose(0, 1))
        z = z.to(num.compute_dtype)
        if self.tp is None:
            return self.wo_b(z.flatten(1), num)
        # row parallel: this rank's groups' share of wo_b, summed over the ranks in fp32 and cast once after,
        # as the unsplit GEMM accumulates in fp32 and casts once: equal to it up to the summation order (bit for
        # bit under numerics.exact_sums, where the shares are exact fp64 sums)
        part = as_share(self.wo_b(z.flatten(1), num, partial=True))  # [N, D] fp32 or fp64
        return reduced(self.tp.all_reduce_sum(part, "attention output (after wo_b)"), num)


def _steps(layout: BatchLayout) -> tuple[BatchLayout, ...]:
    """The decode layouts of a vectorized step: itself for decode, else its sub-steps (one per token)."""
    return (layout,) if layout.is_decode else layout.substeps


def _token(x: torch.Tensor, layout: BatchLayout, t: int) -> torch.Tensor:
    """Token t of every row of equal rows: x [B * T, ...] packed -> [B, ...] (a strided view, no copy)."""
    return x if layout.is_decode else x.unflatten(0, (layout.num_rows, -1))[:, t]
