"""The output head on the CPU side by side: MKL, oneDNN's blocked weight, and the bf16 copy's kernels
(model/cpu_head.py, model/head_bf16_cpu.py) from fp32 rows and from bf16 rows.

dsv4-tiny's head (129,280 x 128, fp32 values of a bf16 checkpoint) times y [rows, 128] on one torch thread,
each batch size timed by every path in alternation: MKL on the K-major weight, oneDNN's blocked copy (what a head
off bf16's grid runs from two rows; two and three padded to four), and `CpuHead`'s bf16 copy from fp32 rows
(fused multiply-adds) and from bf16 rows (the engine's: vdpbf16ps where the CPU has it). Prints ms per product
(median, CPU clock), each path's speed-up over oneDNN, and the largest |difference| of its logits from MKL's.

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
from dsv4serve.model import cpu_head, head_bf16_cpu
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
    if head is None or head._packed is None:
        sys.exit("the bf16 copy's kernels did not compile here (see the log)")
    blocked = cpu_head._blocked_copy(weight)
    if blocked is None:
        sys.exit("oneDNN's blocked matmul is not available in this torch build (see the log)")
    onednn = CpuHead(weight, blocked)  # the path of a head off bf16's grid, on this head
    kernels = head_bf16_cpu.compiled()
    bf16_kernel = "vdpbf16ps" if kernels is not None and kernels.dot is not None else "fma: no AVX512_BF16"
    names = ["MKL", "oneDNN", "bf16 copy, fp32 rows", f"bf16 copy, bf16 rows ({bf16_kernel})"]
    results, rows_out = {}, []
    for rows in opts.rows:
        y = torch.randn(rows, dim, generator=g).to(torch.bfloat16).float()  # exact in bf16: every path sees one y
        yb = y.to(torch.bfloat16)
        fns = [lambda y=y: F.linear(y, weight), lambda y=y: onednn(y), lambda y=y: head(y), lambda yb=yb: head(yb)]
        paths = dict(zip(names, fns, strict=True))
        times: dict[str, list[float]] = {name: [] for name in paths}
        for fn in paths.values():
            fn()  # warm-up
        for _ in range(opts.repeats):
            for name, fn in paths.items():  # alternate: load on the machine hits every path alike
                t0 = time.process_time()
                fn()
                times[name].append(1e3 * (time.process_time() - t0))
        mkl = F.linear(y, weight)
        med = {name: statistics.median(t) for name, t in times.items()}
        diff = {name: float((fn() - mkl).abs().max()) for name, fn in paths.items()}
        results[rows] = {name: {"ms": med[name], "max_abs_diff": diff[name]} for name in paths}
        rows_out.append([str(rows)] + [f"{med[n]:.2f} ({med['oneDNN'] / med[n]:.1f}x, {diff[n]:.0e})" for n in paths])
    print(
        f"\nhead {vocab} x {dim}, CPU, 1 thread, ms per product (median of {opts.repeats}, CPU clock; "
        "speed-up over oneDNN, max |diff| from MKL)"
    )
    print(format_table(["rows", *names], rows_out))
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
