"""The routed experts' slot layout for the grouped FP4 GEMMs, on the device in one launch, without a host sync.

    sorted_ids, expert_ids = moe_align(topk_ids, num_experts, block_m)   (reference: fp4_moe_ref.moe_align_ref)

topk_ids [T, k] -> the T*k routes (flat = token * k + j) grouped by expert, in route order inside an
expert, each expert's group padded to a multiple of block_m with the pad id T*k: `sorted_ids` int32
[B * block_m]; `expert_ids` int32 [B], the expert of each block, -1 for the blocks past the used ones
(the GEMM kernels skip them). Experts without a route get no block.

B is always the bound `align_blocks(T*k, E, block_m)` = cdiv(T*k, block_m) + min(T*k, E): the used
experts U <= min(T*k, E) need sum_e cdiv(c_e, block_m) <= T*k / block_m + U blocks. So the grid of
every launch depends on (T, k, E, block_m) only, never on the routing, and no count is read back:
the layout a CUDA graph can capture.

One program does it all (grid (1,)): a histogram of the ids over the E experts (one-hot [CHUNK, E]
sums), an exclusive cumsum of the per-expert block counts, then each route's place = its expert's
first row + the routes of that expert before it (a running per-expert count plus a cumsum inside the
chunk), and per block its expert (the number of experts whose blocks end at or before it) and its
pad entries. The stores of routes and of pads hit disjoint entries, so no barrier is needed. At
DeepSeek-V4-Flash's sizes a decode step has 6 to 384 routes over 256 experts: a few microseconds.

`usage` (optional int64 [E + 1]) is the expert-slot cache's per-layer record, updated in the same
launch: usage[e] += 1 for each expert this call routes to, and usage[E] += the number of those whose
`slot_of_expert` entry (int32 [E]) is >= 0, i.e. were read from a device slot (a hit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 32  # routes (or blocks) per loop step: one-hot tiles of [CHUNK, E]


def align_blocks(num_routes: int, num_experts: int, block_m: int) -> int:
    """The fixed block count of an alignment: cdiv(routes, block_m) + min(routes, experts)."""
    return -(-num_routes // block_m) + min(num_routes, num_experts)


@triton.jit
def moe_align_kernel(
    topk_ids_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    usage_ptr,
    slot_of_expert_ptr,
    num_routes,
    num_experts,
    num_blocks,
    BLOCK_M: tl.constexpr,
    E_P2: tl.constexpr,
    CHUNK: tl.constexpr,
    USAGE: tl.constexpr,
):
    """See the module doc. E_P2: num_experts rounded up to a power of two (>= 16)."""
    e_idx = tl.arange(0, E_P2)
    c_idx = tl.arange(0, CHUNK)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for r0 in range(0, num_routes, CHUNK):
        ids = tl.load(topk_ids_ptr + r0 + c_idx, mask=r0 + c_idx < num_routes, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == e_idx[None, :]).to(tl.int32), axis=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    block_start = block_end - blocks
    used_blocks = tl.sum(blocks, axis=0)
    # each route to its expert's next row
    seen = tl.zeros([E_P2], dtype=tl.int32)
    for r0 in range(0, num_routes, CHUNK):
        route = r0 + c_idx
        ids = tl.load(topk_ids_ptr + route, mask=route < num_routes, other=-1).to(tl.int32)
        onehot = (ids[:, None] == e_idx[None, :]).to(tl.int32)  # [CHUNK, E_P2]
        before = tl.cumsum(onehot, axis=0) - onehot  # earlier routes of the same expert in this chunk
        dest = tl.sum(onehot * (block_start[None, :] * BLOCK_M + seen[None, :] + before), axis=1)
        tl.store(sorted_ids_ptr + dest, route, mask=route < num_routes)
        seen += tl.sum(onehot, axis=0)
    # each block's expert, and the pad entries (rows past the expert's count, and every unused block)
    m_idx = tl.arange(0, BLOCK_M)
    for b0 in range(0, num_blocks, CHUNK):
        b = b0 + c_idx
        e_of_b = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)  # == E_P2 past the used
        used = b < used_blocks
        tl.store(expert_ids_ptr + b, tl.where(used, e_of_b, -1), mask=b < num_blocks)
        onehot = (e_of_b[:, None] == e_idx[None, :]).to(tl.int32)
        first_b = tl.sum(onehot * block_start[None, :], axis=1)
        count_b = tl.sum(onehot * counts[None, :], axis=1)
        row = (b - first_b)[:, None] * BLOCK_M + m_idx[None, :]  # the entry's row inside its expert
        pad = (row >= count_b[:, None]) | (b >= used_blocks)[:, None]
        tl.store(
            sorted_ids_ptr + b[:, None] * BLOCK_M + m_idx[None, :], num_routes, mask=pad & (b < num_blocks)[:, None]
        )
    if USAGE:
        e_ok = e_idx < num_experts
        hit = tl.load(slot_of_expert_ptr + e_idx, mask=e_ok, other=-1) >= 0
        used_e = (counts > 0).to(tl.int64)
        tl.store(usage_ptr + e_idx, tl.load(usage_ptr + e_idx, mask=e_ok, other=0) + used_e, mask=e_ok)
        hits = tl.sum(tl.where(hit, used_e, 0), axis=0)
        tl.store(usage_ptr + num_experts, tl.load(usage_ptr + num_experts) + hits)


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    usage: torch.Tensor | None = None,
    slot_of_expert: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] (int32/int64) -> (sorted route ids int32 [B * block_m], expert per block int32 [B]),
    B = align_blocks(T * k, num_experts, block_m); one launch, no host sync (module doc). `usage` int64
    [E + 1] and `slot_of_expert` int32 [E] (both or neither) record the call for the expert-slot cache."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous() or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be contiguous int32/int64, got {ids.dtype}")
    if (usage is None) != (slot_of_expert is None):
        raise ValueError("usage and slot_of_expert come together")
    if (
        usage is not None
        and slot_of_expert is not None
        and (usage.shape != (num_experts + 1,) or slot_of_expert.shape != (num_experts,))
    ):
        raise ValueError(f"usage must be [{num_experts + 1}] and slot_of_expert [{num_experts}]")
    num_routes = ids.numel()
    num_blocks = align_blocks(num_routes, num_experts, block_m)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    moe_align_kernel[(1,)](
        ids,
        sorted_ids,
        expert_ids,
        usage if usage is not None else expert_ids,  # unused without USAGE
        slot_of_expert if slot_of_expert is not None else expert_ids,
        num_routes,
        num_experts,
        num_blocks,
        BLOCK_M=block_m,
        E_P2=max(16, triton.next_power_of_2(num_experts)),
        CHUNK=CHUNK,
        USAGE=usage is not None,
        num_warps=4,
    )
    return sorted_ids, expert_ids


_SIG = {
    "topk_ids_ptr": "*i64",
    "sorted_ids_ptr": "*i32",
    "expert_ids_ptr": "*i32",
    "usage_ptr": "*i64",
    "slot_of_expert_ptr": "*i32",
    "num_routes": "i32",
    "num_experts": "i32",
    "num_blocks": "i32",
    "BLOCK_M": "constexpr",
    "E_P2": "constexpr",
    "CHUNK": "constexpr",
    "USAGE": "constexpr",
}
# DeepSeek-V4-Flash: 256 experts; decode blocks of 16 routes, prefill blocks of 64 (fp4_moe_choices.pick_block_m)
COMPILE_CONFIGS = (
    ("decode", _SIG, {"BLOCK_M": 16, "E_P2": 256, "CHUNK": CHUNK, "USAGE": True}),
    ("prefill", _SIG, {"BLOCK_M": 64, "E_P2": 256, "CHUNK": CHUNK, "USAGE": True}),
)
LAUNCH_OPTIONS = {"decode": {"num_warps": 4}, "prefill": {"num_warps": 4}}
