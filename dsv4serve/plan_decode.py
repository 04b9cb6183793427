"""The decode-speed part of `dsv4serve plan`: its flags, the projection for the planned card, and the printout.

The model and its constants are in memory/decode_speed.py; this module adds the flags' defaults with their
sources, runs the projection for each MoE backend the plan could use, and formats it term by term.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from dsv4serve.memory import decode_speed as ds
from dsv4serve.memory.decode_choice import best_kt_layers, eager_reason, faster_backend, project_backends
from dsv4serve.memory.decode_lanes import BankTiers
from dsv4serve.memory.prefill_speed import prefill_lines, project_prefill
from dsv4serve.report import format_table

# flag -> (Bandwidths field, default, where the default comes from, what it is); every default is an assumption
FLAGS = {
    "--gpu-bandwidth": (
        "gpu_gbps",
        ds.DEFAULT_GPU_GBPS,
        "RTX 5090 spec sheet (GDDR7, 1792 GB/s)",
        "GPU memory GB/s (the card's spec)",
    ),
    "--h2d-bandwidth": (
        "h2d_gbps",
        ds.DEFAULT_H2D_GBPS,
        "PCIe 5.0 x16 pinned copies, about 50 GB/s achieved",
        "host-to-device copy GB/s; `doctor` measures it, pinned and pageable",
    ),
    "--host-bandwidth": (
        "host_gbps",
        ds.DEFAULT_HOST_GBPS,
        "DDR5 dual channel, about 80 GB/s sustained",
        "host memory GB/s; `doctor` measures it",
    ),
    "--disk-bandwidth": (
        "disk_gbps",
        ds.DEFAULT_DISK_GBPS,
        "NVMe SSD read through page faults on the mapped shards, about 3 GB/s",
        "GB/s of page-ins of the experts host RAM cannot hold (the bank's disk tier); `doctor` measures it",
    ),
    "--cpu-efficiency": (
        "cpu_efficiency",
        ds.DEFAULT_CPU_EFFICIENCY,
        "kt-kernel's expert GB/s over host GB/s: 0.24 measured on a compute-bound 2-core VM, more on a desktop",
        "the share of host memory bandwidth CPU experts stream at, at most 1; bench/bench_cpu_experts.py measures it",
    ),
}


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"not a positive number: {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _positive(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"not a fraction in (0, 1]: {text!r}")
    return value


def add_decode_options(parser: argparse.ArgumentParser) -> None:
    for flag, (_, default, source, what) in FLAGS.items():
        fraction = flag == "--cpu-efficiency"
        parser.add_argument(
            flag,
            type=_fraction if fraction else _positive,
            default=None,
            metavar="FRACTION" if fraction else "GB/s",
            help=f"projected decode speed: {what} [default {default:g}, assumed: {source}]",
        )
    parser.add_argument(
        "--expert-hit-rate",
        type=_fraction,
        default=None,
        metavar="FRACTION",
        help="projected decode speed: the share of routed-expert uses found in a GPU slot, in place of uniform "
        "routing's slots / experts (a running server's /metrics: expert_cache_hits_total / "
        "expert_cache_queries_total)",
    )


def bandwidths(ns: argparse.Namespace) -> tuple[ds.Bandwidths, dict[str, Any]]:
    """The bandwidths to project with, and each one's value and source (given, or the assumed default)."""
    values, sources = {}, {}
    for flag, (name, default, source, _) in FLAGS.items():
        given = getattr(ns, flag[2:].replace("-", "_"), None)
        values[name] = default if given is None else given
        sources[name] = {"value": values[name], "source": f"{flag}" if given is not None else f"assumed: {source}"}
    return ds.Bandwidths(**values), sources


def kt_layers_for(ns: argparse.Namespace, cfg: Any, memory: Any, decode_bytes: ds.DecodeBytes) -> int | None:
    """The MoE layers kt-kernel should hold on this plan's host (memory/decode_choice.best_kt_layers), with the
    bandwidths, graphs and hit rate `decode_plan` projects with; None without host memory or an offloaded bank."""
    if memory.experts_resident or memory.host is None:
        return None
    bw, _ = bandwidths(ns)
    graphs = eager_reason(cfg.enforce_eager.value, "hybrid", cfg.speculative_tokens.value > 0) is None
    hits = getattr(ns, "expert_hit_rate", None)
    return best_kt_layers(decode_bytes, memory.expert_slots, memory.host.bank_bytes, memory.machine, bw, graphs, hits)


def decode_plan(
    ns: argparse.Namespace, cfg: Any, memory: Any, decode_bytes: ds.DecodeBytes, topk: int
) -> tuple[dict[str, Any], str]:
    """Projections for the MoE backends this plan can run: gpu when every expert is resident, else offload
    (misses over PCIe) and hybrid (misses over PCIe or on the CPU, best split); as JSON and as text. With the
    experts offloaded, also a cold prefill chunk's expert transfers (memory/prefill_speed.py; `topk`: experts a
    token routes to in a layer)."""
    bw, sources = bandwidths(ns)
    backends = ("gpu",) if memory.experts_resident else ("offload", "hybrid")
    bank = memory.host.bank_bytes if memory.host is not None else 0
    eager, spec = cfg.enforce_eager.value, cfg.speculative_tokens.value > 0
    hits = getattr(ns, "expert_hit_rate", None) if not memory.experts_resident else None

    def project(rates: ds.Bandwidths) -> dict[str, tuple[ds.DecodeProjection, BankTiers, str | None]]:
        slots = memory.expert_slots
        return project_backends(decode_bytes, slots, bank, memory.machine, rates, eager, backends, spec, hits)

    full = project(bw)
    projections = {k: v[0] for k, v in full.items()}
    today = dataclasses.replace(bw, kernel_efficiency=ds.MEASURED_KERNEL_EFFICIENCY)
    measured = {k: v[0] for k, v in project(today).items()}
    prefill = None
    if not memory.experts_resident:
        tiers = full["offload"][1]
        prefill = project_prefill(decode_bytes, memory.expert_slots, memory.chunk.effective_tokens, topk, tiers, bw)
    data = {
        "bandwidths": sources,
        "device_read_efficiency": ds.DEVICE_READ_EFFICIENCY,
        "moe_backend": {"value": cfg.moe_backend.value, "source": cfg.moe_backend.source.value},
        "expert_slots": memory.expert_slots,
        "context_tokens": decode_bytes.context_tokens,
        "projections": {b: p.to_json() for b, p in projections.items()},
        "with_todays_kernels": {
            "kernel_efficiency": ds.MEASURED_KERNEL_EFFICIENCY,
            "source": ds.MEASURED_KERNEL_EFFICIENCY_SOURCE,
            "tokens_per_second": {k: round(p.tokens_per_second, 2) for k, p in measured.items()},
        },
        "bank_tiers": {k: dataclasses.asdict(v[1]) | {"disk": v[1].disk} for k, v in full.items()},
        "eager": {k: v[2] for k, v in full.items() if v[2] is not None},
        "faster": faster_backend(full) if len(full) > 1 else backends[0],
        "expert_hit_rate": {"value": hits, "source": "--expert-hit-rate"} if hits is not None else None,
        "host_memory_given": memory.host is None or memory.host.ram_bytes is not None,
        "cold_prefill": prefill.to_json() if prefill is not None else None,
    }
    text = format_decode_plan(data, projections)
    if prefill is not None:
        text += "\n\n" + "\n".join(prefill_lines(prefill, sources["h2d_gbps"]["source"]))
    return data, text


def format_decode_plan(data: dict[str, Any], projections: dict[str, ds.DecodeProjection]) -> str:
    """One row per term, one column per backend; then the step, tokens/s, and how the split was chosen."""
    names = list(projections)
    last = projections[names[-1]]
    rows = []
    for i, term in enumerate(last.serial + last.parallel):
        row = {"term": term.name, "lane": "serial" if i < len(last.serial) else "MoE lane", "detail": term.detail}
        row |= {f"{n} ms": f"{(p.serial + p.parallel)[i].seconds * 1e3:.3f}" for n, p in projections.items()}
        rows.append(row)
    rows.append(
        {"term": "step", "lane": "serial + MoE phase", "detail": ""}
        | {f"{n} ms": f"{p.step_seconds * 1e3:.2f}" for n, p in projections.items()}
    )
    rows.append(
        {"term": "tokens/s", "lane": "", "detail": ""}
        | {f"{n} ms": f"{p.tokens_per_second:.1f}" for n, p in projections.items()}
    )
    bw = data["bandwidths"]
    lines = [
        f"projected batch-1 decode (memory/decode_speed.py; --moe-backend {data['moe_backend']['value']}), with:",
        f"  GPU memory {bw['gpu_gbps']['value']:g} GB/s x {data['device_read_efficiency']} achieved "
        f"({bw['gpu_gbps']['source']})",
        f"  host-to-device {bw['h2d_gbps']['value']:g} GB/s ({bw['h2d_gbps']['source']})",
        f"  host memory {bw['host_gbps']['value']:g} GB/s ({bw['host_gbps']['source']})",
        f"  CPU experts at {bw['cpu_efficiency']['value']:g} of host memory bandwidth "
        f"({bw['cpu_efficiency']['source']})",
        f"  disk {bw['disk_gbps']['value']:g} GB/s ({bw['disk_gbps']['source']})",
        format_table(rows, ("term", "lane", *(f"{n} ms" for n in names), "detail")).replace(
            "detail", f"detail ({names[-1]})", 1
        ),
    ]
    lines += [f"- {note}" for note in last.notes]
    if "hybrid" in projections:
        h = projections["hybrid"]
        lines.append(
            f"- hybrid: {100 * h.cpu_fraction:.0f}% of the misses on the CPU (the split that balances its lanes); "
            f"its MoE phase is bound by {h.bound_by}"
        )
    lines.append(
        "- a step is the serial terms plus the MoE phase: each layer waits for its router, then for its slowest lane "
        "(layers whose experts live alike form a class; each lane above is summed over the classes)"
    )
    today = data["with_todays_kernels"]
    lines.append(
        "- the GPU terms above are at the bandwidth bound; with today's kernels, which reached "
        f"{today['kernel_efficiency']:g} of it ({today['source']}): "
        + ", ".join(f"{b} {tps:.1f} tokens/s" for b, tps in today["tokens_per_second"].items())
    )
    for b, why in data["eager"].items():
        lines.append(f"- {b}: decode steps run eager ({why}): {ds.CENSUS_LAUNCHES_PER_STEP:,} launches priced eager")
    for b, t in data["bank_tiers"].items():
        if t["pinned"] < 1.0 or t["cpu_layers"] < 1.0:
            kt = f", kt-kernel holds {100 * t['cpu_layers']:.0f}% of the layers" if b == "hybrid" else ""
            lines.append(
                f"- {b}: the bank (host memory plan) is {100 * t['pinned']:.0f}% pinned, {100 * t['pageable']:.0f}% "
                f"pageable, {100 * t['disk']:.0f}% on disk{kt}"
            )
    if not data["host_memory_given"]:
        lines.append("- host memory not given (--host-memory): the bank is assumed all pinned")
    if len(projections) > 1:
        lines.append(
            f"- --moe-backend auto with kt-kernel installed runs {data['faster']} on a CUDA worker (the faster "
            "projection)"
        )
    return "\n".join(lines)
