"""A batch-1 decode timeline model of DeepSeek-V4-Flash on an RTX 5090 (32 GB, 1.79 TB/s) with a 128 GB DDR5
host, from memory/decode_speed.py and the memory plan `dsv4serve plan` makes for that machine (no GPU needed).

Assumed host: 2 x 64 GB DDR5-5600, one DIMM per channel (a desktop board keeps the rated speed at 1 DIMM per
channel; 4 x 32 GB usually drops to 4400-5200 MT/s): 2 channels x 8 B x 5600 MT/s = 89.6 GB/s peak,
--host-bandwidth 80 sustained. PCIe 5.0 x16 pinned: 50 GB/s. CPU experts at --cpu-efficiency of the host
bandwidth (bench/bench_cpu_experts.py measures it on the machine at hand). Prints the term-by-term timeline,
the tokens/s over a grid of host bandwidths and efficiencies, what it takes to reach the issue's target
(>= 30 tok/s), and the model run on FreeToken's published setup as a cross-check.

The timeline and the target's analysis assume the bank pinned in host RAM beside kt-kernel's copy (about 330 GiB)
and hybrid steps captured as CUDA graphs (experts/hybrid_graph.py). `as run` then projects both backends as the
worker runs them on the 128 GB host itself (memory/decode_choice.py): the bank (137 GiB) does not fit it, the rest
stays on disk, and the decode graphs are cut where the host stages those layers (experts/graph_cuts.py).

    python bench/decode_timeline.py [--host-bandwidth 80] [--h2d-bandwidth 50] [--cpu-efficiency 0.5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dsv4serve.cli import build_parser
from dsv4serve.config import options
from dsv4serve.env import read_environment
from dsv4serve.memory import decode_speed as ds
from dsv4serve.memory.decode_choice import project_backends
from dsv4serve.memory.plan import Machine
from dsv4serve.model.args import read_model_args
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.schema import checkpoint_schema
from dsv4serve.plan_cli import build_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench.report`
from bench.report import format_table

REPO = Path(__file__).resolve().parents[1]

TARGET_TOKENS_S = 30.0  # issue 18
FREETOKEN_TOKENS_S = (24.5, 26.9)  # issue 18: RTX 5090, 8-channel DDR4
FREETOKEN_HYBRID_GBPS = 119.5  # issue 18: FreeToken's measured hybrid ceiling (CPU + PCIe), all 258 uses missed
REAL = REPO / "tests" / "data" / "DeepSeek-V4-Flash"


def plan_slots(gpu_memory: str, host_memory: str) -> int:
    """The expert slots `dsv4serve plan` gives that machine (default settings)."""
    env = read_environment({}, tuple(options()))
    ns = build_parser("plan").parse_args(
        ["--model", str(REAL), "--gpu-memory", gpu_memory, "--host-memory", host_memory]
    )
    return build_plan(ns, env)["memory_plan"]["experts"]["slots"]


def timeline(p: ds.DecodeProjection) -> str:
    rows = [[t.name, "serial", f"{t.seconds * 1e3:.2f}", t.detail] for t in p.serial]
    rows += [[t.name, "MoE lane", f"{t.seconds * 1e3:.2f}", t.detail] for t in p.parallel]
    rows += [["step", "", f"{p.step_seconds * 1e3:.2f}", f"{p.tokens_per_second:.1f} tokens/s ({p.bound_by})"]]
    return format_table(["term", "lane", "ms", "detail"], rows)


def with_host(bw: ds.Bandwidths, host_gbps: float) -> ds.Bandwidths:
    return ds.Bandwidths(bw.gpu_gbps, bw.h2d_gbps, host_gbps, bw.cpu_efficiency)


def required_host_gbps(b: ds.DecodeBytes, slots: int, bw: ds.Bandwidths, target: float) -> float | None:
    """The host memory GB/s (CPU experts at bw's efficiency of it) at which hybrid reaches `target` tokens/s
    with uniform hits; None above 2 TB/s."""
    lo, hi = 0.1, 2000.0
    if ds.project_decode(b, slots, with_host(bw, hi)).tokens_per_second < target:
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ds.project_decode(b, slots, with_host(bw, mid)).tokens_per_second < target else (lo, mid)
    return hi


def required_hit_rate(b: ds.DecodeBytes, slots: int, bw: ds.Bandwidths, target: float) -> float | None:
    lo, hi = 0.0, 1.0
    if ds.project_decode(b, slots, bw, hit_rate=1.0).tokens_per_second < target:
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ds.project_decode(b, slots, bw, hit_rate=mid).tokens_per_second < target else (lo, mid)
    return hi


def run(ns: argparse.Namespace) -> dict:
    args = read_model_args(REAL)
    b = ds.decode_bytes(checkpoint_schema(args), args, KernelBackends.every("triton"))
    slots = plan_slots("32GiB", "128GiB")
    bw = ds.Bandwidths(1790.0, ns.h2d_bandwidth, ns.host_bandwidth, ns.cpu_efficiency)
    head = {k: ds.project_decode(b, slots, bw, k) for k in ("offload", "hybrid")}
    eager = ds.project_decode(b, slots, bw, "hybrid", cuda_graphs=False)
    bank = sum(s.nbytes for s in checkpoint_schema(args) if s.group == "routed_experts" and s.layer < args.n_layers)
    host = Machine(32 * 2**30, 128 * 2**30, "native")
    as_run = project_backends(b, slots, bank, host, bw, False, ("offload", "hybrid"))
    grid = {
        (host, eff): ds.project_decode(b, slots, ds.Bandwidths(1790.0, ns.h2d_bandwidth, host, eff)).tokens_per_second
        for host in ns.grid_host
        for eff in ns.grid_efficiency
    }
    # FreeToken's setup: every use missed (3.45 GB a token) at their measured 119.5 GB/s CPU + PCIe ceiling
    moe_ceiling_s = b.expert_uses * b.expert_bytes / (FREETOKEN_HYBRID_GBPS * 1e9)
    serial_s = sum(t.seconds for t in head["hybrid"].serial)
    return {
        "slots": slots,
        "bandwidths": vars(bw) | {"device_read_efficiency": ds.DEVICE_READ_EFFICIENCY},
        "projections": {k: p.to_json() for k, p in head.items()} | {"hybrid eager": eager.to_json()},
        "as_run_on_128_gib": {
            k: {"tokens_per_second": round(p.tokens_per_second, 2), "eager": why, "tiers": vars(t) | {"disk": t.disk}}
            for k, (p, t, why) in as_run.items()
        },
        "grid_tokens_s": {f"{h:g} GB/s x {e:g}": v for (h, e), v in grid.items()},
        "target_tokens_s": TARGET_TOKENS_S,
        "required_host_gbps": required_host_gbps(b, slots, bw, TARGET_TOKENS_S),
        "required_hit_rate": required_hit_rate(b, slots, bw, TARGET_TOKENS_S),
        "freetoken": {
            "measured_tokens_s": FREETOKEN_TOKENS_S,
            "moe_only_ceiling_tokens_s": 1 / moe_ceiling_s,
            "with_our_serial_terms_tokens_s": 1 / (moe_ceiling_s + serial_s),
        },
        "_objects": (head, eager, grid),
    }


def report(r: dict, ns: argparse.Namespace) -> str:
    head, eager, grid = r.pop("_objects")
    h = head["hybrid"]
    lines = [
        f"RTX 5090 (1790 GB/s x {ds.DEVICE_READ_EFFICIENCY}) + 128 GB DDR5 ({ns.host_bandwidth:g} GB/s, CPU experts at "
        f"{ns.cpu_efficiency:g} of it), PCIe {ns.h2d_bandwidth:g} GB/s; plan: {r['slots']} expert slots; "
        f"{ds.CENSUS_LAUNCHES_PER_STEP} launches",
        "",
        "hybrid, CUDA graphs, the bank pinned beside kt-kernel's copy (a host with ~330 GiB of RAM; hybrid graphs "
        "are not built):",
        timeline(h),
        f"offload (PCIe only): {head['offload'].tokens_per_second:.1f} tokens/s; hybrid eager (no CUDA graphs): "
        f"{eager.tokens_per_second:.1f} tokens/s; hybrid puts {100 * h.cpu_fraction:.0f}% of the misses on the CPU",
        "",
        "hybrid tokens/s by host bandwidth (rows) and CPU expert efficiency (columns):",
    ]
    rows = [[f"{host:g} GB/s", *(f"{grid[(host, e)]:.1f}" for e in ns.grid_efficiency)] for host in ns.grid_host]
    lines.append(format_table(["host", *(f"x {e:g}" for e in ns.grid_efficiency)], rows))
    need_host, need_hits = r["required_host_gbps"], r["required_hit_rate"]
    ft = r["freetoken"]
    run_on = r["as_run_on_128_gib"]
    lines += [
        "",
        "as run on the 128 GiB host (the bank's tiers from the host memory plan; graphs cut where the host stages): "
        + "; ".join(
            f"{k} {v['tokens_per_second']:.1f} tokens/s ({100 * v['tiers']['disk']:.0f}% of the bank on disk, "
            f"{'eager: ' + v['eager'] if v['eager'] else 'CUDA graphs'})"
            for k, v in run_on.items()
        ),
    ]
    lines += [
        "",
        f"target {TARGET_TOKENS_S:g} tokens/s (issue 18; FreeToken {FREETOKEN_TOKENS_S[0]}-{FREETOKEN_TOKENS_S[1]}): "
        + (
            f"needs host memory at {need_host:.0f} GB/s (CPU experts at {ns.cpu_efficiency:g} of it)"
            if need_host
            else "out of reach at any host memory rate"
        )
        + f" with uniform hits ({h.hits_per_token:.1f} of 258), or "
        + (f"a slot hit rate of {100 * need_hits:.0f}%" if need_hits else "no hit rate")
        + f" at {ns.host_bandwidth:g} x {ns.cpu_efficiency:g} GB/s",
        f"cross-check on FreeToken's setup (all 258 uses missed at their 119.5 GB/s hybrid ceiling): MoE alone "
        f"{ft['moe_only_ceiling_tokens_s']:.1f} tokens/s, with this model's serial terms "
        f"{ft['with_our_serial_terms_tokens_s']:.1f}; they measured {FREETOKEN_TOKENS_S[0]}-{FREETOKEN_TOKENS_S[1]}",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host-bandwidth", type=float, default=80.0)
    parser.add_argument("--h2d-bandwidth", type=float, default=50.0)
    parser.add_argument("--cpu-efficiency", type=float, default=ds.DEFAULT_CPU_EFFICIENCY)
    parser.add_argument("--grid-host", type=float, nargs="+", default=[60.0, 80.0, 100.0])
    parser.add_argument("--grid-efficiency", type=float, nargs="+", default=[0.24, 0.5, 0.8])
    parser.add_argument("--json", type=Path)
    ns = parser.parse_args()
    result = run(ns)
    print(report(result, ns))
    if ns.json:
        ns.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
