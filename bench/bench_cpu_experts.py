"""The CPU expert path's streaming rate (GB/s) against this machine's measured memory bandwidth.

One MoE layer of DeepSeek-V4-Flash's routed experts at its real dimensions (D 4096, I 2048, MXFP4 as the
checkpoint stores them, 12.75 MiB an expert; `--experts` of them, 32 by default so the torch path's bf16 copy
fits in RAM), top-6 routing drawn uniformly per token, at batch 1 and 16 and 1..n threads:
- kt-kernel (dsv4serve/experts/kt_experts.py, the hybrid backend's CPU path) when installed;
- torch on the same experts dequantized to bf16 once (gate / up, clamped SwiGLU, down, per expert).
GB/s counts the MXFP4 bytes of the distinct experts a forward touches (the unit memory/decode_speed.py prices
a miss in), so both paths are on one scale; the torch path really reads 3.76x those bytes (bf16), shown too.
The memory bandwidth is doctor's copy (dsv4serve/doctor_host.py: read + write, median), measured before and
after. Paths and thread counts alternate repeat by repeat so the shared machine's load hits them alike.

    python bench/bench_cpu_experts.py [--experts 32] [--threads 1 2] [--batch 1 16] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench.report`
from bench.report import format_table, spread
from dsv4_kernels.formats import dequant_fp4
from dsv4serve.doctor_host import measure_host_bandwidth
from dsv4serve.experts.kt_backend import kt_kernel_available

D, I, TOPK, LIMIT = 4096, 2048, 6, 10.0  # DeepSeek-V4-Flash: dim, moe_inter_dim, experts per token, swiglu_limit
PARTS = {"w1": (I, D), "w3": (I, D), "w2": (D, I)}  # [out, in]
EXPERT_BYTES = sum(o * i // 2 + o * i // 32 for o, i in PARTS.values())  # MXFP4 codes + E8M0 scales: 12.75 MiB


def random_experts(n_experts: int, seed: int = 0, dim: int = D, inter: int = I) -> dict[str, torch.Tensor]:
    """MXFP4 experts as the bank holds them: codes int8 [E, out, in/2], E8M0 scales uint8 [E, out, in/32].
    Random codes; scales 2^-8..2^-5, so activations stay finite through three projections."""
    g = torch.Generator().manual_seed(seed)
    parts = {}
    for name, (o, i) in {"w1": (inter, dim), "w3": (inter, dim), "w2": (dim, inter)}.items():
        parts[name] = torch.randint(-128, 128, (n_experts, o, i // 2), generator=g, dtype=torch.int8)
        parts[f"{name}_scale"] = torch.randint(119, 123, (n_experts, o, i // 32), generator=g, dtype=torch.uint8)
    return parts


def routing(
    batch: int, n_experts: int, g: torch.Generator, dim: int = D
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, D] bf16, ids [T, 6] int64 (distinct per token, uniform), weights [T, 6] fp32."""
    x = (torch.randn(batch, dim, generator=g) * 0.1).bfloat16()
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:TOPK] for _ in range(batch)])
    return x, ids, torch.rand(batch, TOPK, generator=g)


class TorchExperts:
    """The experts dequantized to bf16 once; a forward runs each touched expert on its tokens."""

    def __init__(self, parts: dict[str, torch.Tensor]):
        n = parts["w1"].shape[0]
        self.w = {
            p: [dequant_fp4(parts[p][e], parts[f"{p}_scale"][e], torch.bfloat16) for e in range(n)] for p in PARTS
        }

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            h = x[rows]
            gate = F.linear(h, self.w["w1"][e]).float().clamp(max=LIMIT)
            up = F.linear(h, self.w["w3"][e]).float().clamp(-LIMIT, LIMIT)
            act = (F.silu(gate) * up).bfloat16()
            out.index_add_(0, rows, F.linear(act, self.w["w2"][e]).float() * weights[rows, slot, None])
        return out.bfloat16()


def kt_path(parts: dict[str, torch.Tensor], threads: int):
    from dsv4serve.experts.kt_backend import KtGeometry, KtThreads
    from dsv4serve.experts.kt_experts import KtExperts

    geometry = KtGeometry(parts["w1"].shape[0], TOPK, D, I, LIMIT)
    return KtExperts({0: parts}, geometry, KtThreads((0,), (threads,)))


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def run(ns: argparse.Namespace) -> dict:
    ok, why = kt_kernel_available()
    parts = random_experts(ns.experts)
    torch_path = TorchExperts(parts)
    mem_before = measure_host_bandwidth()
    g = torch.Generator().manual_seed(1)
    samples: dict[tuple[str, int, int], list[float]] = {}
    touched: dict[int, list[int]] = {b: [] for b in ns.batch}
    check: dict[tuple[int, int], float] = {}
    for t in ns.threads:  # one kt-kernel pool at a time: its threads and torch's share the cores
        torch.set_num_threads(t)
        kt = kt_path(parts, t) if ok else None
        for _ in range(ns.repeats + 1):  # the first round warms up and is dropped
            for batch in ns.batch:
                x, ids, w = routing(batch, ns.experts, g)
                touched[batch].append(int(ids.unique().numel()))
                samples.setdefault(("torch bf16", batch, t), []).append(timed(torch_path.forward, x, ids, w))
                if kt is not None:
                    samples.setdefault(("kt-kernel", batch, t), []).append(timed(kt.forward, 0, x, ids, w))
                    ref, out = torch_path.forward(x, ids, w).float(), kt.forward(0, x, ids, w).float()
                    rel = ((out - ref).norm() / ref.norm()).item()
                    check[(batch, t)] = max(check.get((batch, t), 0.0), rel)
        del kt
    mem_after = measure_host_bandwidth()
    mem_gbps = max(mem_before[0], mem_after[0])
    rows = []
    for (path, batch, t), secs in sorted(samples.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0] != "kt-kernel")):
        s = spread(secs[1:])
        kept = touched[batch][1:]
        experts = sum(kept) / len(kept)
        gbps = experts * EXPERT_BYTES / s["median"] / 1e9
        read = gbps * (16 / 4.25 if path == "torch bf16" else 1)  # bf16: 16 bits a weight vs 4 + 8/32 packed
        row = {"path": path, "batch": batch, "threads": t, "ms": s, "experts": experts, "gbps": gbps}
        rows.append(row | {"read_gbps": read, "of_memory": gbps / mem_gbps})
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "kt_kernel": why,
            "memory_gbps": [mem_before[0], mem_after[0]],
            "load_average": os.getloadavg(),
        },
        "experts": ns.experts,
        "expert_bytes": EXPERT_BYTES,
        "kt_vs_torch_relative_error": {f"batch {b} threads {t}": v for (b, t), v in check.items()},
        "rows": rows,
    }


def report(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"{m['cpus']} CPUs; {m['kt_kernel']}; memory {m['memory_gbps'][0]:.1f} / {m['memory_gbps'][1]:.1f} GB/s "
        f"(copy, before / after); load average {m['load_average'][0]:.1f}; {result['experts']} experts of "
        f"{result['expert_bytes'] / 2**20:.2f} MiB",
    ]
    if result["kt_vs_torch_relative_error"]:
        worst = max(result["kt_vs_torch_relative_error"].values())
        lines.append(f"kt-kernel vs torch bf16: relative error at most {worst:.2e} (bf16 rounding of each step)")
    by_key = {(r["path"], r["batch"], r["threads"]): r for r in result["rows"]}
    table = []
    for r in result["rows"]:
        torch_row = by_key.get(("torch bf16", r["batch"], r["threads"]))
        ratio = torch_row["ms"]["median"] / r["ms"]["median"] if torch_row else float("nan")
        table.append(
            [
                r["path"],
                str(r["batch"]),
                str(r["threads"]),
                f"{r['experts']:.1f}",
                f"{r['ms']['median'] * 1e3:.2f} ({r['ms']['min'] * 1e3:.2f}-{r['ms']['max'] * 1e3:.2f})",
                f"{r['gbps']:.2f}",
                f"{r['read_gbps']:.2f}",
                f"{100 * r['of_memory']:.0f}%",
                f"{ratio:.2f}x",
            ]
        )
    headers = [
        "path",
        "batch",
        "threads",
        "experts",
        "ms median (min-max)",
        "MXFP4 GB/s",
        "read GB/s",
        "of memory",
        "vs torch",
    ]
    lines.append(format_table(headers, table))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--threads", type=int, nargs="+", default=list(range(1, (os.cpu_count() or 1) + 1)))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    ns = parser.parse_args()
    result = run(ns)
    print(report(result))
    if ns.json:
        ns.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
