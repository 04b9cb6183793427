"""Census of one whole speculative step through the runner (issue 19 item 5): before, the verify forward eager
and the MTP draft chain reading each draft back to the host; after, the verify forward on a (bucket, n) bucket's
static buffers and the chain fed on the device (worker/spec_graphs.py), one read of the drafts at its end.

A step here is `Runner.execute` of a plan whose rows all carry N drafts (rows [last token, d_1 .. d_N]): the
rollback save, the verify forward, the sampler and its read, the rollback restore, the MTP catch-up over the kept
positions, the chain of N - 1 single-token MTP applications and the drafts' read. B requests of a random prompt
are prefilled on a dense twin (the torch path, the MTP block included), one steady step settles the real path,
and the next steady step is counted on the CUDA worker's code path (every kernel on Triton, interpreted;
bench/census/counter.py says what a launch and a sync are). The chain's syncs are counted apart.

    python bench/bench_spec_step.py [--batch 1 8] [--drafts 1 3] [--prompt-tokens 40] [--json PATH]
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any dsv4_kernels import

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench.*`
from bench.census.attribution import Attributor
from bench.census.counter import Seen, StepCounter
from bench.census.engine import cuda_worker_numerics, random_prompts
from bench.census.stand_ins import stand_ins
from bench.report import format_table
from dsv4serve.checkpoint.loader import iter_dense, open_checkpoint
from dsv4serve.env import read_environment
from dsv4serve.ipc.messages import AddRequest
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.memory.weights import model_specs
from dsv4serve.model import rollback
from dsv4serve.model.backends import TORCH
from dsv4serve.model.kv_pool import KvPool
from dsv4serve.model.packed_load import load_packed
from dsv4serve.model.transformer import Transformer
from dsv4serve.tiny.builder import ensure_tiny
from dsv4serve.worker.graphs import DecodeGraphs
from dsv4serve.worker.runner import Runner
from dsv4serve.worker.scheduler import Scheduler, SchedulerLimits
from dsv4serve.worker.spec_graphs import ChainRun, SpecGraphs
from dsv4serve.worker.spec_sampling import draft_tokens
from dsv4serve.worker.speculative import Drafter
from dsv4serve.worker.step import StepPlan

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


class HostChainDrafter(Drafter):
    """The chain as it was before item 5: every draft read back to the host before the next application."""

    def _chain(self, states, sampling, logits, streams, device):
        return self._host_chain(states, sampling, draft_tokens(logits, sampling), streams, device)


@dataclass
class SpecEngine:
    model: Transformer
    twin: Transformer  # dense, torch path, MTP included: the prefill steps
    scheduler: Scheduler
    runner: Runner
    spec_graphs: SpecGraphs | None
    pieces: dict[str, list[Seen]] = field(default_factory=dict)  # name -> the census of each call (`watch`)


def load_models(tiny_dir: Path) -> tuple[Transformer, Transformer]:
    """(the packed model on the CUDA worker's Triton path, its dense twin on the torch path), both with MTP."""
    ckpt = open_checkpoint(tiny_dir)
    args = ckpt.args
    model, _ = load_packed(ckpt, cuda_worker_numerics(args).backends, CPU, True, progress=False)
    model.use_kernels(cuda_worker_numerics(args).backends)
    twin = Transformer(args, include_mtp=True)
    specs = tuple(model_specs(ckpt.specs, args, True))
    twin.load_state_dict(dict(iter_dense(dataclasses.replace(ckpt, specs=specs), progress=False)), strict=True)
    return model, twin.eval()


def build(models: tuple[Transformer, Transformer], batch: int, n_spec: int, static: bool, max_len: int) -> SpecEngine:
    """B rows' engine: static (verify buckets, device-fed chain) or before (eager verify, host chain)."""
    model, twin = models
    args, num = model.args, cuda_worker_numerics(model.args)
    page = args.page_tokens
    pages = batch * -(-max_len // page)
    limits = SchedulerLimits(batch, batch, pages * page, page, max_len, args.eos_token_id, 0, n_spec)
    pool = KvPool(args, num.compute_dtype, pages + 1, limits.num_slots + 1, include_mtp=True, device=CPU)
    pad = (pool.num_slots - 1, pool.num_pages - 1)
    decode = DecodeGraphs(model, pool, num, batch, max_len, *pad, capture=False)
    spec = SpecGraphs(model, pool, num, batch, max_len, n_spec, *pad, capture=False) if static else None
    drafter = (Drafter if static else HostChainDrafter)(model, pool, num, n_spec, graphs=spec)
    runner = Runner(model, pool, num, args.eos_token_id, CPU, graphs=decode, drafter=drafter)
    return SpecEngine(model, twin, Scheduler(limits), runner, spec)


@contextmanager
def warm_path(e: SpecEngine) -> Iterator[None]:
    """Steps inside run the dense twin on the torch path, drafter included (prefill: not what is counted)."""
    r, d = e.runner, e.runner.drafter
    assert d is not None
    saved = (r.model, r.numerics, r.graphs, r.spec_graphs, d.model, d.numerics, d.graphs)
    torch_num = dataclasses.replace(r.numerics, backends=TORCH)
    r.model, r.numerics, r.graphs, r.spec_graphs = e.twin, torch_num, None, None
    d.model, d.numerics, d.graphs = e.twin, torch_num, None
    try:
        yield
    finally:
        r.model, r.numerics, r.graphs, r.spec_graphs, d.model, d.numerics, d.graphs = saved


def steady(plan: StepPlan, n_spec: int, batch: int) -> bool:
    """Every row a verify row of n_spec drafts."""
    return len(plan.rows) == batch and all(
        r.num_draft_tokens == n_spec and len(r.token_ids) == n_spec + 1 for r in plan.rows
    )


def run(e: SpecEngine, plan: StepPlan, counter: StepCounter | None = None) -> None:
    """The runner executes the plan (counted when a counter is given: the scheduler is tensor-free)."""
    if counter is None:
        out = e.runner.execute(plan)
    else:
        with counter:
            out = e.runner.execute(plan)
    e.scheduler.complete(plan, out)


def start(e: SpecEngine, batch: int, prompt_tokens: int, max_tokens: int, seed: int = 0) -> None:
    """B prompts prefilled (and their first drafts made) on the warm path."""
    for i, prompt in enumerate(random_prompts(batch, prompt_tokens, seed)):
        e.scheduler.add(AddRequest(f"spec-{i}", prompt, dataclasses.replace(GREEDY, max_tokens=max_tokens)))
    with warm_path(e):
        while not e.scheduler.running or any(r.num_computed_tokens < prompt_tokens for r in e.scheduler.running):
            run(e, e.scheduler.schedule(4096))


def watch(e: SpecEngine) -> None:
    """Count every verify forward and chain application on the static buffers, and every chain, apart."""
    assert e.spec_graphs is not None and e.runner.drafter is not None
    graphs, drafter = e.spec_graphs, e.runner.drafter

    def counted(name: str, fn):
        def run(*args, **kwargs):
            counter = StepCounter(Attributor(e.model))
            with counter:
                out = fn(*args, **kwargs)
            e.pieces.setdefault(name, []).append(counter.seen)
            return out

        return run

    run_verify = graphs.run_verify

    def verify(entries):
        return counted(f"verify B={len(entries)} n={len(entries[0][0]) - 1}", run_verify)(entries)

    graphs.run_verify = verify  # type: ignore[method-assign]
    chain_start = graphs.chain_start

    def start_chain(entries) -> ChainRun:
        run = chain_start(entries)
        run.apply = counted(f"chain apply B={len(entries)}", run.apply)  # type: ignore[method-assign]
        return run

    graphs.chain_start = start_chain  # type: ignore[method-assign]
    drafter._chain = counted("chain", drafter._chain)  # type: ignore[method-assign]


def _replayed(e: SpecEngine, counter: StepCounter, inside: list[int]) -> None:
    """Count the launches of the forwards a CUDA graph replays (one launch each on a GPU) into `inside`."""
    graphs = e.spec_graphs
    assert graphs is not None

    def wrap(make):
        def made(key):
            forward = make(key)

            def run(layout):
                before = len(counter.seen.launches)
                out = forward(layout)
                inside.append(len(counter.seen.launches) - before)
                return out

            return run

        return made

    graphs._verify_forward = wrap(graphs._verify_forward)  # type: ignore[method-assign]
    graphs._chain_forward = wrap(graphs._chain_forward)  # type: ignore[method-assign]


def census(models, batch: int, n_spec: int, static: bool, prompt_tokens: int) -> dict:
    """Launches and syncs of the second steady verify step (the first settles the real path), the chain's apart.
    Not static: the code before item 5, the rollback's index uploads blocking too (torch.tensor(..., device))."""
    if not static:
        with mock.patch.object(rollback, "_index", lambda v, dev: torch.tensor(v, device=dev)):
            return _census(models, batch, n_spec, static, prompt_tokens)
    return _census(models, batch, n_spec, static, prompt_tokens)


def _census(models, batch: int, n_spec: int, static: bool, prompt_tokens: int) -> dict:
    e = build(models, batch, n_spec, static, max_len=prompt_tokens + 64)
    start(e, batch, prompt_tokens, max_tokens=32)
    assert e.runner.drafter is not None
    chain = e.runner.drafter._chain
    settled = False
    with stand_ins():
        for _ in range(16):
            plan = e.scheduler.schedule(4096)
            is_steady = steady(plan, n_spec, batch)
            if not (is_steady and settled):
                run(e, plan)
                settled |= is_steady
                continue
            counter = StepCounter(Attributor(e.model))
            seen: dict[str, Seen] = {}

            def counted_chain(*args, _counter=counter, _seen=seen, **kwargs):  # the chain's own syncs
                before = len(_counter.seen.syncs)
                out = chain(*args, **kwargs)
                _seen["chain_syncs"] = _counter.seen.syncs[before:]  # type: ignore[assignment]
                return out

            e.runner.drafter._chain = counted_chain  # type: ignore[method-assign]
            inside: list[int] = []
            if static:
                _replayed(e, counter, inside)
            run(e, plan, counter)
            s = counter.seen
            return {
                "launches": s.count(),
                "launches_with_graphs": s.count() - sum(inside) + len(inside),  # a replay is one launch
                "syncs": len(s.syncs),
                "chain_syncs": len(seen.get("chain_syncs", [])),
                "sync_sites": sorted({x.site for x in s.syncs}),
            }
    raise RuntimeError("no steady verify step to count")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--drafts", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--cache-dir", type=Path, default=read_environment().cache_dir, help="holds dsv4-tiny")
    ap.add_argument("--json", type=Path)
    opts = ap.parse_args()
    torch.set_num_threads(1)
    models = load_models(ensure_tiny(opts.cache_dir))
    rows, result = [], []
    for b in opts.batch:
        for n in opts.drafts:
            before = census(models, b, n, False, opts.prompt_tokens)
            after = census(models, b, n, True, opts.prompt_tokens)
            result.append({"batch": b, "drafts": n, "before": before, "after": after})
            rows.append([b, n, before["launches"], after["launches"], after["launches_with_graphs"], before["syncs"],
                         after["syncs"], before["chain_syncs"], after["chain_syncs"]])  # fmt: skip
            print(f"B={b} N={n}: before {before}, after {after}", flush=True)
    head = ["B", "N", "launches before", "after", "graphs", "syncs before", "after", "chain syncs before", "after"]
    print(format_table(head, rows))
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
