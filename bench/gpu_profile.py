"""Where a decode step's time goes on a GPU: the kernels of one step, eager and replayed, by device time.

DeepSeek-V4-Flash's real dimensions cut to 2 layers (one CSA, one HCA: bench/gpu_cases/end_to_end.bench_args),
a random model with the worker's numerics, the rows of bench/gpu_cases/_decode_engine.DecodeBench (each
prefilled with --context random tokens), experts resident. For each batch size in --batch, under
torch.profiler: --steps eager steps (build_layout + Transformer.run, what --enforce-eager runs) and --steps
replays of the captured decode graph. Printed per mode: the step's wall time (CUDA events), the sum of its
kernels' device time, the number of kernels a step launches, and the kernels that take the most device time
(name, calls per step, us per step, share). The gap between the wall time and the kernels' sum is what the
GPU spent idle: launch overhead in eager, nothing much in a replay; the kernels' sum is what fusing and
faster kernels have to cut.

    python bench/gpu_profile.py [--batch 1 8] [--context 2048] [--steps 5] [--top 30] [--json PATH]
    python bench/gpu_profile.py --cpu-smoke      # dsv4-tiny, the Triton interpreter: checks the code path

On a GPU run it from bench/gpu_session.sh's environment (the repository and kernels/ on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def kernel_table(prof, steps: int) -> list[dict]:
    """Device-side kernels of the profiled steps, summed by name, per step, largest first."""
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        entry = per_name[evt.name]
        entry[0] += evt.time_range.elapsed_us()
        entry[1] += 1
    rows = [{"kernel": k, "us_per_step": v[0] / steps, "calls_per_step": v[1] / steps} for k, v in per_name.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def profile_mode(bench, mode: str, n: int, steps: int, top: int, device: torch.device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu_check import time_ms

    step = (lambda: bench.eager_step(n)) if mode == "eager" else (lambda: bench.graph_step("resident", n))
    bench.snapshot(n)
    step()  # warm (compiles, the capture of every bucket the first time)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time_ms(step, device, 0, steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    bench.restore()
    table = kernel_table(prof, steps)
    total = sum(r["us_per_step"] for r in table)
    launches = sum(r["calls_per_step"] for r in table)
    print(
        f"\nbs={n} {mode}: wall {wall:.3f} ms a step; kernels {total / 1e3:.3f} ms a step "
        f"({launches:.0f} kernels); idle {max(0.0, wall - total / 1e3):.3f} ms"
    )
    for r in table[:top]:
        share = 100 * r["us_per_step"] / total if total else 0.0
        print(f"  {r['us_per_step']:9.1f} us {share:5.1f}%  x{r['calls_per_step']:<5.0f} {r['kernel'][:110]}")
    return {"batch": n, "mode": mode, "wall_ms": wall, "kernel_ms": total / 1e3, "kernels": launches, "top": table}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--cpu-smoke", action="store_true")
    opts = parser.parse_args()
    if opts.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(REPO))
    from bench.gpu_cases import two_layer_model
    from bench.gpu_cases._decode_engine import DecodeBench

    device, args = two_layer_model(opts.cpu_smoke)
    extra = (len(opts.batch) * 2 + 2) * (opts.steps * 2 + 2)
    bench = DecodeBench(device, args, max(opts.batch), opts.context, extra)
    t0 = time.monotonic()
    bench.setup()
    bench.use("resident")
    print(f"set-up {time.monotonic() - t0:.0f} s (random model, {max(opts.batch)} rows of {opts.context} tokens)")
    results = [
        profile_mode(bench, mode, n, opts.steps, opts.top, device) for n in opts.batch for mode in ("eager", "graphs")
    ]
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
