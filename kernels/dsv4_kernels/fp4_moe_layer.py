"""The routed-experts layer on MXFP4 weights: route alignment, the two grouped GEMMs (fp4_moe.py) and the
per-token sum, in four launches with no host sync (reference: `fp4_moe_ref.fp4_moe_ref`).

Tokens T, top-k k, experts E, model dim D, expert inter dim I; the grid depends on (T, k, E) only:
  1. `moe_align` (moe_align.py, one program): the T*k routes (flat = token * k + j) sorted by expert
     and padded per expert to a multiple of BLOCK_M (pad id T*k); one expert id per block, -1 for the
     blocks past the used ones (a fixed count: cdiv(T*k, BLOCK_M) + min(T*k, E)).
  2. `fp4_moe_gemm`, GATE_UP: x [T, D] -> the clamped SwiGLU times the routing weight, quantized to FP8 by
     the epilogue: act e4m3 [T*k, I] + fp32 scales [T*k, ceil(I/128)].
  3. `fp4_moe_gemm`, down: act @ W2[e]^T rounded to bf16 -> y [T*k, D].
  4. `moe_combine`: out[t] = sum_j y[t*k + j] in fp32 (with `reduce` False the caller combines, adding
     what the layer adds in the same launch). Fusing the sum into the down kernel would need atomic adds,
     whose order (and so the fp32 sum) changes from run to run on a GPU.

Decode blocks take the card's tuned choices (tuning.py through fp4_moe_choices: K-loop form, tiles, warps,
stages); `ExpertSlots` gives the GEMMs a second weight source, the expert-slot cache's device slots; `ExpertGroups`
runs the two GEMMs once per range of expert ids, each on its range's blocks only (the others' expert id -1), for a
caller that makes a range's weights readable just before its launches (dsv4serve/experts/prefill_stream.py): the
same tiles, so the same bits, as one launch over all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dsv4_kernels.fp4_moe import GATE_UP_BLOCK_N, fp4_moe_gemm
from dsv4_kernels.fp4_moe_choices import loop_form_for, pick_block_k, pick_block_m, tuned_choice
from dsv4_kernels.moe_align import moe_align
from dsv4_kernels.moe_combine import moe_combine

__all__ = ["ExpertGroups", "ExpertSlots", "fp4_moe"]


@dataclass(frozen=True)
class ExpertSlots:
    """A second weight source: device slots holding some experts, stacked like the weights ([S, ...] per
    part, in FP4_PARTS order: w1, w1_scale, w3, w3_scale, w2, w2_scale), and which expert is where."""

    slot_of_expert: torch.Tensor  # [E] int32, -1: not in a slot (read from the stacked weights)
    parts: tuple[torch.Tensor, ...]  # the six [S, N, K/2] / [S, N, K/32] tensors


@dataclass(frozen=True)
class ExpertGroups:
    """The GEMMs' weights served a range of experts at a time: `slots` holds every used expert (its slot map never
    -1 for one), `ranges` yields (lo, hi) expert id ranges in order, each readable in `slots` when yielded and
    free to be overwritten once the next is asked for (its GEMMs queued)."""

    slots: ExpertSlots
    ranges: Iterable[tuple[int, int]]


def fp4_moe(
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
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    slots: ExpertSlots | None = None,
    usage: torch.Tensor | None = None,
    reduce: bool = True,
    groups: ExpertGroups | None = None,
) -> torch.Tensor:
    """x [T, D] bf16 (or fp32), W1/W3 [E, I, D/2] + [E, I, D/32], W2 [E, D, I/2] + [E, D, I/32], topk [T, k]
    (weights fp32, already route-scaled) -> routed-expert sum fp32 [T, D] (module contract above); with
    `reduce` False the per-route outputs [T, k, D] in `store_dtype()` instead, for `moe_combine` to sum with
    what the layer adds (one launch for the sum, the adds and the cast).
    `outs`: optional (act e4m3 [T*k, I], act scales fp32 [T*k, ceil(I/128)], y [T*k, D]) buffers;
    `block_n`: the down GEMM's N tile. Decode blocks (16 routes) take the card's tuned choices
    (tuning.py: K-loop form, tiles, warps, stages) where a tile size is not given and a tuned split fits K.
    `slots`: experts read from device slots instead (module doc);
    `usage` int64 [E + 1] (needs `slots`): the expert-slot cache's record (moe_align.py), whose hits are counted
    against `slots`' map; `groups`: the GEMMs read `groups.slots` instead, one range of experts at a time."""
    t, k = topk_ids.shape
    num_routes = t * k
    bm = block_m or pick_block_m(num_routes, w1.shape[0])
    up, down = (tuned_choice(gemm, num_routes, bm, x.device) for gemm in ("gate_up", "down"))
    bk_up = block_k or up.get("block_k") or pick_block_k(bm, True, x.device)
    bk_down = block_k or down.get("block_k") or pick_block_k(bm)
    slot_map = slots.slot_of_expert if slots is not None else None
    if usage is not None and slots is None:
        raise ValueError("usage records which experts came from slots: it needs slots")
    sorted_ids, expert_ids = moe_align(topk_ids, w1.shape[0], bm, usage, slot_map if usage is not None else None)
    act_q, act_s, y = outs or (None, None, None)

    def gemms(eids: torch.Tensor, src: ExpertSlots | None, act_q, act_s, y_out):
        act_q, act_s = fp4_moe_gemm(
            x,
            None,
            w1,
            w1_scale,
            sorted_ids,
            eids,
            num_routes,
            k,
            w3=w3,
            w3_scale=w3_scale,
            topk_weights=topk_weights,
            limit=limit,
            block_m=bm,
            block_n=GATE_UP_BLOCK_N,
            block_k=bk_up,
            out=act_q,
            out_scale=act_s,
            quant_out=True,
            slots=src.parts[:4] if src is not None else None,
            slot_of_expert=src.slot_of_expert if src is not None else None,
            num_warps=up.get("num_warps"),
            num_stages=up.get("num_stages"),
            loop=loop_form_for(up, x.shape[1], bk_up),
        )
        y = fp4_moe_gemm(
            act_q,
            act_s,
            w2,
            w2_scale,
            sorted_ids,
            eids,
            num_routes,
            1,
            block_m=bm,
            block_n=block_n or down.get("block_n") or 64,
            block_k=bk_down,
            out=y_out,
            slots=src.parts[4:] if src is not None else None,
            slot_of_expert=src.slot_of_expert if src is not None else None,
            num_warps=down.get("num_warps"),
            num_stages=down.get("num_stages"),
            loop=loop_form_for(down, w2.shape[2] * 2, bk_down),
        )
        return act_q, act_s, y

    if groups is None:
        act_q, act_s, y = gemms(expert_ids, slots, act_q, act_s, y)
    else:
        for lo, hi in groups.ranges:  # the range's blocks only: each route's rows written once, by its expert's range
            eids = torch.where((expert_ids >= lo) & (expert_ids < hi), expert_ids, -1)
            act_q, act_s, y = gemms(eids, groups.slots, act_q, act_s, y)
    assert isinstance(y, torch.Tensor)  # without quant_out the GEMM returns one tensor, not a pair
    pairs = y.view(t, k, -1)
    return moe_combine(pairs) if reduce else pairs
