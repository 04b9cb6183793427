"""The fp32 output head on the CPU, MKL against oneDNN's blocked weight, side by side (model/cpu_head.py).

dsv4-tiny's head (129,280 x 128, fp32 values of a bf16 checkpoint) times y [rows, 128] on one torch thread,
each batch size timed by both in alternation: MKL on the K-major weight (what every batch ran before), and
`CpuHead` (one to three rows through its bf16 copy's compiled loops, model/head_bf16_cpu.py; oneDNN's blocked
copy from four rows). Prints ms per product (median) and the ratio; the largest |difference| of the logits
against MKL's (0: bit for bit MKL's).

    python bench/bench_cpu_head.py [--rows 1 2 3 4 8 16 64] [--repeats 15] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench.report`
from bench.report import format_table
from dsv4serve.model.cpu_head import CpuHead
from dsv4serve.tiny.spec import TINY_CONFIG


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 64])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    vocab, dim = TINY_CONFIG["vocab_size"], TINY_CONFIG["hidden_size"]
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, dim, generator=g).to(torch.bfloat16).float().t().contiguous().t()  # K-major
    head = CpuHead.build(weight)
    if head is None:
        sys.exit("oneDNN's blocked matmul is not available in this torch build (see the log)")
    results, rows_out = {}, []
    for rows in opts.rows:
        y = torch.randn(rows, dim, generator=g)
        paths = {"mkl": lambda y=y: F.linear(y, weight), "cpu_head": lambda y=y: head(y)}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for fn in paths.values():
            fn()  # warm-up
        for _ in range(opts.repeats):
            for name, fn in paths.items():  # alternate: load on the machine hits both alike
                t0 = time.process_time()
                fn()
                times[name].append(1e3 * (time.process_time() - t0))
        mkl, ours = (statistics.median(times[n]) for n in paths)
        diff = float((head(y) - F.linear(y, weight)).abs().max())
        results[rows] = {"mkl_ms": mkl, "cpu_head_ms": ours, "speedup": mkl / ours, "max_abs_diff": diff}
        rows_out.append([str(rows), f"{mkl:.2f}", f"{ours:.2f}", f"{mkl / ours:.2f}x", f"{diff:.1e}"])
    print(f"\nfp32 head {vocab} x {dim}, CPU, 1 thread, ms per product (median of {opts.repeats}, CPU clock)")
    print(format_table(["rows", "MKL", "CpuHead", "speed-up", "max |diff|"], rows_out))
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
