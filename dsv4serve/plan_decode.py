"""The decode-speed part of `dsv4serve plan`: its flags, the projection for the planned card, and the printout.

The model and its constants are in memory/decode_speed.py; this module adds the flags' defaults with their
sources, runs the projection for each MoE backend the plan could use, and formats it term by term.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from dsv4serve.memory import decode_speed as ds
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


def bandwidths(ns: argparse.Namespace) -> tuple[ds.Bandwidths, dict[str, Any]]:
    """The bandwidths to project with, and each one's value and source (given, or the assumed default)."""
    values, sources = {}, {}
    for flag, (name, default, source, _) in FLAGS.items():
        given = getattr(ns, flag[2:].replace("-", "_"), None)
        values[name] = default if given is None else given
        sources[name] = {"value": values[name], "source": f"{flag}" if given is not None else f"assumed: {source}"}
    return ds.Bandwidths(**values), sources


def decode_plan(
    ns: argparse.Namespace, cfg: Any, memory: Any, decode_bytes: ds.DecodeBytes
) -> tuple[dict[str, Any], str]:
    """Projections for the MoE backends this plan can run: gpu when every expert is resident, else offload
    (misses over PCIe) and hybrid (misses over PCIe or on the CPU, best split); as JSON and as text."""
    bw, sources = bandwidths(ns)
    graphs = not cfg.enforce_eager.value
    backends = ("gpu",) if memory.experts_resident else ("offload", "hybrid")
    projections = {b: ds.project_decode(decode_bytes, memory.expert_slots, bw, b, graphs) for b in backends}
    today = dataclasses.replace(bw, kernel_efficiency=ds.MEASURED_KERNEL_EFFICIENCY)
    measured = {b: ds.project_decode(decode_bytes, memory.expert_slots, today, b, graphs) for b in backends}
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
            "tokens_per_second": {b: round(p.tokens_per_second, 2) for b, p in measured.items()},
        },
        "disk_expert_fraction": _host_fraction(memory, "disk_bytes", 0.0),
        "pinned_expert_fraction": _host_fraction(memory, "pin_estimate_bytes", 1.0),
    }
    return data, format_decode_plan(data, projections)


def _host_fraction(memory: Any, field: str, unknown: float) -> float:
    """A part of the expert bank (host memory plan) as a fraction of it; `unknown` without host memory."""
    host = memory.host
    part = getattr(host, field) if host is not None else None
    return unknown if part is None or not host.bank_bytes else min(1.0, part / host.bank_bytes)


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
        {"term": "step", "lane": "serial + slowest lane", "detail": ""}
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
    lines.append("- a step is the serial terms plus the slowest MoE lane (each layer waits for its router)")
    today = data["with_todays_kernels"]
    lines.append(
        "- the GPU terms above are at the bandwidth bound; with today's kernels, which reached "
        f"{today['kernel_efficiency']:g} of it ({today['source']}): "
        + ", ".join(f"{b} {tps:.1f} tokens/s" for b, tps in today["tokens_per_second"].items())
    )
    if data["pinned_expert_fraction"] < 1.0:
        lines.append(
            f"- about {100 * data['pinned_expert_fraction']:.0f}% of the bank can be pinned (host memory plan): "
            "misses beyond it copy from pageable memory, slower; give that rate as --h2d-bandwidth to price it"
        )
    if data["disk_expert_fraction"]:
        lines.append(
            f"- {100 * data['disk_expert_fraction']:.0f}% of the expert bank stays on disk (host memory plan): "
            "its misses page in from disk, which this projection does not model: it is an upper bound"
        )
    return "\n".join(lines)
