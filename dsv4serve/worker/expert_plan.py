"""How many GPU expert slots the worker gives the routed experts when --moe-cache-size is not set:
the same whole-card memory plan `dsv4serve plan` prints (memory_plan.plan_memory), for the card
measured here, with the weights as this worker loads them. None: every expert stays resident."""

from __future__ import annotations

from dsv4serve.config import Setting, Source
from dsv4serve.ipc.messages import WorkerLaunch
from dsv4serve.memory_plan import Machine, PlanSettings, plan_memory
from dsv4serve.model.args import ModelArgs
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.packed_load import loaded_weight_bytes
from dsv4serve.model.schema import TensorSpec
from dsv4serve.worker.memory_probe import host_snapshot, take_snapshot


def _setting(value, explicit: bool) -> Setting:
    return Setting(value, Source.CLI if explicit else Source.DEFAULT)


def planned_expert_slots(
    specs: list[TensorSpec], args: ModelArgs, launch: WorkerLaunch, backends: KernelBackends
) -> tuple[int | None, str]:
    """(slots, or None for all resident; the plan's reason) with the weights as `backends` load them.
    Raises ConfigError as `plan` would."""
    gpu = take_snapshot("cuda")
    machine = Machine(gpu.total_bytes, host_snapshot().total_bytes, gpu.platform)
    settings = PlanSettings(
        memory_ratio=_setting(launch.memory_ratio, False),
        num_tokens=_setting(launch.num_tokens, launch.num_tokens is not None),
        moe_cache_size=_setting(None, False),
        max_num_seqs=_setting(launch.max_num_seqs, False),
        max_model_len=Setting(launch.max_model_len, Source.CLI if launch.max_model_len_explicit else Source.MODEL_RULE),
        max_prefill_length=Setting(launch.max_prefill_length, Source(launch.max_prefill_length_source)),
    )
    plan = plan_memory(args, loaded_weight_bytes(specs, args, backends), machine, settings)
    note = next((d for d in plan.decisions if d.startswith("routed experts")), "")
    return (None if plan.experts_resident else plan.expert_slots), note
