"""The DeepSeek-V4 transformer (reference CPU path), module names mirroring the official
`inference/model.py` so that `load_state_dict` takes the official tensor names 1:1.

A forward runs a batch of rows; each row is a chunk of one request's tokens plus that request's
`SequenceState`. Prefill in one pass, in chunks of any size, and decode are all the same call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dsv4serve.model import compressor_cpu, fp8_cpu, hadamard_cpu, hc_cpu, sinkhorn_cpu
from dsv4serve.model.args import ModelArgs
from dsv4serve.model.attention import Attention
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.batch import BatchLayout, HostStaging, build_layout
from dsv4serve.model.compressor import Compressor
from dsv4serve.model.cpu_head import CpuHead
from dsv4serve.model.hc import hc_head, hc_post, hc_pre
from dsv4serve.model.kv_pool import KvPool, LayerCache, SequenceState
from dsv4serve.model.layers import Linear, RMSNorm, TensorParallel
from dsv4serve.model.moe import MoE
from dsv4serve.model.numerics import Numerics, matmul

log = logging.getLogger(__name__)


@dataclass
class BatchRow:
    token_ids: Sequence[int] | torch.Tensor  # the next T tokens of the request (host ids, or a [T] tensor)
    state: SequenceState  # advanced in place by the forward


@dataclass
class ForwardOutput:
    logits: list[torch.Tensor]  # per row: [vocab] fp32 (last position) or [T, vocab] (all positions)
    hidden: list[torch.Tensor] | None = None  # per row: [T, hc, D] streams before the HC head (for MTP)
    last_logits: torch.Tensor | None = None  # [rows, vocab] fp32, the rows' last positions (when not all_logits)


def _hc_params(module: nn.Module, prefix: str, n_mix: int, hc_dim: int, n_scales: int) -> None:
    setattr(module, f"{prefix}_fn", nn.Parameter(torch.empty(n_mix, hc_dim)))
    setattr(module, f"{prefix}_base", nn.Parameter(torch.empty(n_mix)))
    setattr(module, f"{prefix}_scale", nn.Parameter(torch.empty(n_scales)))


class Block(nn.Module):
    # the hyper-connection mixing parameters `_hc_params` registers under the checkpoint's names
    hc_attn_fn: nn.Parameter
    hc_attn_base: nn.Parameter
    hc_attn_scale: nn.Parameter
    hc_ffn_fn: nn.Parameter
    hc_ffn_base: nn.Parameter
    hc_ffn_scale: nn.Parameter

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.norm_eps, self.hc_eps, self.hc_iters = args.norm_eps, args.hc_eps, args.hc_sinkhorn_iters
        self.attn = Attention(layer_id, args)
        self.ffn = MoE(layer_id, args)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        n_mix = (2 + args.hc_mult) * args.hc_mult
        _hc_params(self, "hc_attn", n_mix, args.hc_mult * args.dim, 3)
        _hc_params(self, "hc_ffn", n_mix, args.hc_mult * args.dim, 3)

    def forward(self, h: torch.Tensor, layout: BatchLayout, cache: LayerCache, num: Numerics) -> torch.Tensor:
        """h [N, hc, D] compute dtype -> [N, hc, D]."""
        x, post, comb = hc_pre(
            h, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, self.hc_iters, self.hc_eps, self.norm_eps, num,
            self.attn_norm,
        )  # fmt: skip
        x = self.attn(x, layout, cache, num)
        h = hc_post(x, h, post, comb, num)
        x, post, comb = hc_pre(
            h, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, self.hc_iters, self.hc_eps, self.norm_eps, num,
            self.ffn_norm,
        )  # fmt: skip
        # the MoE output's combine left to hc_post, which sums it in its launch on Triton (model/moe_output.py)
        y = self.ffn(x, layout.token_ids, num, route_rows=layout.route_rows, defer_combine=True)
        return hc_post(y, h, post, comb, num)


class MTPBlock(Block):
    """The multi-token-prediction draft block: a standard block fed with the main model's streams
    and the embedding of the next token; it shares `embed` and `head` with the main model."""

    hc_head_fn: nn.Parameter  # registered by `_hc_params`
    hc_head_base: nn.Parameter
    hc_head_scale: nn.Parameter

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__(layer_id, args)
        self.e_proj = Linear(args.dim, args.dim, fp8_act=True)
        self.h_proj = Linear(args.dim, args.dim, fp8_act=True)
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        _hc_params(self, "hc_head", args.hc_mult, args.hc_mult * args.dim, 1)

    def embed_inputs(self, h: torch.Tensor, e: torch.Tensor, num: Numerics) -> torch.Tensor:
        """h [N, hc, D] main streams, e [N, D] next-token embeddings -> block input [N, hc, D]."""
        e = self.e_proj(self.enorm(e), num)
        hp = self.h_proj(self.hnorm(h).flatten(0, 1), num).view(h.shape)
        return (e.unsqueeze(1) + hp).to(num.compute_dtype)


def _token_list(ids: Sequence[int] | torch.Tensor) -> list[int]:
    return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)


def layout_of(
    rows: list[BatchRow],
    device: torch.device,
    use_mtp_pos: bool = False,
    table_width: int | None = None,
    max_end: int | None = None,
    staging: HostStaging | None = None,
) -> BatchLayout:
    """The rows' batch layout (model/batch.py); a standalone pool first takes the pages the rows need."""
    starts = []
    for row in rows:
        st = row.state
        start = st.mtp_num_tokens if use_mtp_pos else st.num_tokens
        st.pool.reserve(st, start + len(row.token_ids))
        starts.append(start)
    return build_layout(
        [_token_list(r.token_ids) for r in rows],
        starts,
        [r.state.slot for r in rows],
        [r.state.pages for r in rows],
        device,
        table_width,
        max_end,
        staging,
    )


def _pool_of(rows: list[BatchRow], num: Numerics) -> KvPool:
    pool = rows[0].state.pool
    if any(r.state.pool is not pool for r in rows):
        raise ValueError("the rows of one forward must share a KV pool")
    if pool.dtype != num.compute_dtype:
        raise ValueError(f"a KV pool of {pool.dtype} cannot serve numerics computing in {num.compute_dtype}")
    return pool


class Transformer(nn.Module):
    hc_head_fn: nn.Parameter  # registered by `_hc_params`
    hc_head_base: nn.Parameter
    hc_head_scale: nn.Parameter

    def __init__(self, args: ModelArgs, include_mtp: bool = True):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = Linear(args.dim, args.vocab_size, fp8_act=False)
        _hc_params(self, "hc_head", args.hc_mult, args.hc_mult * args.dim, 1)
        n_mtp = args.n_mtp_layers if include_mtp else 0
        self.mtp = nn.ModuleList(MTPBlock(args.n_layers + j, args) for j in range(n_mtp))
        self._standalone_pools: dict[torch.dtype, KvPool] = {}
        # split over ranks (dsv4serve/parallel/shard_model.py): embed / head then hold this rank's vocabulary rows
        self.tp: TensorParallel | None = None
        self._cpu_head: CpuHead | None = None  # the head's CPU copy: bf16 (a checkpoint's), else oneDNN-blocked

    def new_state(self, num: Numerics) -> SequenceState:
        """A sequence in this model's own growable pool, for direct use of the model (tests, benchmarks);
        the engine runs sequences of its fixed pool instead."""
        pool = self._standalone_pools.get(num.compute_dtype)
        if pool is None:
            pool = KvPool(
                self.args,
                num.compute_dtype,
                num_pages=16,
                num_slots=4,
                include_mtp=len(self.mtp) > 0,
                device=self.embed.weight.device,
                standalone=True,
            )
            self._standalone_pools[num.compute_dtype] = pool
        return pool.new_sequence()

    def use_kernels(self, backends: KernelBackends) -> None:
        """Prepare, once after loading, the packed weights the chosen Triton kernels read: FP8 blocks of
        every FP8-stored projection (fp8_gemm) and stacked MXFP4 routed experts (fp4_moe; layers whose
        experts come from an expert-slot cache stay on torch). Each packing asserts it is exact; weights
        packed already (by the packed loader, model/packed_load.py) are left as they are. With the head
        kernel on Triton the head weight is held in bf16 when that is exact (a checkpoint stores it so),
        else it stays fp32 on torch, with a warning. The other kernels need no preparation;
        `Numerics.backends` picks the path at each forward. The compressors' fused [wkv; wgate] weights are
        built here too (in bf16 with the compressor on Triton: its projection then runs on the head's
        kernel). The head on torch on the CPU is held K-major (layers.Linear.hold_k_major: MKL's fast layout
        for one row), with a bf16 copy for every batch when its values are bf16 (a checkpoint's), else a
        oneDNN-blocked one for batches of rows (model/cpu_head.py, the bf16 copy's kernels compiled here); routed
        experts on torch are held as K-major stacks (model/moe_stacked.py), their numba-compiled loop
        (model/moe_cpu.py), mHC's Sinkhorn rounds and gates and the Hadamard transform on the CPU compiled (or
        loaded from numba's cache) here (model/sinkhorn_cpu.py, model/hadamard_cpu.py), the compressors' decode
        update (model/compressor_cpu.py) and the FP8 simulation (model/fp8_cpu.py). With the FP8 GEMM on Triton
        each attention's wq_a and wkv are then held as one packed weight (model/joined_fp8.py: one launch for
        both)."""
        head = self.head.weight
        if backends.head == "torch" and head.device.type == "cpu":
            self.head.hold_k_major()
            self._cpu_head = CpuHead.build(self.head.weight)
        else:
            self._cpu_head = None
        if backends.hc == "torch" and head.device.type == "cpu":
            sinkhorn_cpu.compiled()  # numba's compiles (or cache loads) now, not in the first step
            hc_cpu.compiled()
            hadamard_cpu.compiled()
        if backends.compressor == "torch" and head.device.type == "cpu":
            compressor_cpu.compiled()
        if head.device.type == "cpu":
            fp8_cpu.compiled()  # numerics.fp8_quant_dequant's, on every CPU path
        if backends.head == "triton" and head.dtype != torch.bfloat16:
            if torch.equal(head.to(torch.bfloat16).to(head.dtype), head):
                self.head.weight = nn.Parameter(head.to(torch.bfloat16), requires_grad=False)
            else:
                log.warning(
                    "head=triton: the head weight is not exact in bf16 (not a checkpoint's?); "
                    "its logits stay on torch in %s",
                    head.dtype,
                )
        for module in self.modules():
            if isinstance(module, Compressor):
                module.prepare(backends)
            if (
                backends.fp8_gemm == "triton"
                and isinstance(module, Linear)
                and module.fp8_stored
                and module.weight_fp8 is None
            ):
                module.pack_fp8()
            if backends.fp4_moe == "torch" and isinstance(module, MoE):
                module.stack_experts()
            if (
                backends.fp4_moe == "triton"
                and isinstance(module, MoE)
                and module.expert_source is None
                and module.w1_fp4 is None
            ):
                module.pack_fp4()
        if backends.fp8_gemm == "triton":  # after packing: wq_a and wkv of each layer as one launch
            for module in self.modules():
                if isinstance(module, Attention):
                    module.join_projections()

    @torch.inference_mode()
    def forward(
        self, rows: list[BatchRow], num: Numerics, all_logits: bool = False, return_hidden: bool = False
    ) -> ForwardOutput:
        """Run each row's tokens after its state; advances every row's state by its token count."""
        pool = _pool_of(rows, num)
        layout = layout_of(rows, self.embed.weight.device)
        out = self.run(layout, pool, num, all_logits, return_hidden)
        for row, span in zip(rows, layout.spans):
            row.state.num_tokens += span.num_tokens
        return out

    @torch.inference_mode()
    def run(
        self,
        layout: BatchLayout,
        pool: KvPool,
        num: Numerics,
        all_logits: bool = False,
        return_hidden: bool = False,
        picks: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """The forward over a prepared layout (the engine's path: the runner builds the layout and advances
        the sequences itself); the states are not touched. `picks` [M] int (packed token indices): the logits
        of exactly those tokens, as `last_logits` [M, vocab] (speculative verification); else every row's
        last token (or every token with `all_logits`)."""
        h = self._embed(layout.token_ids).to(num.compute_dtype)
        h = h.unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()  # [N, hc, D]
        for i, layer in enumerate(self.layers):
            h = layer(h, layout, pool.layers[i], num)
        hidden = [h[s.begin : s.end] for s in layout.spans] if return_hidden else None
        if picks is not None:
            picked = h.index_select(0, picks)
            logits = self.logits(picked, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.norm, num)
            return ForwardOutput([], hidden, logits)
        picked = h if all_logits else h.index_select(0, layout.last_token)
        logits = self.logits(picked, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.norm, num)
        return ForwardOutput(self._split(logits, layout, all_logits), hidden, None if all_logits else logits)

    @torch.inference_mode()
    def forward_mtp(
        self, rows: list[BatchRow], hidden: list[torch.Tensor], num: Numerics, depth: int = 0, all_logits: bool = False
    ) -> ForwardOutput:
        """Draft logits from MTP block `depth`: row i pairs main streams hidden[i] [T, hc, D] at
        positions p.. with the tokens that follow them (`token_ids`, positions p+1..)."""
        pool = _pool_of(rows, num)
        layout = layout_of(rows, self.embed.weight.device, use_mtp_pos=True)
        out = self.run_mtp(layout, pool, torch.cat(hidden), num, depth, all_logits)
        for row, span in zip(rows, layout.spans):
            row.state.mtp_num_tokens += span.num_tokens
        return out

    @torch.inference_mode()
    def run_mtp(
        self,
        layout: BatchLayout,
        pool: KvPool,
        hidden: torch.Tensor,
        num: Numerics,
        depth: int = 0,
        all_logits: bool = False,
    ) -> ForwardOutput:
        """MTP block `depth` over a prepared layout (positions = the MTP layer's own, `mtp_num_tokens`):
        hidden [N, hc, D] the streams of the packed tokens' previous positions; the states are not touched.
        Returns the draft logits and the block's output streams per row (the next depth's, or the next
        recurrent draft's, input)."""
        block = self.mtp[depth]
        assert isinstance(block, MTPBlock)  # self.mtp holds only MTP blocks (ModuleList items are typed Module)
        if len(pool.layers) <= block.layer_id:
            raise ValueError("this KV pool holds no MTP layers")
        e = self._embed(layout.token_ids).to(num.compute_dtype)
        h = block.embed_inputs(hidden.to(num.compute_dtype), e, num)
        h = block(h, layout, pool.layers[block.layer_id], num)
        picked = h if all_logits else h.index_select(0, layout.last_token)
        logits = self.logits(picked, block.hc_head_fn, block.hc_head_scale, block.hc_head_base, block.norm, num)
        return ForwardOutput(
            self._split(logits, layout, all_logits),
            [h[s.begin : s.end] for s in layout.spans],
            None if all_logits else logits,
        )

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [N] -> [N, D] in the embedding's dtype. Split by vocabulary: each rank looks up the ids in
        its rows, zeros for the others, and the all-reduce adds the one nonzero row to zeros (exact)."""
        if self.tp is None:
            return self.embed(token_ids)
        rows = self.embed.weight.shape[0]
        local = token_ids - self.tp.rank * rows
        mine = (local >= 0) & (local < rows)
        e = self.embed(local.clamp(0, rows - 1)).float().masked_fill(~mine[:, None], 0.0)
        return self.tp.all_reduce_sum(e, "embedding (vocab-parallel)").to(self.embed.weight.dtype)

    def logits(
        self, h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm: RMSNorm, num: Numerics
    ) -> torch.Tensor:
        """Streams [M, hc, D] -> HC head -> final norm -> fp32 head: [M, vocab] fp32. With the head kernel
        on Triton and the weight held in bf16 (`use_kernels`), the kernel reads it as stored and gives the
        fp32 product (dsv4_kernels.head_logits); otherwise torch multiplies in fp32."""
        y = hc_head(h, fn, scale, base, self.args.hc_eps, self.args.norm_eps, num, norm)
        weight = self.head.weight
        if num.backends.head == "triton" and weight.dtype == torch.bfloat16:
            from dsv4_kernels.head_logits import head_logits, pick_block_m  # lazy, as for the other kernels

            y = y if y.dtype in (torch.bfloat16, torch.float32) else y.float()  # the kernel upcasts bf16 exactly
            out = head_logits(y, weight, block_m=pick_block_m(y.shape[0], num.batch_invariant))
        elif (
            (head := self._cpu_head) is not None
            and head.source is weight
            and (head.batch_invariant or not num.batch_invariant)
        ):
            out = head(y)  # model/cpu_head.py: a checkpoint head's bf16 copy (batch invariant), else oneDNN / MKL
        else:
            out = matmul(y.float(), weight.float(), num)
        if self.tp is None:
            return out
        return self.tp.all_gather(out, -1, "logits (vocab-parallel)")  # [M, vocab/T] -> [M, vocab] fp32

    @staticmethod
    def _split(logits: torch.Tensor, layout: BatchLayout, all_logits: bool) -> list[torch.Tensor]:
        if all_logits:
            return [logits[s.begin : s.end] for s in layout.spans]
        return list(logits.unbind(0))
