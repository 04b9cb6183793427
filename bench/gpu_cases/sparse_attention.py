"""Paged sparse attention (dsv4_kernels.sparse_attention) at DeepSeek-V4-Flash's sizes.

Dims from the real config: 64 heads of 512, window 128, CSA ratio 4 (32 entries a page) with the
indexer's top-512, HCA ratio 128 (one entry a page). Cases: decode at batch 1 (64K context) and
batch 32 (contexts 8K..64K) for CSA, HCA and SWA-only layers (memory-bound), and one 2048-token
prefill chunk after 8K of context for CSA and HCA (compute-bound). Keys are random bf16 in a
shuffled page pool; top-k picks distinct visible entries (-1 padded when fewer are visible).

Reference: `paged_sparse_attention_ref` (fp64 softmax of the same bf16 values, rounded once). The
kernel rounds each probability to bf16 for the P @ V dot (2^-9 relative per weight, so at most
2^-9 max|v| ~ 1e-2 on N(0, 1) keys, far less on average) and its output to bf16 (2^-9 |o|): atol
1e-2, rtol 2^-8. bytes_moved = every distinct key the step needs (window ring + new keys + the
union of the selected entries) + top-k indices + q + output; flops = 4 H D per (query, key) pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from bench.gpu_cases import GpuCase, real_config_dir


@dataclass(frozen=True)
class Dims:
    heads: int
    head_dim: int
    window: int
    csa_ratio: int
    topk: int
    hca_ratio: int


def real_dims() -> Dims:
    from dsv4serve.model.args import read_model_args

    a = read_model_args(real_config_dir())
    ratios = sorted({r for r in a.compress_ratios if r})
    return Dims(a.n_heads, a.head_dim, a.window_size, ratios[0], a.index_topk, ratios[-1])


def _pages(
    rows: list[tuple[int, int]], ratio: int, per_page: int, dims: Dims, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A shuffled pool holding every entry the step's requests have: comp_kv [pages, E, D], block_table."""
    num_pages = [-(-((sp + n) // ratio) // per_page) for n, sp in rows]
    comp = torch.randn(sum(num_pages), per_page, dims.head_dim, device=device, generator=gen).to(torch.bfloat16)
    order = torch.randperm(sum(num_pages), device=device, generator=gen).int()
    table = torch.full((len(rows), max(num_pages)), -1, dtype=torch.int32, device=device)
    for b, (lo, n) in enumerate(zip([0, *torch.tensor(num_pages).cumsum(0).tolist()], num_pages)):
        table[b, :n] = order[lo : lo + n]
    return comp, table


def _topk(positions: torch.Tensor, ratio: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[N, k] distinct visible entries per query (e < (t+1)//ratio), -1 where fewer are visible."""
    visible = (positions + 1) // ratio
    scores = torch.rand(positions.numel(), int(visible.max()), device=positions.device, generator=gen)
    scores = scores.masked_fill(torch.arange(scores.shape[1], device=scores.device)[None, :] >= visible[:, None], 2.0)
    idx = scores.topk(min(k, scores.shape[1]), dim=1, largest=False).indices
    idx = torch.where(idx < visible[:, None], idx, -1)
    return torch.nn.functional.pad(idx, (0, k - idx.shape[1]), value=-1).int()


def make_step(
    rows: list[tuple[int, int]], mode: str, dims: Dims, device: torch.device, gen: torch.Generator
) -> tuple[dict, int, int]:
    """rows: (new tokens, start_pos) per request; mode 'csa' / 'hca' / 'swa'.
    -> (kwargs of both functions, bytes_moved, flops)."""
    num_rows, h, d, w = sum(n for n, _ in rows), dims.heads, dims.head_dim, dims.window
    counts = torch.tensor([n for n, _ in rows], device=device)
    start = torch.tensor([sp for _, sp in rows], dtype=torch.int32, device=device)
    cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).int()
    req = torch.repeat_interleave(torch.arange(len(rows), device=device), counts)
    positions = start[req].long() + torch.arange(num_rows, device=device) - cu[req].long()
    kw = dict(
        q=torch.randn(num_rows, h, d, device=device, generator=gen).to(torch.bfloat16),
        new_kv=torch.randn(num_rows, d, device=device, generator=gen).to(torch.bfloat16),
        swa_kv=torch.randn(len(rows), w, d, device=device, generator=gen).to(torch.bfloat16),
        cu_seqlens=cu,
        start_pos=start,
        seq_slot=torch.arange(len(rows), device=device).flip(0).int(),
        sink=torch.randn(h, device=device, generator=gen),
        scale=d**-0.5,
    )
    keys_per_row = (positions + 1).clamp(max=w)
    distinct = sum(min(sp, w - 1) + n for n, sp in rows)  # ring slots + new keys
    if mode != "swa":
        ratio = dims.csa_ratio if mode == "csa" else dims.hca_ratio
        kw["comp_kv"], kw["block_table"] = _pages(rows, ratio, w // ratio, dims, device, gen)
        kw["ratio"] = ratio
        if mode == "csa":
            kw["topk_idx"] = _topk(positions, ratio, dims.topk, gen)
            keys_per_row += (kw["topk_idx"] >= 0).sum(1)
            picked = kw["topk_idx"].long() + req[:, None] * (1 << 32)  # distinct (request, entry) pairs
            distinct += torch.unique(picked[kw["topk_idx"] >= 0]).numel() + dims.topk * num_rows * 4 // (2 * d)
        else:
            keys_per_row += (positions + 1) // ratio
            distinct += sum((sp + n) // ratio for n, sp in rows)
    nbytes = 2 * d * distinct + 2 * 2 * num_rows * h * d  # keys, then q + out (bf16)
    return kw, nbytes, 4 * h * d * int(keys_per_row.sum())


def build(device: torch.device, dims: Dims, steps: list[tuple[str, str, list[tuple[int, int]], dict]]) -> list[GpuCase]:
    """steps: (label, mode, rows, launch overrides passed to the wrapper, e.g. {"block_n": 16})."""
    from dsv4_kernels.sparse_attention import paged_sparse_attention
    from dsv4_kernels.sparse_attention_ref import paged_sparse_attention_ref

    gen = torch.Generator(device=device).manual_seed(0)
    out: list[GpuCase] = []
    for label, mode, rows, launch in steps:
        kw, nbytes, flops = make_step(rows, mode, dims, device, gen)
        bound = "compute" if sum(n for n, _ in rows) > len(rows) else "memory"
        out.append(
            GpuCase(
                f"sparse_attn {label}",
                run=partial(paged_sparse_attention, **kw, **launch),
                reference=partial(paged_sparse_attention_ref, **kw),
                atol=1e-2,
                rtol=2.0**-8,
                bytes_moved=nbytes,
                flops=flops,
                bound=bound,
            )
        )
    return out


def cases(device: torch.device) -> list[GpuCase]:
    """The real shapes, plus the two tile choices the Hopper defaults are weighed against (ptxas: 255
    registers and ~0.6 KB of spills a thread at BLOCK_N = 32, fewer at 16)."""
    decode32 = [(1, c) for c in torch.linspace(8192, 65536, 32).long().tolist()]
    return build(
        device,
        real_dims(),
        [
            ("csa decode b=1 ctx=64K", "csa", [(1, 65536)], {}),
            ("csa decode b=32 ctx=8K-64K", "csa", decode32, {}),
            ("csa decode b=32 ctx=8K-64K [BLOCK_N=16]", "csa", decode32, {"block_n": 16}),
            ("csa decode b=32 ctx=8K-64K [1 split]", "csa", decode32, {"num_splits": 1}),
            ("hca decode b=1 ctx=64K", "hca", [(1, 65536)], {}),
            ("hca decode b=32 ctx=8K-64K", "hca", decode32, {}),
            ("swa decode b=32", "swa", decode32, {}),
            ("csa prefill 2048 after 8K", "csa", [(2048, 8192)], {}),
            ("csa prefill 2048 after 8K [BLOCK_N=16]", "csa", [(2048, 8192)], {"block_n": 16}),
            ("hca prefill 2048 after 8K", "hca", [(2048, 8192)], {}),
        ],
    )


def smoke_cases(device: torch.device) -> list[GpuCase]:
    """dsv4-tiny-like dims for the CPU interpreter: decode (split-K), a ragged chunk, each layer kind."""
    dims = Dims(heads=4, head_dim=64, window=16, csa_ratio=4, topk=8, hca_ratio=16)
    return build(
        device,
        dims,
        [
            ("tiny csa decode", "csa", [(1, 40), (1, 7)], {"num_splits": 2}),
            ("tiny hca chunk", "hca", [(5, 30), (2, 0)], {}),
            ("tiny swa chunk", "swa", [(3, 20), (1, 2)], {}),
        ],
    )
