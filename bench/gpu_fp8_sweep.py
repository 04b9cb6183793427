"""The FP8 projections of a decode step, timed over their K split on a GPU.

bench/gpu_profile.py put a batch-1 step's FP8 GEMMs at ~110 us a layer on an H200 (~1.3 TB/s). A decode tile is
128 output channels, so the narrow projections have few programs, each walking all of K: wkv (512 x 4096) runs
4 programs, wq_a (1024 x 4096) 8, wo_b (4096 x 8192) 32 with 64 K steps each, on 132 SMs. This times
fp8_linear at DeepSeek-V4-Flash's FP8 shapes (checkpoint tensor list: every FP8 projection of a CSA layer
that runs through fp8_linear) for M decode rows over split_k (fp8_gemm.py, split_k.py: one launch, the last
split to arrive adds the parts), checks each output against split 1 (the same bits expected: fp32 parts
added in split order, then one bf16 rounding; "close" when within 2^-7) and prints per shape the GB/s of
weight read and the best split; `--json` writes every row, `--write-tuning FILE` (or `auto`: the card's file
in dsv4_kernels/tuned/) records each shape's fastest checked split where fp8_linear reads it (tuning.py).
A call's time is what a CUDA graph of calls on copies of the weight (256 MB, past L2) takes per call
(bench/kernel_timing.py).

    python bench/gpu_fp8_sweep.py [--rows 1 8] [--repeats 20] [--json PATH]
    python bench/gpu_fp8_sweep.py --cpu-smoke     (tiny shapes, interpreted: a check of the code, no timing)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # bench.*, when run as a script

from bench.kernel_timing import time_us  # noqa: E402

COPIES_BYTES = 256 << 20  # each shape's weight copies together: past the H200's 60 MB L2
# (name, N, K, parts, normed): the FP8 projections fp8_linear runs in a CSA layer (an HCA layer has all but the
# indexer's). wq_a [1024 x 4096] and wkv [512 x 4096] run as one launch since 2026-12-07 (dsv4serve/model/joined_fp8.py:
# `parts`, whose own tuned splits, 16 each on the H200, stand in for the joined shape's until this measures it); the
# two wq_b apply q_norm in their launch (`normed`: fp8_linear's norm, a K pass over the rows before the GEMM)
SHAPES = (
    ("attn.wq_a+wkv", 1536, 4096, (1024, 512), False),
    ("attn.wq_b", 32768, 1024, (), True),
    ("attn.wo_b", 4096, 8192, (), False),
    ("attn.indexer.wq_b", 8192, 1024, (), True),
    ("ffn.shared_experts.w2", 4096, 2048, (), False),
)
SMOKE_SHAPES = (("small_n", 256, 1024, (), True), ("wide_n", 1024, 256, (128, 896), False))
SPLITS = (1, 2, 4, 8, 16, 32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write-tuning", type=Path, help="record each shape's fastest checked split here (or auto)")
    parser.add_argument("--cpu-smoke", action="store_true")
    opts = parser.parse_args()
    if opts.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --cpu-smoke)")
    sys.path.insert(0, str(REPO / "kernels"))
    from dsv4_kernels import tuning
    from dsv4_kernels.fp8_gemm import fp8_linear, pick_split_k

    dev = torch.device("cpu" if opts.cpu_smoke else "cuda")
    device = tuning.device_name(dev) or "cpu"
    if str(opts.write_tuning) == "auto":
        opts.write_tuning = tuning.file_for(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for m in opts.rows:
        for name, n, k, parts, normed in SMOKE_SHAPES if opts.cpu_smoke else SHAPES:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            norm = (0.5 + torch.rand(k, device=dev, generator=gen), 1e-6) if normed else None
            copies = 1 if opts.cpu_smoke else min(64, max(4, -(-COPIES_BYTES // (n * k))))
            ws = [(0.5 * torch.randn(n, k, device=dev, generator=gen)).to(torch.float8_e4m3fn) for _ in range(copies)]
            wss = torch.full((-(-n // 128), k // 128), 120, dtype=torch.uint8, device=dev)
            nbytes = ws[0].numel() + wss.numel()
            ref = fp8_linear(x, ws[0], wss, split_k=1, norm=norm).float()
            default = pick_split_k(m, n, k, dev, parts)
            timed = []
            for s in SPLITS:
                if (k // 128) % s:
                    continue
                y = fp8_linear(x, ws[0], wss, split_k=s, norm=norm).float()
                same = torch.equal(y, ref)
                close = bool(((y - ref).abs() <= 2.0**-7 * ref.abs() + 1e-3).all())
                us = time_us([partial(fp8_linear, x, w, wss, split_k=s, norm=norm) for w in ws], opts.repeats)
                check = "same" if same else ("close" if close else "DIFFERS")
                timed.append((us, s, check))
                rows.append({"rows": m, "name": name, "N": n, "K": k, "split_k": s, "us": us,
                             "GBps": nbytes / us / 1e3, "check": check, "default": s == default})  # fmt: skip
            line = ", ".join(f"split {s}: {us:.1f} us {nbytes / us / 1e3:.0f} GB/s {c}" for us, s, c in timed)
            best = min(timed)
            base = next(us for us, s, _ in timed if s == default)
            gain = f"{base / best[0]:.2f}x the default {default}"
            print(f"M={m} {name} [{n} x {k}]: {line}; best split {best[1]} ({gain})", flush=True)
            checked = min((us, s) for us, s, c in timed if c != "DIFFERS")
            if opts.write_tuning:
                measured = f"{time.strftime('%Y-%m-%d')}: bench/gpu_fp8_sweep.py"
                tuning.record(opts.write_tuning, ("fp8_gemm", f"{n}x{k}"), m, checked[1], device, measured)
        mine = [r for r in rows if r["rows"] == m]
        names = {r["name"] for r in mine}
        at_default = sum(r["us"] for r in mine if r["default"])
        at_best = sum(min(r["us"] for r in mine if r["name"] == nm) for nm in names)
        print(f"M={m}: the {len(names)} projections, default splits {at_default:.1f} us, best splits {at_best:.1f} us",
              flush=True)  # fmt: skip
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
