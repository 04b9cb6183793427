"""The output head (dsv4_kernels.head_logits: fp32 logits from the bf16 weight as stored) at
DeepSeek-V4-Flash's size: vocab_size x dim = 129280 x 4096 from the real config.json, for a decode
step of 1, 16 and 32 rows (memory-bound: the 1 GiB weight is the traffic); and the compressors' fused
[wkv; wgate] projection that runs on the same kernel with its K split (model/compressor.py): a CSA layer's
2 x 2 x 512 and its indexer's 2 x 2 x 128 rows by 4096, at 1 and 8 rows, against the cuBLAS fp32 GEMV it replaced.

Reference: the fp64 product of the same operands. The kernel's products are exact and only fp32
summation order differs (tests/kernels/test_head_logits.py), far below atol 1e-4 for logits of order
one; a head that rounded y to bf16 would be off by ~1e-3. Baselines, on the same inputs: the path the
kernel replaces (torch fp32 matmul on the head held in fp32: twice the memory and the reads) and, for
scale, a torch bf16 matmul (y rounded to bf16: faster, not the model's numerics).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from bench.gpu_cases import GpuCase, real_config_dir
from dsv4_kernels.head_logits import head_logits


def build(device: torch.device, vocab: int, dim: int, ms: tuple[int, ...], what: str = "head_logits") -> list[GpuCase]:
    gen = torch.Generator(device=device).manual_seed(11)
    w = (torch.randn(vocab, dim, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    w_fp32 = w.float()
    out = []
    for m in ms:
        y = torch.randn(m, dim, device=device, generator=gen)
        y_bf16 = y.to(torch.bfloat16)
        common = dict(
            reference=partial(lambda y: (y.double() @ w.double().t()).float(), y),
            atol=1e-4,
            rtol=1e-4,
            bytes_moved=vocab * dim * 2 + m * dim * 4 + m * vocab * 4,
            flops=2 * m * vocab * dim,
        )
        name = f"{what} {vocab}x{dim} m={m}"
        run = partial(head_logits, y, w)
        out.append(
            GpuCase(name, run, baseline=partial(F.linear, y, w_fp32), baseline_name="torch fp32 (fp32 head)", **common)
        )
        out.append(
            GpuCase(
                name + " [vs bf16]",
                run,
                baseline=partial(F.linear, y_bf16, w),
                baseline_name="torch bf16 (inexact)",
                **common,
            )
        )
    return out


def cases(device: torch.device) -> list[GpuCase]:
    from dsv4serve.model.args import read_model_args

    args = read_model_args(real_config_dir())
    compressors = [  # wkv and wgate fused: 2 x (2 x head_dim) for the overlapping CSA compressor and its indexer's
        c
        for rows in (4 * args.head_dim, 4 * args.index_head_dim)
        for c in build(device, rows, args.dim, (1, 8), "compressor projection")
        if "[vs bf16]" not in c.name
    ]
    return build(device, args.vocab_size, args.dim, (1, 16, 32)) + compressors


def smoke_cases(device: torch.device) -> list[GpuCase]:
    """Tiny shapes for the CPU interpreter (a ragged vocabulary and K)."""
    return build(device, 300, 200, (1, 5))
