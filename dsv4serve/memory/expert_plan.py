"""How many GPU expert slots the worker gives the routed experts when --moe-cache-size is not set:
the same whole-card memory plan `dsv4serve plan` prints (memory/plan.plan_memory), for the card
measured here, with the weights as this worker loads them. None: every expert stays resident."""

from __future__ import annotations

from dsv4serve.config import Setting, Source
from dsv4serve.ipc.messages import WorkerLaunch
from dsv4serve.memory.plan import Machine, PlanSettings, plan_memory
from dsv4serve.memory.probe import host_snapshot, take_snapshot
from dsv4serve.memory.weights import include_mtp, loaded_weight_bytes
from dsv4serve.model.args import ModelArgs
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.schema import TensorSpec


def planned_expert_slots(
    specs: list[TensorSpec], args: ModelArgs, launch: WorkerLaunch, backends: KernelBackends
) -> tuple[int | None, str]:
    """(slots, or None for all resident; the plan's reason) with the weights as `backends` load them.
    Raises ConfigError as `plan` would."""
    gpu = take_snapshot("cuda")
    machine = Machine(gpu.total_bytes, host_snapshot().total_bytes, gpu.platform)
    settings = PlanSettings(
        memory_ratio=Setting.from_wire(launch.memory_ratio),
        num_tokens=Setting.from_wire(launch.num_tokens),
        moe_cache_size=Setting(None, Source.DEFAULT),
        max_num_seqs=Setting.from_wire(launch.max_num_seqs),
        max_model_len=Setting.from_wire(launch.max_model_len),
        max_prefill_length=Setting.from_wire(launch.max_prefill_length),
        enforce_eager=Setting.from_wire(launch.enforce_eager),
        speculative_tokens=launch.speculative_tokens.value,
    )
    mtp = include_mtp(args, launch.speculative_tokens.value)
    plan = plan_memory(args, loaded_weight_bytes(specs, args, backends), machine, settings, mtp)
    note = next((d for d in plan.decisions if d.startswith("routed experts")), "")
    return (None if plan.experts_resident else plan.expert_slots), note
