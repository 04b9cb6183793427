"""GPU cases for the indexer scoring + top-k kernel at DeepSeek-V4-Flash's dimensions: 64 heads x 128
dims, top-k 512, CSA ratio 4, pages of 128 tokens (32 entries), bf16 keys and queries.

Inputs are small integers (q, k in {-1, 0, 1}, head weights in multiples of 1/2), so every score is
exact in fp32 whatever the summation order: the kernel must return exactly the reference's indices
(atol = rtol = 0), ties included, and ties are plentiful. The timing does not depend on the values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.gpu_cases import GpuCase
from dsv4_kernels.indexer_topk import indexer_topk, select_topk
from dsv4_kernels.indexer_topk_ref import indexer_topk_ref


@dataclass(frozen=True)
class Dims:
    heads: int = 64
    head_dim: int = 128
    topk: int = 512
    ratio: int = 4
    page_tokens: int = 128

    @property
    def per_page(self) -> int:
        return self.page_tokens // self.ratio


REAL = Dims()  # DeepSeek-V4-Flash (config.json: index_n_heads, index_head_dim, index_topk)


def _step(requests: list[tuple[int, int]], dims: Dims, device: torch.device, seed: int) -> dict:
    """A packed step of requests [(start_pos, n_rows)], each owning shuffled pages of one pool."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages_needed = [-(-((start + n) // dims.ratio) // dims.per_page) for start, n in requests]
    num_pages = sum(pages_needed)
    order = torch.randperm(num_pages, generator=gen, device=device).int()
    block_table = torch.full((len(requests), max(pages_needed)), -1, dtype=torch.int32, device=device)
    used = 0
    for b, need in enumerate(pages_needed):
        block_table[b, :need] = order[used : used + need]
        used += need
    n_rows = sum(n for _, n in requests)

    def ints(*shape: int) -> torch.Tensor:
        return torch.randint(-1, 2, shape, generator=gen, device=device).to(torch.bfloat16)

    return dict(
        q=ints(n_rows, dims.heads, dims.head_dim),
        weights=torch.randint(-2, 5, (n_rows, dims.heads), generator=gen, device=device).float() / 2,
        idx_k=ints(num_pages, dims.per_page, dims.head_dim),
        block_table=block_table,
        cu_seqlens=torch.tensor([0] + [n for _, n in requests], device=device).cumsum(0).int(),
        start_pos=torch.tensor([s for s, _ in requests], dtype=torch.int32, device=device),
    )


def _torch_decode(p: dict, dims: Dims) -> torch.Tensor:
    """The torch equivalent for decode rows (one per request): gather every request's keys through
    its block table, one batched bf16 matmul, relu, head sum, then the same top-k rule."""
    keys = p["idx_k"][p["block_table"].clamp_min(0).long()].flatten(1, 2)  # [B, S, Di]
    dots = torch.bmm(p["q"], keys.transpose(1, 2)).float().relu_()  # [B, H, S]
    scores = (dots * p["weights"][:, :, None]).sum(dim=1)
    visible = (p["start_pos"].long() + 1) // dims.ratio
    scores = scores.masked_fill(torch.arange(scores.shape[1], device=scores.device) >= visible[:, None], float("-inf"))
    return select_topk(scores, dims.topk)


def _case(name: str, requests: list[tuple[int, int]], device: torch.device, seed: int, dims: Dims = REAL) -> GpuCase:
    p = _step(requests, dims, device, seed)
    max_rows = max(n for _, n in requests)
    num_cols = max((s + n) // dims.ratio for s, n in requests)
    entries_read = sum((s + n) // dims.ratio for s, n in requests)  # each request's keys, read once
    n_rows = p["q"].shape[0]
    bytes_moved = (
        entries_read * dims.head_dim * 2 + n_rows * dims.heads * (dims.head_dim * 2 + 4) + n_rows * dims.topk * 4
    )
    # useful work: every row against every entry it sees, all heads
    flops = sum(2 * dims.heads * dims.head_dim * ((s + i + 1) // dims.ratio) for s, n in requests for i in range(n))
    decode = max_rows == 1
    return GpuCase(
        name=name,
        run=lambda: indexer_topk(
            **p, ratio=dims.ratio, topk=dims.topk, max_rows_per_request=max_rows, num_cols=num_cols
        ),
        reference=lambda: indexer_topk_ref(**p, ratio=dims.ratio, topk=dims.topk),
        atol=0.0,
        rtol=0.0,
        bytes_moved=bytes_moved,
        flops=flops,
        baseline=(lambda: _torch_decode(p, dims)) if decode else None,
        baseline_name="torch gather + bmm + topk" if decode else "",
        bound="memory" if decode else "compute",
    )


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


def smoke_cases(device: torch.device) -> list[GpuCase]:
    """Tiny dims for the CPU interpreter: decode with fewer visible entries than k and with more, and
    a ragged chunk that crosses pages."""
    tiny = Dims(heads=4, head_dim=32, topk=8, ratio=4, page_tokens=16)
    return [
        _case("indexer_topk tiny decode b=3", [(20, 1), (70, 1), (41, 1)], device, 1, tiny),
        _case("indexer_topk tiny chunk", [(30, 9), (0, 5)], device, 2, tiny),
    ]
