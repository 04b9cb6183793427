"""GPU cases for the indexer scoring + top-k kernel at DeepSeek-V4-Flash's dimensions: 64 heads x 128
dims, top-k 512, CSA ratio 4, pages of 128 tokens (32 entries), bf16 keys and queries.

Inputs are small integers (q, k in {-1, 0, 1}, head weights in multiples of 1/2), so every score is
exact in fp32 whatever the summation order: the kernel must return exactly the reference's indices
(atol = rtol = 0), ties included, and ties are plentiful. The timing does not depend on the values.
"""

from __future__ import annotations

import torch

from bench.gpu_cases import GpuCase
from dsv4_kernels.indexer_topk import indexer_topk, select_topk
from dsv4_kernels.indexer_topk_ref import indexer_topk_ref

HEADS, HEAD_DIM, TOPK, RATIO, PAGE_TOKENS = 64, 128, 512, 4, 128
PER_PAGE = PAGE_TOKENS // RATIO


def _step(requests: list[tuple[int, int]], device: torch.device, seed: int) -> dict:
    """A packed step of requests [(start_pos, n_rows)], each owning shuffled pages of one pool."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages_needed = [-(-((start + n) // RATIO) // PER_PAGE) for start, n in requests]
    num_pages = sum(pages_needed)
    order = torch.randperm(num_pages, generator=gen, device=device).int()
    block_table = torch.full((len(requests), max(pages_needed)), -1, dtype=torch.int32, device=device)
    used = 0
    for b, need in enumerate(pages_needed):
        block_table[b, :need] = order[used:used + need]
        used += need
    n_rows = sum(n for _, n in requests)

    def ints(*shape: int) -> torch.Tensor:
        return torch.randint(-1, 2, shape, generator=gen, device=device).to(torch.bfloat16)

    return dict(q=ints(n_rows, HEADS, HEAD_DIM),
                weights=torch.randint(-2, 5, (n_rows, HEADS), generator=gen, device=device).float() / 2,
                idx_k=ints(num_pages, PER_PAGE, HEAD_DIM), block_table=block_table,
                cu_seqlens=torch.tensor([0] + [n for _, n in requests], device=device).cumsum(0).int(),
                start_pos=torch.tensor([s for s, _ in requests], dtype=torch.int32, device=device))


def _torch_decode(p: dict) -> torch.Tensor:
    """The torch equivalent for decode rows (one per request): gather every request's keys through
    its block table, one batched bf16 matmul, relu, head sum, then the same top-k rule."""
    keys = p["idx_k"][p["block_table"].clamp_min(0).long()].flatten(1, 2)  # [B, S, Di]
    dots = torch.bmm(p["q"], keys.transpose(1, 2)).float().relu_()  # [B, H, S]
    scores = (dots * p["weights"][:, :, None]).sum(dim=1)
    visible = (p["start_pos"].long() + 1) // RATIO
    scores = scores.masked_fill(torch.arange(scores.shape[1], device=scores.device) >= visible[:, None],
                                float("-inf"))
    return select_topk(scores, TOPK)


def _case(name: str, requests: list[tuple[int, int]], device: torch.device, seed: int) -> GpuCase:
    p = _step(requests, device, seed)
    max_rows = max(n for _, n in requests)
    num_cols = max((s + n) // RATIO for s, n in requests)
    entries_read = sum((s + n) // RATIO for s, n in requests)  # each request's keys, read once
    n_rows = p["q"].shape[0]
    bytes_moved = (entries_read * HEAD_DIM * 2 + n_rows * HEADS * (HEAD_DIM * 2 + 4) + n_rows * TOPK * 4)
    # useful work: every row against every entry it sees, all heads
    flops = sum(2 * HEADS * HEAD_DIM * ((s + i + 1) // RATIO) for s, n in requests for i in range(n))
    decode = max_rows == 1
    return GpuCase(
        name=name,
        run=lambda: indexer_topk(**p, ratio=RATIO, topk=TOPK, max_rows_per_request=max_rows, num_cols=num_cols),
        reference=lambda: indexer_topk_ref(**p, ratio=RATIO, topk=TOPK),
        atol=0.0, rtol=0.0, bytes_moved=bytes_moved, flops=flops,
        baseline=(lambda: _torch_decode(p)) if decode else None,
        baseline_name="torch gather + bmm + topk" if decode else "",
        bound="memory" if decode else "compute")


def cases(device: torch.device) -> list[GpuCase]:
    """Decode batch 1 and 32 at 8K and 64K tokens of context, and one 1024-token prefill chunk that
    ends at 64K."""
    out = []
    for context in (8192, 65536):
        for batch in (1, 32):
            requests = [(context - 1 - 37 * b, 1) for b in range(batch)]  # slightly ragged contexts
            name = f"indexer_topk decode b={batch} ctx={context // 1024}K"
            out.append(_case(name, requests, device, seed=context + batch))
    out.append(_case("indexer_topk prefill chunk 1024 at 63K-64K", [(65536 - 1024, 1024)], device, 7))
    return out
