"""The routed experts' MXFP4 GEMMs at decode, timed over their K-loop forms and launch choices on a GPU.

bench/gpu_profile.py put the two fp4_moe GEMMs of a batch-1 decode step at ~280 GB/s on an H200 (six experts:
53.5 MB of gate/up weights, 26.7 MB of down weights; the copy bandwidth is 4.3 TB/s). This times each GEMM
alone (moe_align done outside) at DeepSeek-V4-Flash's sizes for T tokens (random experts and routing,
as bench/gpu_cases/fp4_moe.py draws them) over the kernel's K-loop forms (fp4_moe.LoopForm: the joined tile
or the even / odd K halves as two dots; the next tile's bytes prefetched or not; the late-scale loop, whose
scales multiply each 32-channel dot's sums instead of each weight; K split over 1-8 programs
with a second launch adding the splits) and BLOCK_K, num_warps, num_stages (and BLOCK_N for the down GEMM;
the gate/up tile is 128 channels wide, one activation block for its FP8 epilogue). Each output is checked
against the default choice's: "same" (bit for bit), "close" (the gate/up's FP8 act within one e4m3 step,
the down's bf16 within 2%: a split changes the fp32 summation order) or "DIFFERS". Prints each (T, GEMM)
fastest first with the GB/s of weights read, then the best per (T, GEMM); `--json` writes every row, and
`--write-tuning FILE` records the fastest checked choice per (T, GEMM) where fp4_moe reads it (tuning.py; the
card's file is `python -c "from dsv4_kernels.tuning import *; print(file_for(device_name(...)))"`, or pass
`auto`). A call's time is what a CUDA graph of calls on 8 routings (430 MB of experts, past L2) takes per call
(bench/kernel_timing.py: an eager launch's Python would be counted, and one routing's weights sit in L2).

    python bench/gpu_fp4_sweep.py [--tokens 1 8] [--repeats 20] [--budget-s 240] [--json PATH]
    python bench/gpu_fp4_sweep.py --cpu-smoke     (the same code on tiny sizes, interpreted: a check, no timing)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # bench.*, when run as a script

from bench.kernel_timing import time_us  # noqa: E402

ROUTINGS = 8  # x 6 experts x 8.9 MB (gate/up) a call: 430 MB, far past the H200's 60 MB L2
# (even_odd, prefetch, late_scale): the joined tile; the scales applied to each 32-channel dot's sums instead of
# each weight (bench/sass_loops.py: ~0.63x the loop's instructions; second, so a spent budget still times it);
# the even / odd halves, prefetch, both (slower than the joined tile at every size on the H200, 2026-12-04b)
LOOPS = ((False, False, False), (False, False, True), (True, False, False), (False, True, False), (True, True, False))


def grids(tokens: int):
    """(gemm, choice) pairs to time: everything at batch 1, the loop forms at the default tiles beyond."""
    splits = (1, 2, 4)
    if tokens == 1:  # 3 stages: the best of 2-4 at every tile in the first sweep (bench/gpu_runs/2026-12-04)
        for (eo, pf, ls), sk, (bk, warps) in itertools.product(LOOPS, splits, ((64, 8), (128, 8), (64, 4))):
            yield "gate_up", dict(even_odd=eo, prefetch=pf, late_scale=ls, split_k=sk, bk=bk, warps=warps, stages=3)
        for (eo, pf, ls), sk, (bn, bk) in itertools.product(LOOPS, splits, ((64, 128), (64, 64), (128, 128))):
            yield "down", dict(even_odd=eo, prefetch=pf, late_scale=ls, split_k=sk, bn=bn, bk=bk, warps=4, stages=3)
        return
    for (eo, pf, ls), sk in itertools.product(LOOPS, splits):
        yield "gate_up", dict(even_odd=eo, prefetch=pf, late_scale=ls, split_k=sk, bk=64, warps=8, stages=3)
    for (eo, pf, ls), sk in itertools.product(LOOPS, splits):
        yield "down", dict(even_odd=eo, prefetch=pf, late_scale=ls, split_k=sk, bn=64, bk=128, warps=4, stages=3)


def label(choice: dict) -> str:
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in choice.items())


def sweep(t: int, opts, deadline: float) -> list[dict]:
    from bench.gpu_cases.fp4_moe import MoeDims, random_experts, real_dims
    from dsv4_kernels.fp4_moe import LoopForm, fp4_moe_gemm
    from dsv4_kernels.fp4_moe_choices import pick_block_k, pick_block_m
    from dsv4_kernels.moe_align import moe_align

    dev = torch.device("cpu" if opts.cpu_smoke else "cuda")
    d = MoeDims(256, 256, 8, 2, 10.0) if opts.cpu_smoke else real_dims()
    gen = torch.Generator(device=dev).manual_seed(0)
    w1, s1, w3, s3, w2, s2 = random_experts(d, dev, gen)
    x = (2 * torch.randn(t, d.dim, device=dev, generator=gen)).to(torch.bfloat16)
    weights = 2.5 * torch.rand(t, d.topk, device=dev, generator=gen)
    routes = t * d.topk
    bm = pick_block_m(routes, d.experts)
    # ROUTINGS independent routings (moe_align's layouts), one per timed call: their experts' weights together
    # exceed L2, as a decode step's layers do (bench/kernel_timing.py); the checks use the first
    ids = [torch.rand(t, d.experts, device=dev, generator=gen).argsort(dim=1)[:, : d.topk].contiguous()
           for _ in range(1 if opts.cpu_smoke else ROUTINGS)]  # fmt: skip
    layouts = [moe_align(i, d.experts, bm) for i in ids]
    used = int(ids[0].unique().numel())
    nbytes = {"gate_up": used * 2 * (w1[0].numel() + s1[0].numel()), "down": used * (w2[0].numel() + s2[0].numel())}

    def gate_up(loop=None, bk=None, warps=None, stages=None, r=0):
        """loop None, bk None: the built-in form and pick_block_k's tile (the defaults)."""
        return fp4_moe_gemm(
            x, None, w1, s1, *layouts[r], routes, d.topk, w3=w3, w3_scale=s3, topk_weights=weights,
            limit=d.limit, block_m=bm, block_n=128, block_k=bk or pick_block_k(bm, True, dev), quant_out=True,
            num_warps=warps, num_stages=stages, loop=loop,
        )  # fmt: skip

    acts = [gate_up(r=r) for r in range(len(layouts))]
    act_q, act_s = acts[0]

    def down(loop=None, bn=64, bk=None, warps=None, stages=None, r=0):
        return fp4_moe_gemm(
            *acts[r], w2, s2, *layouts[r], routes, 1, block_m=bm, block_n=bn,
            block_k=bk or pick_block_k(bm), num_warps=warps, num_stages=stages, loop=loop,
        )  # fmt: skip

    def calls(fn, **kw) -> list:
        return [partial(fn, r=r, **kw) for r in range(len(layouts))]

    def timed(gemm: str, even_odd: bool, prefetch: bool, late_scale: bool, split_k: int, **tile) -> list:
        loop = LoopForm(even_odd, prefetch, split_k, late_scale)
        return calls(gate_up if gemm == "gate_up" else down, loop=loop, **tile)

    ref_act = (act_q.float().view(routes, -1, 128) * act_s[:, :, None]).view(routes, -1)
    ref_down = down().float()

    def verdict(gemm: str, out) -> str:
        if gemm == "gate_up":
            q, s = out
            got = (q.float().view(routes, -1, 128) * s[:, :, None]).view(routes, -1)
            if torch.equal(q.view(torch.uint8), act_q.view(torch.uint8)) and torch.equal(s, act_s):
                return "same"
            ok = bool(((got - ref_act).abs() <= 2.0**-3 * ref_act.abs() + 1e-6 * s.max()).all())
            return "close" if ok else "DIFFERS"
        if torch.equal(out.float(), ref_down):
            return "same"
        return "close" if bool(((out.float() - ref_down).abs() <= 2e-2 * ref_down.abs() + 1e-2).all()) else "DIFFERS"

    defaults = {"gate_up": time_us(calls(gate_up), opts.repeats), "down": time_us(calls(down), opts.repeats)}
    print(f"T={t}: {used} experts, block_m {bm}; gate/up reads {nbytes['gate_up'] / 1e6:.1f} MB, down "
          f"{nbytes['down'] / 1e6:.1f} MB; defaults: gate_up {defaults['gate_up']:.1f} us "
          f"({nbytes['gate_up'] / defaults['gate_up'] / 1e3:.0f} GB/s), down {defaults['down']:.1f} us "
          f"({nbytes['down'] / defaults['down'] / 1e3:.0f} GB/s)", flush=True)  # fmt: skip
    rows = []
    grid = list(grids(t))
    for gemm, choice in grid[:: max(1, len(grid) // 12)] if opts.cpu_smoke else grid:
        if time.monotonic() > deadline:
            print(f"T={t}: budget spent, the rest of the grid not timed", flush=True)
            break
        fns = timed(gemm, **choice)
        try:
            check = verdict(gemm, fns[0]())
            us = time_us(fns, opts.repeats)
        except Exception as exc:  # a choice that does not build (shared memory) is a line, not the end
            print(f"T={t} {gemm} {label(choice)}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            continue
        rows.append({"tokens": t, "gemm": gemm, **choice, "us": us, "GBps": nbytes[gemm] / us / 1e3,
                     "default_us": defaults[gemm], "check": check})  # fmt: skip
    for gemm in ("gate_up", "down"):
        mine = sorted((r for r in rows if r["gemm"] == gemm), key=lambda r: r["us"])
        for r in mine[: opts.top]:
            choice = {k: r[k] for k in r if k not in ("tokens", "gemm", "us", "GBps", "default_us", "check")}
            print(f"T={t} {gemm:7s} {r['us']:8.1f} us {r['GBps']:6.0f} GB/s  {r['check']:7s} {label(choice)}")
        if mine:
            print(f"T={t} {gemm}: best {mine[0]['us']:.1f} us vs default {defaults[gemm]:.1f} us "
                  f"({defaults[gemm] / mine[0]['us']:.2f}x)", flush=True)  # fmt: skip
        good = [r for r in mine if r["check"] != "DIFFERS"]
        if opts.write_tuning and good:
            write_choice(opts.write_tuning, gemm, routes, good[0], dev)
    return rows


TUNED_KEYS = {"even_odd": "even_odd", "prefetch": "prefetch", "late_scale": "late_scale", "split_k": "split_k",
              "bk": "block_k", "warps": "num_warps", "stages": "num_stages", "bn": "block_n"}  # fmt: skip


def write_choice(path: Path, gemm: str, routes: int, row: dict, dev: torch.device) -> None:
    """The fastest checked choice, as fp4_moe reads it (dsv4_kernels/tuning.py), at `routes` routes."""
    from dsv4_kernels import tuning

    choice = {TUNED_KEYS[k]: v for k, v in row.items() if k in TUNED_KEYS}
    name = tuning.device_name(dev) or "cpu"
    measured = (
        f"{time.strftime('%Y-%m-%d')}: bench/gpu_fp4_sweep.py, {row['us']:.1f} us (default {row['default_us']:.1f})"
    )
    tuning.record(path, ("fp4_moe", gemm), routes, choice, name, measured)
    print(f"wrote {gemm} at {routes} routes to {path}: {choice}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--top", type=int, default=25, help="rows printed per (T, GEMM)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop timing new choices after this")
    parser.add_argument("--json", type=Path, help="write every timed row here")
    parser.add_argument("--write-tuning", type=Path, help="record the fastest checked choices in this tuning file")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, a dozen choices, Triton's interpreter")
    opts = parser.parse_args()
    if opts.cpu_smoke:
        import os

        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported (in sweep)
    elif not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --cpu-smoke)")
    if str(opts.write_tuning) == "auto":
        from dsv4_kernels import tuning

        opts.write_tuning = tuning.file_for(tuning.device_name(torch.device("cuda")) or "cpu")
    sizes = {t: len(list(grids(t))) for t in opts.tokens}  # each T's share of the budget: its grid's
    rows = []
    for t in opts.tokens:
        deadline = time.monotonic() + opts.budget_s * sizes[t] / sum(sizes.values())
        rows += sweep(t, opts, deadline)
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
