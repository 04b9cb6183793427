"""The split forward run over T local ranks next to one rank's, on a tiny model that splits: the harness of
the gloo tests (tests/unit/test_tp_forward.py) and of a multi-GPU check.

    split_tiny_args() -> ModelArgs                 dsv4-tiny's layer schedule, widened to split at T = 1, 2, 4
    SplitJob(tp_size, expert_parallel, ...)        what every rank runs: prompts, decode steps, numerics
    run_split(job, out_dir) -> [RankResult]        spawns the ranks (env:// on a free local port), one per rank

Each rank builds the same seeded random model whole (model/random_init.random_model), keeps its part
(shard_model.py), prefills the prompts as one batch and decodes greedily, every row at once, recording the
logits of every step, the tokens it chose and the collectives of its last decode step. With `served`, each
rank then serves the prompts again as the worker does (scheduler, KV pool, runner) with every decode step on the
static buffers of worker/graphs.py: CUDA graphs captured per bucket on GPUs (NCCL collectives inside them), the
same buffers run eagerly on the CPU, with padding rows in the buckets that the requests do not fill.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from dsv4serve.model.args import ModelArgs, args_from_dicts
from dsv4serve.model.backends import TORCH, KernelBackends
from dsv4serve.model.numerics import NUMERICS_ON
from dsv4serve.model.random_init import random_model
from dsv4serve.model.transformer import BatchRow, Transformer
from dsv4serve.parallel.collectives import CollectiveCall, Collectives
from dsv4serve.parallel.group import free_port, start_group, stop_group
from dsv4serve.parallel.partition import make_partition
from dsv4serve.parallel.shard_model import shard_model
from dsv4serve.tiny.spec import TINY_SPLIT_CONFIG, inference_config


def split_tiny_args(vocab_size: int = 1024) -> ModelArgs:
    """dsv4-tiny-split (tiny/spec.TINY_SPLIT_CONFIG: dsv4-tiny's layers, routing and hc 4, with the split dims on
    FP8's 128-row blocks at T = 4; 8 experts, 2 a rank with expert parallelism) with a small vocabulary (4 x 256
    rows), which no quantization block constrains."""
    config = copy.deepcopy(TINY_SPLIT_CONFIG)
    config.update(vocab_size=vocab_size)
    return args_from_dicts(config, inference_config(config))


@dataclass(frozen=True)
class SplitJob:
    tp_size: int
    expert_parallel: bool = False
    prompts: tuple[tuple[int, ...], ...] = ((5, 17, 3, 99, 250, 7, 1000), (42, 8, 8, 600, 31), (900, 2, 77))
    decode_steps: int = 4
    batch_invariant: bool = False  # the engine's CPU default (--batch-invariant off)
    seed: int = 2126
    wrong_heads_on_rank: int | None = None  # a broken split, for the test that must catch it
    backends: KernelBackends = TORCH  # Triton ones: on the CPU under TRITON_INTERPRET=1 (set before the spawn)
    device: str = "cpu"  # "cuda": rank r on cuda:r over NCCL (bench/gpu_cases/multi_gpu.py), else gloo on the CPU
    served: bool = False  # also serve the prompts through the runner's decode buckets (module doc)


@dataclass
class RankResult:
    logits: torch.Tensor  # [1 + decode_steps, rows, vocab] fp32: the prefill's last positions, then each step
    tokens: torch.Tensor  # [1 + decode_steps, rows] int64: the greedy choice of each
    decode_calls: list[CollectiveCall]  # the collectives of the last decode step
    served: list[list[int]] = dataclasses.field(default_factory=list)  # with job.served: each prompt's tokens
    buckets: list[int] = dataclasses.field(default_factory=list)  # with job.served: each decode step's bucket


def greedy(model: Transformer, job: SplitJob, tp: Collectives | None) -> RankResult:
    num = dataclasses.replace(NUMERICS_ON, batch_invariant=job.batch_invariant, backends=job.backends)
    states = [model.new_state(num) for _ in job.prompts]
    out = model([BatchRow(list(p), s) for p, s in zip(job.prompts, states)], num)
    logits = [torch.stack(out.logits)]
    for _ in range(job.decode_steps):
        last = logits[-1].argmax(-1).tolist()
        if tp is not None:
            tp.reset()
        out = model([BatchRow([t], s) for t, s in zip(last, states)], num)
        logits.append(torch.stack(out.logits))
    every = torch.stack(logits).cpu()
    return RankResult(every, every.argmax(-1), list(tp.calls) if tp is not None else [])


SERVED_MAX_LEN = 256  # the served run's max_model_len: the decode buckets' block-table width
SERVED_MAX_ROWS = 4  # its decode buckets: 1, 2, 4 (3 prompts: the 4-row bucket has a padding row)


def served(model: Transformer, job: SplitJob, device: torch.device) -> tuple[list[list[int]], list[int]]:
    """The prompts served greedily as the worker serves them (module doc): (tokens of each prompt, the bucket of
    each decode step). Every rank runs its own scheduler on the same requests, so every rank runs the same steps
    (the worker's rank 0 hands them its plan instead) and samples the same tokens from the gathered logits."""
    from dsv4serve.ipc.messages import AddRequest  # lazy: the engine's modules, for this mode alone
    from dsv4serve.ipc.sampling import SamplingParams
    from dsv4serve.model.kv_pool import KvPool
    from dsv4serve.worker.graphs import DecodeGraphs
    from dsv4serve.worker.runner import Runner
    from dsv4serve.worker.scheduler import Scheduler, SchedulerLimits

    args = model.args
    num = dataclasses.replace(NUMERICS_ON, batch_invariant=job.batch_invariant, backends=job.backends)
    page, eos = args.page_tokens, args.eos_token_id
    pages = 2 * SERVED_MAX_ROWS * (SERVED_MAX_LEN // page)
    limits = SchedulerLimits(SERVED_MAX_ROWS, SERVED_MAX_ROWS, pages * page, page, SERVED_MAX_LEN, eos)
    pool = KvPool(args, num.compute_dtype, num_pages=pages + 1, num_slots=limits.num_slots + 1, device=device)
    pad = (pool.num_slots - 1, pool.num_pages - 1)  # the pool's last slot and page: the padding rows' own
    graphs = DecodeGraphs(model, pool, num, SERVED_MAX_ROWS, SERVED_MAX_LEN, *pad, capture=device.type == "cuda")
    runner = Runner(model, pool, num, eos, device, graphs=graphs)
    scheduler = Scheduler(limits)
    greedy_params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=job.decode_steps + 1)
    for i, prompt in enumerate(job.prompts):
        scheduler.add(AddRequest(f"r{i}", list(prompt), greedy_params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(job.prompts))}
    buckets = []
    while scheduler.has_work:
        plan = scheduler.schedule(4096)
        if plan.rows and all(len(r.token_ids) == 1 for r in plan.rows):
            buckets.append(graphs.bucket_for(len(plan.rows)) or 0)
        for msg in scheduler.complete(plan, runner.execute(plan)):
            tokens[msg.request_id].extend(t.token_id for t in msg.tokens)
    return [tokens[f"r{i}"] for i in range(len(job.prompts))], buckets


def _rank_main(rank: int, job: SplitJob, port: int, out_dir: str) -> None:
    """One rank (torch.multiprocessing.spawn's target): start the group, build, cut, run, save."""
    torch.set_num_threads(1)  # the ranks share the host's cores; one thread each, as the one-rank reference
    device = torch.device("cpu") if job.device == "cpu" else torch.device(job.device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = start_group(rank, job.tp_size, port, device)
    try:
        args = split_tiny_args()
        model = random_model(args, device, job.seed, include_mtp=False)
        tp = None
        if job.tp_size > 1:
            whole_wq_b = [layer.attn.wq_b.weight.detach().clone() for layer in model.layers]
            tp = Collectives(group)
            shard_model(model, make_partition(args, job.tp_size, job.expert_parallel), tp)
            if job.wrong_heads_on_rank == rank:  # this rank computes rank 0's heads instead of its own
                for layer, whole in zip(model.layers, whole_wq_b):
                    rows = layer.attn.wq_b.weight.shape[0]
                    layer.attn.wq_b.weight = torch.nn.Parameter(whole[:rows].clone(), requires_grad=False)
        model.use_kernels(job.backends)  # after the cut: the packed copies are made of this rank's part
        result = greedy(model, job, tp)
        if job.served:
            result.served, result.buckets = served(model, job, device)
        torch.save(dataclasses.asdict(result), Path(out_dir) / f"rank{rank}.pt")
    finally:
        stop_group(group)


def run_split(job: SplitJob, out_dir: Path) -> list[RankResult]:
    """Spawn `job.tp_size` rank processes (one for T = 1 too: the same thread count and start) and collect
    each rank's result."""
    import torch.multiprocessing as mp  # lazy, as torch.distributed: only a split run spawns ranks

    out_dir.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank_main, args=(job, free_port(), str(out_dir)), nprocs=job.tp_size, join=True)
    results = []
    for rank in range(job.tp_size):
        saved = torch.load(out_dir / f"rank{rank}.pt", weights_only=False)
        calls = [CollectiveCall(**c) for c in saved.pop("decode_calls")]
        results.append(RankResult(**saved, decode_calls=calls))
    return results
