"""Mixture of experts (dsv4-model.md §2.8): the router (model/router.py: sqrt-softplus scores, bias-only
selection, hash routing on the first `n_hash_layers` layers, routed scaling), clamped SwiGLU experts, one shared
expert.

The routed experts are either resident (dense `experts` modules, or the stacked MXFP4 copies the
kernel reads) or, when the memory plan offloads them, behind an expert-slot cache
(`use_expert_cache`, dsv4serve/experts/): some in device slots, the rest in the host bank.

With `num.backends.fp4_moe == "triton"` the routed experts run as the grouped MXFP4 kernels
(dsv4_kernels.fp4_moe_layer: four launches, no host sync): on the stacked copies `pack_fp4` made or the
packed loader read (`use_packed_experts`: then there are no dense experts and only the kernel runs),
or, with a cache, on its slots and bank tensors (the kernel picks the source per expert). The kernel
quantizes x itself, so x is quantized once: `act_quant` runs in torch only for an input that torch
code reads (the torch experts, or the shared expert when its FP8 GEMM is not the fused kernel).

With `fp8_gemm` on Triton the shared expert is two FP8 launches (dsv4_kernels.fp8_swiglu: w1 and w3 with the
clamped SwiGLU and w2's input quantization in the epilogue, then w2).

On torch (the reference) the experts run one by one in ascending order, each on the same dequantized
values whether resident or lent by the cache, so those two paths give identical results.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_kernels.formats import dequant_fp4, quant_fp4
from dsv4serve.model import moe_cpu
from dsv4serve.model.args import ModelArgs
from dsv4serve.model.layers import Linear, TensorParallel
from dsv4serve.model.moe_output import Combined
from dsv4serve.model.moe_stacked import StackedExperts, stack
from dsv4serve.model.numerics import Numerics, act_quant, as_share, in_fp64, linear, reduced, row_product
from dsv4serve.model.router import Gate

FP4_PARTS = ("w1", "w3", "w2")


class ExpertSource(Protocol):
    """Where offloaded routed experts come from (dsv4serve.experts.slot_cache.ExpertSlotCache)."""

    def layer_experts(self, layer: int, experts: list[int]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """The torch path: each expert's packed MXFP4 parts (`w1`, `w1_scale`, ... as the checkpoint
        stores them), valid until the next one is asked for."""
        ...

    def kernel_sources(self, layer: int, ids: torch.Tensor, stream: bool = True):
        """The kernel path: a KernelSources (slots, slot map, bank tensors, usage row, and for a prefill chunk unless
        `stream` is False the experts streamed into device memory) for the layer."""
        ...


class CpuExperts(Protocol):
    """--moe-backend hybrid: the misses computed on the CPU (dsv4serve.experts.hybrid.HybridExperts)."""

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """Start the CPU part of the layer (x [N, D] through act_quant, ids / weights [N, k]): a HybridJob
        (`cpu_experts`, `device_routes(ids, weights)`, `wait(device)` -> [N, D] fp32), or None."""
        ...


class Expert(nn.Module):
    """`routed`: a routed expert, stored in MXFP4 (the shared expert is stored in FP8)."""

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float, routed: bool = False):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, fp8_act=True, fp4_weight=routed)
        self.w2 = Linear(inter_dim, dim, fp8_act=True, fp4_weight=routed, row_parallel=True)
        self.w3 = Linear(dim, inter_dim, fp8_act=True, fp4_weight=routed)
        self.swiglu_limit = swiglu_limit

    def forward(
        self, x: torch.Tensor, num: Numerics, weights: torch.Tensor | None = None, partial: bool = False
    ) -> torch.Tensor:
        """x [n, D] already through `act_quant` (unless the kernel quantizes it) -> [n, D] compute dtype:
        w1 and w3, the clamped SwiGLU (times the routing weight [n, 1], in fp32), w2. The FP8-stored (shared)
        expert with fp8_gemm on Triton runs as two kernel launches instead (`_fp8_kernels`). `partial`: w2
        is a row-parallel shard, its product returned uncast (layers.Linear.forward; fp32 from the kernel)."""
        if weights is None and self.w1.quantizes_in_kernel(num):
            return self._fp8_kernels(x, torch.float32 if partial else torch.bfloat16)
        gate, up = self.w1(x, num, x_quantized=True), self.w3(x, num, x_quantized=True)
        act = swiglu(gate, up, self.swiglu_limit, weights)
        return self.w2(act.to(num.compute_dtype), num, partial=partial)

    def _fp8_kernels(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """x [N, D] bf16 (raw: quantized in the kernel) -> [N, D] out_dtype: w1 and w3 in one FP8 GEMM whose
        epilogue applies the clamped SwiGLU and quantizes the result as w2's input, then the w2 FP8 GEMM
        on it (dsv4_kernels.fp8_swiglu). The arithmetic of the torch path (bf16 gate / up, SwiGLU in
        fp32 with silu in fp64, bf16 act) up to the GEMMs' fp32 summation order."""
        w1, w3, w2 = self.w1, self.w3, self.w2
        if w1.weight_fp8 is None or w3.weight_fp8 is None or w2.weight_fp8 is None:
            raise RuntimeError("fp8_gemm=triton needs packed FP8 weights: call Transformer.use_kernels first")
        from dsv4_kernels.fp8_swiglu import shared_expert  # lazy: kernel modules build their kernels on import

        rows = x.reshape(-1, x.shape[-1])
        out = shared_expert(
            rows, w1.weight_fp8, w1.weight_fp8_scale, w3.weight_fp8, w3.weight_fp8_scale,
            w2.weight_fp8, w2.weight_fp8_scale, self.swiglu_limit, out_dtype,
        )  # fmt: skip
        return out.view(*x.shape[:-1], out.shape[-1])


def swiglu(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float, weights: torch.Tensor | None) -> torch.Tensor:
    """Clamped SwiGLU of the gate / up projections [n, I] -> fp32 [n, I], times the routing weight [n, 1]."""
    gate, up = gate.float(), up.float()
    if swiglu_limit > 0:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    act = in_fp64(F.silu, gate) * up
    return weights * act if weights is not None else act


class MoE(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.n_routed_experts = args.n_routed_experts
        self.swiglu_limit = args.swiglu_limit
        self.gate = Gate(layer_id, args)
        self.experts = nn.ModuleList(
            Expert(args.dim, args.moe_inter_dim, args.swiglu_limit, routed=True) for _ in range(args.n_routed_experts)
        )
        shared_dim = args.n_shared_experts * args.moe_inter_dim
        self.shared_experts = Expert(args.dim, shared_dim, args.swiglu_limit)
        self.expert_source: ExpertSource | None = None
        self.cpu_experts: CpuExperts | None = None  # hybrid: some misses computed on the CPU
        self.stacked: StackedExperts | None = None  # the resident experts' stacks for the torch path (`stack_experts`)
        # split over ranks (dsv4serve/parallel/shard_model.py): experts another rank owns (expert parallel),
        # left out of this rank's routed sum; the partial sums are then reduced over the ranks
        self.tp: TensorParallel | None = None
        self.not_owned: frozenset[int] = frozenset()
        self.experts_split = False  # without expert parallelism: every expert's w1 / w3 rows, w2 columns cut
        self.local_expert: torch.Tensor | None = None  # expert parallel, packed: global expert -> stack row (-1)
        for part in FP4_PARTS:  # stacked MXFP4 copies for the fp4_moe kernel: [E, N, K/2] int8, [E, N, K/32] e8m0
            self.register_buffer(f"{part}_fp4", None, persistent=False)
            self.register_buffer(f"{part}_fp4_scale", None, persistent=False)

    @property
    def owned_experts(self) -> list[int]:
        """The routed experts this rank computes, in global order (every one unless expert parallel)."""
        return [e for e in range(self.n_routed_experts) if e not in self.not_owned]

    def pack_fp4(self) -> None:
        """Stack the resident routed experts as packed MXFP4 for the kernel. The dense weights must be
        exact MXFP4 dequantizations (they are, loaded from the checkpoint): re-packing must give them back."""
        if not len(self.experts):
            raise RuntimeError("the routed experts come from an expert-slot cache; nothing resident to pack")
        owned = self.owned_experts
        for part in FP4_PARTS:
            packed = [quant_fp4(getattr(self.experts[e], part).weight.detach()) for e in owned]
            for e, (codes, scale) in zip(owned, packed):
                dense = getattr(self.experts[e], part).weight.detach().float()
                if not torch.equal(dequant_fp4(codes, scale), dense):
                    raise ValueError(f"layer {self.layer_id} expert {e} {part} is not an exact MXFP4 dequantization")
            setattr(self, f"{part}_fp4", torch.stack([codes for codes, _ in packed]))
            setattr(self, f"{part}_fp4_scale", torch.stack([scale for _, scale in packed]))
        self._map_owned(owned, packed[0][0].device)

    def use_packed_experts(self, stacks: dict[str, torch.Tensor]) -> None:
        """Hold the routed experts only as the kernel's stacked MXFP4 copies (`w1_fp4`, `w1_fp4_scale`, ...
        as `pack_fp4` makes them, read from the checkpoint by the packed loader); no dense experts."""
        if set(stacks) != {f"{part}_fp4{kind}" for part in FP4_PARTS for kind in ("", "_scale")}:
            raise ValueError(f"layer {self.layer_id}: packed experts need every MXFP4 part, got {sorted(stacks)}")
        owned = self.owned_experts
        if any(t.shape[0] != len(owned) for t in stacks.values()):
            raise ValueError(f"layer {self.layer_id}: packed experts must stack the {len(owned)} experts it holds")
        self.experts = nn.ModuleList()
        self.stacked = None
        for name, tensor in stacks.items():
            setattr(self, name, tensor)
        self._map_owned(owned, next(iter(stacks.values())).device)

    def _map_owned(self, owned: list[int], device: torch.device) -> None:
        """Expert parallel: global expert -> its row in the stacks, -1 for another rank's (`local_expert`)."""
        if self.not_owned:
            local = torch.full((self.n_routed_experts,), -1, dtype=torch.int64)
            local[owned] = torch.arange(len(owned))
            self.local_expert = local.to(device)

    def stack_experts(self) -> None:
        """Hold the resident routed experts' dense weights as stacks (moe_stacked.py): the torch path then runs
        a step that uses every expert as two batched products. No copy: each expert's weights become views.
        Stacks that no longer hold the weights (cut over ranks, reloaded) are made anew."""
        if self.stacked is not None and self.stacked.holds(self.experts):
            return
        self.stacked = None
        if self.expert_source is None and len(self.experts) == self.n_routed_experts and not self.not_owned:
            self.stacked = stack(self.experts)
        if self.stacked is not None and self.stacked.w13.device.type == "cpu":
            moe_cpu.compiled()  # numba's compile (or cache load) now, not in the first step

    def use_expert_cache(self, source: ExpertSource) -> None:
        """From now on the routed experts come from `source`; the resident copies are dropped (their
        weights are then no longer part of the state dict)."""
        self.experts = nn.ModuleList()
        self.expert_source = source
        self.stacked = None
        for part in FP4_PARTS:
            setattr(self, f"{part}_fp4", None)
            setattr(self, f"{part}_fp4_scale", None)

    def forward(
        self,
        x: torch.Tensor,
        token_ids: torch.Tensor,
        num: Numerics,
        route_rows: torch.Tensor | None = None,
        defer_combine: bool = False,
    ) -> torch.Tensor | Combined:
        """x [N, D] compute dtype, token_ids [N] -> [N, D] compute dtype; `route_rows`: Gate.forward's.
        `defer_combine`: where the MXFP4 kernel's routes are summed by moe_combine, return them as a `Combined`
        for the launch that reads the output to sum (moe_output.py)."""
        weights, ids = self.gate(x, token_ids, num, route_rows)
        # hybrid: the CPU's misses start first (on kt-kernel's threads), so they overlap the device path
        cpu = self.cpu_experts
        job = None if cpu is None else cpu.submit(self.layer_id, act_quant(x, num), ids, weights)
        xq = None  # act_quant(x): the FP8 input of every expert, quantized once, where torch reads it
        if num.backends.fp4_moe == "triton":
            dev_ids, dev_weights = (ids, weights) if job is None else job.device_routes(ids, weights)
            if self.not_owned:
                dev_ids, dev_weights = self._owned_routes(dev_ids, dev_weights, job is not None)
            # quantizes x in its K loop; one rank: the per-route outputs, summed below with what the layer adds
            # with CPU experts in the step (hybrid), no streaming: the CPU computes what a stream would copy
            y = self._routed_kernel(x, dev_weights, dev_ids, reduce=self.tp is not None, stream=job is None)
        elif self.expert_source is None and not len(self.experts):
            raise RuntimeError(
                f"layer {self.layer_id}: the routed experts were loaded packed for fp4_moe=triton; "
                "fp4_moe=torch needs them loaded dense (iter_dense)"
            )
        else:
            xq = act_quant(x, num)
            skip = self.not_owned if job is None else self.not_owned | job.cpu_experts
            if self.experts_split and job is None:
                return self._split_experts(xq, weights, ids, num, skip)
            y = self._routed_torch(xq, weights, ids, num, skip)
        if xq is None and not self.shared_experts.w1.quantizes_in_kernel(num):
            xq = act_quant(x, num)
        if self.tp is not None:  # no CPU experts over ranks (worker/model_load.check_parallel)
            return self._reduce(y, self.shared_experts(x if xq is None else xq, num, partial=True), num)
        shared = self.shared_experts(x if xq is None else xq, num)  # launched before the wait: overlaps the CPU's
        parts = (shared,) if job is None else (job.wait(y.device), shared)  # the CPU experts' bf16 sum first
        if y.dim() == 3:  # the MXFP4 kernel's per-route outputs: their sum, the parts and the cast in one launch
            combined = Combined(y, parts, num.compute_dtype)
            return combined if defer_combine else combined.value()
        for part in parts:
            y += part  # fp32 += compute dtype: one launch, exact upcast
        return y.to(num.compute_dtype)

    def _reduce(self, routed: torch.Tensor, shared: torch.Tensor, num: Numerics) -> torch.Tensor:
        """Split over ranks: this rank's routed sum [N, D] fp32 and its shared-expert w2 partial [N, D] fp32,
        summed over the ranks in one all-reduce of both; then, as unsplit, the shared expert's output cast to
        the compute dtype and added to the routed sum in fp32. With expert parallelism (each rank's sum over its
        own experts) this differs from one rank's only by the order of the routed sum (the FP8 kernel hands the
        shared expert's w2 partial over unrounded, as the torch path does). With the experts split on
        the MXFP4 kernel (the torch path takes `_split_experts`), the kernel rounds each rank's partial of an
        expert's output to bf16, where one rank rounds the whole output: there the difference is that rounding."""
        assert self.tp is not None
        shared = as_share(shared)
        both = self.tp.all_reduce_sum(torch.stack((routed.to(shared.dtype), shared)), "MoE output (routed + shared)")
        return (both[0].float() + reduced(both[1], num)).to(num.compute_dtype)  # [N, D]

    def _split_experts(
        self, xq: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num: Numerics, skip: frozenset[int]
    ) -> torch.Tensor:
        """Every expert split over the ranks (torch path): this rank's w2 partial of each (token, expert) pair
        [N, k, D] fp32 and of the shared expert [N, D] fp32, summed over the ranks in one all-reduce; then each
        pair cast to the compute dtype and summed in ascending expert order, the shared output cast and added,
        as one rank does: equal to it up to the order of each w2 product's sum. k + 1 rows a token where the
        routed sum alone would be one: the price of rounding each expert's output whole, as one rank does."""
        assert self.tp is not None
        pairs = self._routed_torch(xq, weights, ids, num, skip, partial=True)  # [N, k, D] fp32 or fp64
        shared = as_share(self.shared_experts(xq, num, partial=True))  # [N, D], as pairs
        both = torch.cat((pairs.to(shared.dtype), shared[:, None]), dim=1)
        total = reduced(self.tp.all_reduce_sum(both, "MoE output (routed + shared)"), num)
        y = self._sum_pairs(total[:, :-1], ids)
        return (y + total[:, -1]).to(num.compute_dtype)

    def _owned_routes(
        self, ids: torch.Tensor, weights: torch.Tensor, hybrid: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallel on the MXFP4 kernel: ids as rows of this rank's stacks; a route to another rank's expert
        gets weight 0 and row 0 (its output is an exact 0, as the torch path leaves it out). Four small launches."""
        if self.expert_source is not None or hybrid or self.local_expert is None:
            raise RuntimeError("expert parallelism on the MXFP4 kernel runs on this rank's packed resident experts")
        local = self.local_expert[ids]
        owned = local >= 0
        return torch.where(owned, local, 0), torch.where(owned, weights, 0.0)

    def _routed_kernel(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, reduce: bool = True, stream: bool = True
    ) -> torch.Tensor:
        """The routed experts' sum [N, D] fp32 by the grouped MXFP4 kernel (resident or cached experts); with
        `reduce` False each route's output [N, k, D] (the kernel's store dtype), for `moe_combine`; `stream`
        False: a cache never streams this call's experts (ExpertSource.kernel_sources)."""
        from dsv4_kernels.fp4_moe_layer import ExpertGroups, ExpertSlots, fp4_moe  # lazy: kernels build on import

        if self.expert_source is not None:
            src = self.expert_source.kernel_sources(self.layer_id, ids, stream)
            slots = ExpertSlots(src.slot_of_expert, src.slots)
            on = src.stream  # a prefill chunk: the GEMMs read the experts streamed into device memory
            groups = None if on is None else ExpertGroups(ExpertSlots(on.slot_of_expert, src.slots), on.ranges())
            w1, w1_s, w3, w3_s, w2, w2_s = src.bank
            return fp4_moe(
                x,
                w1,
                w1_s,
                w3,
                w3_s,
                w2,
                w2_s,
                weights,
                ids,
                self.swiglu_limit,
                slots=slots,
                usage=src.usage,
                reduce=reduce,
                groups=groups,
            )
        if self.w1_fp4 is None:
            raise RuntimeError("fp4_moe=triton needs packed MXFP4 experts: call Transformer.use_kernels first")
        w1, w1_s, w3, w3_s, w2, w2_s = (
            getattr(self, f"{p}_fp4{kind}") for p in ("w1", "w3", "w2") for kind in ("", "_scale")
        )
        return fp4_moe(x, w1, w1_s, w3, w3_s, w2, w2_s, weights, ids, self.swiglu_limit, reduce=reduce)

    def _routed_torch(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        num: Numerics,
        skip: frozenset[int] = frozenset(),
        partial: bool = False,
    ) -> torch.Tensor:
        """The routed experts' sum [N, D] fp32, expert by expert in ascending order (resident or cached),
        but for `skip` (computed on the CPU, hybrid). x is already through `act_quant`.

        Only the GEMMs run per expert, on its (token, expert) pairs in token order; the work between them
        (SwiGLU, routing weight, w2's FP8 input: elementwise or per token) runs once over every pair, and
        each token's outputs are summed in ascending expert order: the values of an expert-by-expert loop,
        in a number of ops that grows by 3 GEMMs, not ~35 ops, per expert used. On the CPU, with the experts
        stacked in fp32 and no batch invariance, all of it is one compiled call (moe_cpu.py, `_compiled_for`).

        `partial` (experts split over ranks, `_split_experts`): each pair's w2 product uncast, [N, k, D] fp32 by
        pair (the pairs of `skip` 0), not summed: the sum over the ranks comes first."""
        n_tokens, k = ids.shape
        if not partial and not skip and (compiled := self._compiled_for(num)) is not None:
            y = moe_cpu.routed_experts(
                x, ids, weights, compiled.w13, compiled.w2, self.swiglu_limit, num.compute_dtype, num.fp8_act
            )
            if y is not None:
                return y
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        counts = torch.bincount(ids.flatten(), minlength=self.n_routed_experts).tolist()
        used = [e for e, count in enumerate(counts) if count and e not in skip]
        if not used:
            return y.unsqueeze(1).expand(-1, k, -1).contiguous() if partial else y
        order = ids.flatten().argsort(stable=True)  # [N * k] pairs n * k + j by expert, then by token
        pairs = order  # the pairs computed here: every pair but those of `skip`
        if sum(counts[e] for e in used) < order.numel():
            pairs = torch.cat([order[sum(counts[:e]) : sum(counts[: e + 1])] for e in used])
        xs = x.index_select(0, torch.div(pairs, k, rounding_mode="floor"))  # [P, D] each pair's token
        stacks = self._stacks_for(counts, pairs is order, partial, num)
        if stacks is not None:
            where = stacks.place(ids, order, counts)
            gate, up = stacks.gate_up(xs, where).to(num.compute_dtype).split(stacks.inter_dim, dim=1)
        else:
            dense = self._cached(used) if self.expert_source is not None else [self._resident(e) for e in used]
            bounds = list(itertools.accumulate((counts[e] for e in used), initial=0))
            segments = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
            gate = torch.cat([linear(xs[s], w1, num, True, x_quantized=True) for s, (w1, _, _) in zip(segments, dense)])
            up = torch.cat([linear(xs[s], w3, num, True, x_quantized=True) for s, (_, w3, _) in zip(segments, dense)])
        act = swiglu(gate, up, self.swiglu_limit, weights.flatten().index_select(0, pairs)[:, None])
        act = act_quant(act.to(num.compute_dtype), num)  # w2's FP8 input (per token: the same for all at once)
        # w2 row parallel: with `partial` a rank's share, uncast until the sum over the ranks; unsplit, the same
        # roundings (numerics.row_product)
        if stacks is not None:
            out = reduced(stacks.down(act, where), num)
        else:
            out = torch.cat([row_product(act[s], w2, num, partial) for s, (_, _, w2) in zip(segments, dense)])
        # back to pair order (pairs not computed here stay 0: adding +0.0 to a sum that starts at +0.0 is exact),
        # then each token's pairs by ascending expert, added one by one: no atomics, the loop's order
        by_pair = out.new_zeros(n_tokens * k, out.shape[1]).index_copy_(0, pairs, out).view(n_tokens, k, -1)
        return by_pair if partial else self._sum_pairs(by_pair, ids, y)

    def _compiled_for(self, num: Numerics) -> StackedExperts | None:
        """The stacks where the step's pairs run as one compiled call (moe_cpu.py): experts resident, stacked in
        fp32 on the CPU and still the experts' weights, no batch invariance (which runs each row's products as
        one-row GEMMs), compute dtype fp32 or bf16."""
        stacks = self.stacked
        if (
            stacks is None
            or num.batch_invariant
            or self.expert_source is not None
            or stacks.w13.device.type != "cpu"
            or stacks.w13.dtype != torch.float32
            or num.compute_dtype not in (torch.float32, torch.bfloat16)
        ):
            return None
        return stacks if stacks.holds(self.experts) else None

    def _stacks_for(self, counts: list[int], every_pair: bool, partial: bool, num: Numerics) -> StackedExperts | None:
        """The stacks when the step's pairs run best as two batched products over them (moe_stacked.py): experts
        resident and stacked, every pair computed here (none skipped), unsplit, no batch invariance (which runs
        each row alone), and the padded rows (experts x the busiest's pairs) at most twice the pairs."""
        stacks = self.stacked
        if stacks is None or partial or num.batch_invariant or not every_pair or self.expert_source is not None:
            return None
        return stacks if stacks.worth(counts) and stacks.holds(self.experts) else None

    @staticmethod
    def _sum_pairs(by_pair: torch.Tensor, ids: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """by_pair [N, k, D] (token n's pair j at [n, j]) -> [N, D] fp32: each token's pairs by ascending
        expert, added one by one to y (zeros when not given)."""
        n_tokens, k = ids.shape
        if y is None:
            y = torch.zeros(n_tokens, by_pair.shape[2], dtype=torch.float32, device=by_pair.device)
        rank = ids.argsort(dim=1, stable=True)  # [N, k]
        by_expert = by_pair.gather(1, rank[..., None].expand(-1, -1, by_pair.shape[2]))
        for j in range(k):
            y += by_expert[:, j].float()
        return y

    def _resident(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        expert = self.experts[e]
        assert isinstance(expert, Expert)  # ModuleList items are typed Module
        return expert.w1.weight, expert.w3.weight, expert.w2.weight

    def _cached(self, used: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The used experts' dense (w1, w3, w2), ascending, from the parts the cache lends, dequantized."""
        assert self.expert_source is not None
        dtype = self.gate.weight.dtype  # the dtype the resident experts would be loaded in (the shared
        # expert's weight may be held packed only, see Linear.load_fp8)
        dense = {}
        for e, p in self.expert_source.layer_experts(self.layer_id, used):
            w1, w3, w2 = (dequant_fp4(p[w], p[f"{w}_scale"], dtype) for w in ("w1", "w3", "w2"))
            dense[e] = (w1, w3, w2)
        return [dense[e] for e in used]
