"""`dsv4serve plan --gpus N`: the memory plan of each of N tensor-parallel ranks (no weights loaded).

Each rank is planned by the same whole-card plan (memory/plan.py) with that rank's weights: the checkpoint
specs at their shard shapes (parallel/partition.py), summed as the worker would load them. Experts are
expert-parallel (whole experts, so an expert-slot cache keeps its one-expert slots) when the routed experts
divide over the ranks, else split like the shared expert. What stays whole on every rank: the single K=V head,
so the KV cache and sequence states are the single-GPU ones, and the activations and decode-graph estimates
(conservative: a rank's head-split parts are smaller). Communication is not in the plan: see
dsv4serve/parallel/comm_volume.py and bench/bench_comm_volume.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4serve.config import ConfigError
from dsv4serve.memory.plan import Machine, MemoryPlan, PlanSettings, plan_memory
from dsv4serve.memory.weights import loaded_weight_bytes
from dsv4serve.model.args import ModelArgs
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.schema import TensorSpec
from dsv4serve.parallel.partition import PartitionError, make_partition, rank_specs
from dsv4serve.report import format_table
from dsv4serve.units import gib


@dataclass(frozen=True)
class RankPlans:
    gpus: int
    expert_parallel: bool
    plans: tuple[MemoryPlan, ...]  # [rank]
    read_bytes: tuple[int, ...]  # [rank] checkpoint bytes its loader reads

    def to_json(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "expert_parallel": self.expert_parallel,
            "ranks": [
                {"rank": r, "checkpoint_read_bytes": b, "memory_plan": p.to_json()}
                for r, (p, b) in enumerate(zip(self.plans, self.read_bytes))
            ],
        }


def plan_ranks(
    args: ModelArgs,
    specs: list[TensorSpec],
    machine: Machine,
    settings: PlanSettings,
    backends: KernelBackends,
    gpus: int,
    include_mtp: bool,
) -> RankPlans:
    """One memory plan per rank on `gpus` GPUs of `machine`'s size; a size the model cannot split is refused."""
    ep = args.n_routed_experts % gpus == 0
    try:
        part = make_partition(args, gpus, ep, specs)
    except PartitionError as exc:
        raise ConfigError(f"--gpus {gpus}: {exc}") from exc
    plans, read = [], []
    for rank in range(gpus):
        mine = rank_specs(specs, part, rank)
        read.append(sum(s.nbytes for s in mine))
        plans.append(plan_memory(args, loaded_weight_bytes(mine, args, backends), machine, settings, include_mtp))
    return RankPlans(gpus, ep, tuple(plans), tuple(read))


def format_rank_plans(r: RankPlans, n_experts: int) -> str:
    """A line per rank, then how the model was split."""
    rows = []
    for rank, (p, read) in enumerate(zip(r.plans, r.read_bytes)):
        experts = (
            f"all {p.n_experts:,} resident" if p.experts_resident else f"{p.expert_slots:,} of {p.n_experts:,} slots"
        )
        rows.append(
            {
                "rank": str(rank),
                "reads": gib(read),
                "non-expert": gib(p.resident_weight_bytes),
                "routed experts": f"{experts}, {gib(p.expert_slots * p.expert_slot_bytes)}",
                "KV tokens": f"{p.kv_tokens:,}",
                "chunk": f"{p.chunk.effective_tokens:,}",
                "free": gib(p.activation_free_bytes),
            }
        )
    per_rank = n_experts // r.gpus
    how = (
        f"experts expert-parallel: rank r owns experts [{per_rank}r, {per_rank}(r+1)) of every layer"
        if r.expert_parallel
        else "experts split like the shared expert (w1/w3 column, w2 row parallel)"
    )
    lines = [
        f"per-rank plans: tensor parallel over {r.gpus} GPUs of {gib(r.plans[0].machine.gpu_bytes)}",
        format_table(rows, tuple(rows[0])),
        f"- attention heads, shared expert, embed and head split; {how}",
        "- the K=V head, compressors, indexer, router and norms on every rank: the KV cache is whole per rank",
        "- communication not included: bench/bench_comm_volume.py projects it per decode step",
    ]
    return "\n".join(lines)
