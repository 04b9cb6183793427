"""The routed experts' MXFP4 GEMMs at batch-1 decode, timed over their launch choices on a GPU.

bench/gpu_profile.py puts the two fp4_moe GEMMs of a decode step at ~120 us a call on an H200 at batch 1
(six experts: 50 MB of gate/up weights, 25 MB of down weights, so ~15 us at the copy bandwidth). This times
each GEMM alone (moe_align done once, outside) at DeepSeek-V4-Flash's sizes for T tokens (random experts and
routing, as bench/gpu_cases/fp4_moe.py draws them) over BLOCK_K, num_warps and num_stages (and BLOCK_N for
the down GEMM; the gate/up tile is 128 channels wide, one activation block for its FP8 epilogue), checks each
output against the default choice's, and prints them fastest first with the GB/s of weights read.

    python bench/gpu_fp4_sweep.py [--tokens 1] [--repeats 20]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def time_us(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(1e3 * start.elapsed_time(end))
    return sorted(samples)[len(samples) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    sys.path.insert(0, str(REPO))
    from bench.gpu_cases.fp4_moe import random_fp4, real_dims
    from dsv4_kernels.fp4_moe import fp4_moe_gemm, moe_align, pick_block_k, pick_block_m

    dev = torch.device("cuda")
    d = real_dims()
    gen = torch.Generator(device=dev).manual_seed(0)
    w1, s1 = random_fp4(d.experts, d.inter, d.dim, 118, dev, gen)
    w3, s3 = random_fp4(d.experts, d.inter, d.dim, 118, dev, gen)
    w2, s2 = random_fp4(d.experts, d.dim, d.inter, 121, dev, gen)
    t = opts.tokens
    x = (2 * torch.randn(t, d.dim, device=dev, generator=gen)).to(torch.bfloat16)
    ids = torch.rand(t, d.experts, device=dev, generator=gen).argsort(dim=1)[:, : d.topk].contiguous()
    weights = 2.5 * torch.rand(t, d.topk, device=dev, generator=gen)
    routes = t * d.topk
    bm = pick_block_m(routes, d.experts)
    sorted_ids, expert_ids = moe_align(ids, d.experts, bm)
    used = int(ids.unique().numel())
    up_bytes = used * 2 * (w1[0].numel() + s1[0].numel())
    down_bytes = used * (w2[0].numel() + s2[0].numel())

    def gate_up(bk=None, warps=None, stages=None):
        return fp4_moe_gemm(
            x, None, w1, s1, sorted_ids, expert_ids, routes, d.topk, w3=w3, w3_scale=s3, topk_weights=weights,
            limit=d.limit, block_m=bm, block_n=128, block_k=bk or pick_block_k(bm, True, dev), quant_out=True,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip

    act_q, act_s = gate_up()

    def down(bn=64, bk=None, warps=None, stages=None):
        return fp4_moe_gemm(
            act_q, act_s, w2, s2, sorted_ids, expert_ids, routes, 1, block_m=bm, block_n=bn,
            block_k=bk or pick_block_k(bm), num_warps=warps, num_stages=stages,
        )  # fmt: skip

    ref_up, ref_down = act_q.float(), down().float()
    print(f"T={t}: {used} experts, block_m {bm}; gate/up reads {up_bytes / 1e6:.1f} MB, down {down_bytes / 1e6:.1f} MB")
    results = []
    for bk, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
        try:
            fn = partial(gate_up, bk, warps, stages)
            same = torch.equal(fn()[0].float(), ref_up)
            us = time_us(fn, opts.repeats)
            results.append((us, f"gate_up bk={bk} warps={warps} stages={stages}", up_bytes, same))
        except Exception as exc:  # a choice that does not build (shared memory) is a line, not the end
            print(f"gate_up bk={bk} warps={warps} stages={stages}: {type(exc).__name__}: {str(exc)[:100]}")
    for bn, bk, warps, stages in itertools.product((32, 64, 128), (64, 128), (4, 8), (2, 3, 4)):
        try:
            fn = partial(down, bn, bk, warps, stages)
            same = bool(((fn().float() - ref_down).abs() <= 2e-2 * ref_down.abs() + 1e-2).all())
            us = time_us(fn, opts.repeats)
            results.append((us, f"down bn={bn} bk={bk} warps={warps} stages={stages}", down_bytes, same))
        except Exception as exc:
            print(f"down bn={bn} bk={bk} warps={warps} stages={stages}: {type(exc).__name__}: {str(exc)[:100]}")
    base_up = time_us(gate_up, opts.repeats)
    base_down = time_us(down, opts.repeats)
    print(f"defaults: gate_up {base_up:.1f} us ({up_bytes / base_up / 1e3:.0f} GB/s), "
          f"down {base_down:.1f} us ({down_bytes / base_down / 1e3:.0f} GB/s)")  # fmt: skip
    for us, name, nbytes, same in sorted(results):
        print(f"{us:9.1f} us {nbytes / us / 1e3:7.0f} GB/s  {'same' if same else 'DIFFERS'}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
