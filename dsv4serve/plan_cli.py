"""`dsv4serve plan`: what the server would do with a model, from its config alone (no weights loaded).

The plan is for a GPU of --gpu-memory when given; otherwise for the device `serve` would use here: GPU 0
as measured (dsv4serve/memory/probe.py), or, with no GPU, the CPU and its measured RAM. The output says
which, and always holds the prefill chunk with the limit that binds it; for a GPU also the projected batch-1
decode speed, term by term (plan_decode.py)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from dsv4serve.config import ConfigError
from dsv4serve.env import Environment
from dsv4serve.memory.capacity import CPU_KV_CAPACITY_TOKENS
from dsv4serve.memory.host_plan import plans_cpu_experts
from dsv4serve.memory.plan import Machine
from dsv4serve.model.args import ModelArgs
from dsv4serve.model.schema import TensorSpec, checkpoint_schema
from dsv4serve.plan_decode import add_decode_options, decode_plan, kt_layers_for
from dsv4serve.plan_ranks import format_rank_plans, plan_ranks
from dsv4serve.report import format_table, settings_json, settings_rows
from dsv4serve.resolve_cli import resolve_from_cli
from dsv4serve.units import gib, parse_bytes


def add_plan_options(parser: argparse.ArgumentParser) -> None:
    size = _size_type()
    parser.add_argument("--gpu-memory", type=size, metavar="SIZE", help="plan for a GPU of this size (e.g. 32GiB)")
    parser.add_argument("--host-memory", type=size, metavar="SIZE", help="plan for this much host RAM (e.g. 128GiB)")
    parser.add_argument(
        "--platform",
        choices=("native", "wsl2"),
        default="native",
        help="wsl2 keeps a larger memory margin and a lower pinned-memory budget",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--gpus",
        type=_positive_int,
        default=None,
        metavar="N",
        help="plan each of N tensor-parallel ranks (GPUs of --gpu-memory each) [--tensor-parallel-size]",
    )
    add_decode_options(parser)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return int(text)


def _size_type():
    def convert(text: str) -> int:
        try:
            return parse_bytes(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    convert.__name__ = "size"
    return convert


def weight_bytes_by_group(args: ModelArgs, specs: list[TensorSpec]) -> dict[str, int]:
    """Checkpoint bytes by kind of weight; everything of the MTP block is counted as 'mtp'."""
    out: dict[str, int] = defaultdict(int)
    for spec in specs:
        group = "mtp" if spec.layer is not None and spec.layer >= args.n_layers else spec.group
        out[group] += spec.nbytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


@dataclass(frozen=True)
class PlanTarget:
    """The machine a plan is for, and how it was found."""

    machine: Machine
    device: str  # cuda | cpu: which kernels' weight formats the plan counts
    description: str


def plan_target(ns: argparse.Namespace) -> PlanTarget:
    """--gpu-memory as given; else GPU 0 as measured; else the CPU with its measured RAM."""
    from dsv4serve.memory.probe import detect_platform, host_snapshot, take_snapshot

    if ns.gpu_memory is not None:
        machine = Machine(ns.gpu_memory, ns.host_memory, ns.platform)
        return PlanTarget(machine, "cuda", f"a GPU of {gib(ns.gpu_memory)} (--gpu-memory, {ns.platform})")
    host = host_snapshot()
    host_bytes = ns.host_memory or host.total_bytes
    import torch

    if torch.cuda.is_available():
        gpu = take_snapshot("cuda:0")
        name = torch.cuda.get_device_name(0)
        machine = Machine(gpu.total_bytes, host_bytes, gpu.platform)
        text = f"GPU 0 as measured: {name}, {gib(gpu.total_bytes)} ({gib(gpu.free_bytes)} free)"
        return PlanTarget(machine, "cuda", f"{text}, host RAM {gib(host_bytes)}")
    text = (
        f"the CPU: no GPU here; host RAM as measured {gib(host.total_bytes)} ({gib(host.free_bytes)} available) "
        "holds the weights, the KV cache and the activations"
    )
    return PlanTarget(Machine(host.total_bytes, None, detect_platform()), "cpu", text)


def build_plan(ns: argparse.Namespace, env: Environment) -> dict[str, Any]:
    target = plan_target(ns)
    # a plan for a GPU is made as if that GPU were present
    cfg, location, args = resolve_from_cli(ns, env, config_only=True, simulate_gpu=target.device == "cuda")
    specs = checkpoint_schema(args)  # 69K entries for the real model: built once per plan
    weights = weight_bytes_by_group(args, specs)
    chunk = cfg.max_prefill_length
    prefill = {"requested": chunk.value, "source": chunk.source.value, "note": chunk.note}
    backends, ranks = None, None
    gpus = getattr(ns, "gpus", None) or cfg.tensor_parallel_size.value
    if gpus > 1 and target.device != "cuda":
        raise ConfigError(f"--gpus {gpus} plans GPUs: give --gpu-memory (the size of each), or run it on a GPU host")
    try:
        memory, backends, ranks = _memory_plan(target, cfg, args, specs, gpus)
    except ConfigError as exc:
        if ns.gpu_memory is not None:  # the machine the user named cannot hold it: an error, as before
            raise
        memory, prefill["effective"], prefill["binding"] = None, None, "none"
        prefill["reason"] = f"no memory plan: this machine cannot serve the model ({exc})"
    else:
        if gpus == 1 and target.device == "cuda" and plans_cpu_experts(cfg.moe_backend.value):  # hybrid's RAM split
            memory = _with_kt_layers(ns, cfg, args, specs, target, memory, backends)
        c = memory.chunk
        prefill.update(effective=c.effective_tokens, binding=c.binding, reason=c.reason, warning=c.warning)
    if gpus > 1:  # a rank's reads and the collectives between ranks are not in the projection yet
        decode, decode_text = None, f"projected decode speed: none for --gpus {gpus} (bench/bench_comm_volume.py)"
    else:
        decode, decode_text = _decode_speed(ns, cfg, args, specs, target, memory, backends)
    return {
        "model": {
            "name": location.name,
            "path": str(location.path),
            "layers": args.n_layers,
            "mtp_layers": args.n_mtp_layers,
            "layer_kinds": list(args.layer_kinds),
        },
        "machine": {
            "plan_for": target.description,
            "device": target.device,
            "gpu_memory_bytes": target.machine.gpu_bytes,
            "host_memory_bytes": target.machine.host_bytes,
            "platform": target.machine.platform,
        },
        "weights": {"total_bytes": sum(weights.values()), "by_kind_bytes": weights},
        "prefill_chunk": prefill,
        "memory_plan": memory.to_json() if memory is not None else None,
        "memory_plan_text": format_memory_plan(memory, target.device) if memory is not None else None,
        "decode_speed": decode,
        "decode_speed_text": decode_text,
        "parallel": ranks.to_json() if ranks is not None else None,
        "parallel_text": format_rank_plans(ranks, args.n_routed_experts) if ranks is not None else None,
        "settings": settings_json(cfg),
        "settings_rows": settings_rows(cfg),
    }


def run_plan(ns: argparse.Namespace, env: Environment) -> int:
    plan = build_plan(ns, env)
    if ns.json:
        plan.pop("settings_rows")
        plan.pop("memory_plan_text")
        plan.pop("decode_speed_text")
        plan.pop("parallel_text")
        json.dump(plan, sys.stdout, indent=2)
        print()
        return 0
    w = plan["weights"]
    rows = [{"kind": k, "bytes": f"{v:,}", "size": gib(v)} for k, v in w["by_kind_bytes"].items()]
    rows.append({"kind": "total", "bytes": f"{w['total_bytes']:,}", "size": gib(w["total_bytes"])})
    print(f"model {plan['model']['name']}: {plan['model']['layers']} layers + {plan['model']['mtp_layers']} MTP")
    print("\nweights\n" + format_table(rows, ("kind", "bytes", "size")))
    print("\neffective settings\n" + format_table(plan["settings_rows"], ("flag", "value", "source", "note")))
    print(f"\nplan for {plan['machine']['plan_for']}")
    if plan["memory_plan_text"]:
        print("\n" + plan["memory_plan_text"])
    else:
        c = plan["prefill_chunk"]
        print(f"\nprefill chunk: requested {c['requested'] or 'auto'} ({c['source']}), bound by none: {c['reason']}")
    if plan["parallel_text"]:
        print("\n" + plan["parallel_text"])
    print("\n" + plan["decode_speed_text"])
    if plan["machine"]["device"] == "cpu" and plan["settings"]["num_tokens"]["value"] is None:
        print(f"(the CPU worker keeps at most {CPU_KV_CAPACITY_TOKENS:,} KV tokens unless --num-tokens asks for more)")
    return 0


def _memory_plan(target: PlanTarget, cfg: Any, args: ModelArgs, specs: list[TensorSpec], gpus: int = 1):
    from dsv4serve.memory.plan import PlanSettings, plan_memory
    from dsv4serve.memory.weights import include_mtp, loaded_weight_bytes
    from dsv4serve.model.backends import default_backends, resolve_backends

    # resident weights as the worker on that device loads them with --kernels, not as the checkpoint stores them
    backends = resolve_backends(cfg.kernels.value, default_backends(target.device))
    settings = PlanSettings.from_config(cfg)
    weights = loaded_weight_bytes(specs, args, backends)
    mtp = include_mtp(args, cfg.speculative_tokens.value)
    if gpus > 1:  # rank 0's plan stands for the card in the rest of the output
        ranks = plan_ranks(args, specs, target.machine, settings, backends, gpus, mtp)
        return ranks.plans[0], backends, ranks
    return plan_memory(args, weights, target.machine, settings, mtp), backends, None


def _with_kt_layers(ns, cfg, args, specs, target: PlanTarget, memory, backends):
    """The memory plan again with kt-kernel holding the layers the decode projection prefers (plan_decode.kt_layers_for:
    its copy and the bank share host RAM); the GPU side does not change."""
    import dataclasses

    from dsv4serve.memory.decode_speed import decode_bytes
    from dsv4serve.memory.plan import PlanSettings, plan_memory
    from dsv4serve.memory.weights import include_mtp, loaded_weight_bytes

    k = kt_layers_for(ns, cfg, memory, decode_bytes(specs, args, backends))
    if k is None:
        return memory
    settings = dataclasses.replace(PlanSettings.from_config(cfg), kt_layers=k)
    mtp = include_mtp(args, cfg.speculative_tokens.value)
    return plan_memory(args, loaded_weight_bytes(specs, args, backends), target.machine, settings, mtp)


def _decode_speed(ns, cfg, args, specs, target: PlanTarget, memory, backends) -> tuple[dict[str, Any] | None, str]:
    """The projected batch-1 decode speed of a GPU plan (plan_decode.py); none for the CPU worker or no plan."""
    if memory is None:
        return None, "projected decode speed: none (no memory plan)"
    if target.device != "cuda":
        return None, "projected decode speed: none for the CPU worker (the projection models a GPU with its host)"
    from dsv4serve.memory.decode_speed import decode_bytes

    return decode_plan(ns, cfg, memory, decode_bytes(specs, args, backends), args.n_activated_experts)


def format_memory_plan(p, device: str = "cuda") -> str:
    """The plan as a person reads it: what stays on the GPU (or in RAM), slots, KV, and the chunk with its
    binding."""
    where = "ram" if device == "cpu" else "gpu"
    e = p.expert_slots * p.expert_slot_bytes
    rows = [
        ("non-expert weights", p.resident_weight_bytes),
        ("routed experts (all)" if p.experts_resident else f"expert slots ({p.expert_slots})", e),
        *((("prefill expert stream", p.stream_area_bytes),) if p.stream_area_bytes else ()),
        (f"KV cache ({p.kv_tokens:,} tokens)", p.kv_cache_bytes),
        (f"sequence states ({p.max_running})", p.seq_state_bytes),
        ("decode CUDA graphs", p.decode_graph_bytes),
        ("free for prefill activations", p.activation_free_bytes),
    ]
    table = format_table(
        [{where: n, "size": gib(b)} for n, b in rows]
        + [
            {
                where: f"budget ({p.machine.platform} margin {gib(p.margin_bytes)} inside free)",
                "size": gib(p.budget_bytes),
            }
        ],
        (where, "size"),
    )
    c, g = p.chunk, p.geometry
    memory = "host RAM, CPU" if device == "cpu" else "GPU"
    lines = [f"memory plan ({gib(p.machine.gpu_bytes)} {memory}, {p.machine.platform})", table, ""]
    lines += [f"- {d}" for d in p.decisions]
    lines += [
        "",
        f"max running requests {p.max_running}, max_model_len {p.max_model_len:,}",
        f"prefill chunk: requested {c.requested if c.requested is not None else 'auto'}, effective "
        f"{c.effective_tokens:,} tokens, bound by {c.binding}: {c.reason}",
        f"  activations: {g.activation_bytes_per_token:,} B/token estimated (peak layer), "
        f"{c.activation_bytes_per_token:,} B/token planned, {gib(g.fixed_bytes)} fixed, "
        f"aligned to {c.alignment_tokens} tokens; memory bound {c.safe_tokens:,} tokens",
    ]
    h = p.host
    if h is not None and h.ram_bytes is not None:
        lines.append(
            f"host memory: expert bank {gib(h.bank_bytes)} (host RAM {gib(p.machine.host_bytes)}, margin "
            f"{gib(h.margin_bytes)}): {gib(h.ram_bytes)} in RAM, {gib(h.disk_bytes)} on disk (mmap); "
            f"about {gib(h.pin_estimate_bytes)} of it pinned (the pin budget is measured at startup)"
        )
    elif h is not None:
        lines.append(f"host memory: expert bank {gib(h.bank_bytes)} (host RAM unknown: give --host-memory)")
    lines += [f"WARNING: {w}" for w in p.warnings]
    return "\n".join(lines)
