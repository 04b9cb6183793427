"""The forward split over T ranks (gloo on the CPU, one process a rank) against one rank's, on the tiny model
that splits (dsv4serve/parallel/split_check.py): the logit difference, the greedy tokens, and the collectives
of one decode step counted next to comm_volume.py's projection for the same config and batch.

    python bench/bench_tp_split.py [--sizes 2 4] [--steps 4]

Per run: T, experts owned (EP) or split, batch invariance, the max |logit difference| to T = 1 over the
prefill and every decode step (and the logit scale), whether every rank chose T = 1's tokens, the calls of a
decode step counted and projected, and the operand bytes of a step counted and projected (comm_volume.py
projects bf16 operands; the split forward reduces fp32 shares, fp64 under batch invariance:
numerics.exact_sums), and the wall time.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from dsv4serve.parallel.comm_volume import decode_collectives
from dsv4serve.parallel.split_check import SplitJob, run_split, split_tiny_args
from dsv4serve.report import format_table


def _row(job: SplitJob, ref, out_dir: Path) -> dict[str, str]:
    start = time.perf_counter()
    results = run_split(job, out_dir)
    seconds = time.perf_counter() - start
    diff = max((r.logits - ref.logits).abs().max().item() for r in results)
    projected = decode_collectives(split_tiny_args(), len(job.prompts), job.tp_size, "tp")
    calls = results[0].decode_calls
    return {
        "T": str(job.tp_size),
        "experts": "owned (EP)" if job.expert_parallel else "split",
        "batch-inv": "on" if job.batch_invariant else "off",
        "max |dlogit|": f"{diff:.3g}",
        "logit scale": f"{ref.logits.abs().max().item():.3g}",
        "same tokens": str(all(torch.equal(r.tokens, ref.tokens) for r in results)),
        "calls counted": str(len(calls)),
        "calls projected": str(sum(c.per_step for c in projected)),
        "bytes counted": f"{sum(c.message_bytes for c in calls):,}",
        "bytes projected": f"{sum(c.per_step * c.message_bytes for c in projected):,}",
        "s": f"{seconds:.1f}",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=4, help="greedy decode steps after the prefill")
    ns = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for bi in (False, True):
            ref = run_split(SplitJob(1, decode_steps=ns.steps, batch_invariant=bi), Path(tmp) / f"ref{bi}")[0]
            for size in ns.sizes:
                for ep in (False, True):
                    job = SplitJob(size, ep, decode_steps=ns.steps, batch_invariant=bi)
                    rows.append(_row(job, ref, Path(tmp) / f"{size}{ep}{bi}"))
    print(f"tiny split config, {len(SplitJob(1).prompts)} prompts, greedy; bytes: operands of one decode step")
    print(format_table(rows, tuple(rows[0])))


if __name__ == "__main__":
    main()
