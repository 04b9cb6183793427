"""The server's engine over N tensor-parallel ranks (one worker process each, gloo on the CPU) against one rank,
on dsv4-tiny-split: start-to-ready time, the greedy tokens and logprobs of a few prompts, and the wall time.

    python bench/bench_tp_engine.py [--ranks 2 4] [--kernels auto | all=triton] [--tokens 8] [--device cpu | cuda]

`--kernels all=triton` runs every kernel in the Triton interpreter (set here) with the weights loaded packed per
rank (parallel/rank_load.load_rank_packed): slow (~45 s a run); exact across ranks with --expert-parallel, not
with the experts split (the MXFP4 kernel rounds each rank's share of an expert's output to bf16 before the
sum). With `auto` (torch on the CPU) `--batch-invariant` is on, and the split is bitwise one rank's. Wall times
are of a shared 2-core VM: read the agreement.
`--device cuda` (bench/gpu_session.sh, on a machine with 2 or more GPUs): rank r on cuda:r over NCCL, the
kernels as `--kernels` says (auto: Triton, the weights packed per rank; without --batch-invariant).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `tests.worker_launch`
from bench.report import format_table
from dsv4serve.env import read_environment
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.supervisor import EngineClient
from dsv4serve.tiny.builder import ensure_tiny
from tests.worker_launch import launch_for

PROMPTS = ([5, 17, 3, 99, 250, 7, 1000], [128803, *range(1000, 1037)], list(range(3000, 3100)))


async def _run(model: Path, ranks: int, expert_parallel: bool, kernels: str, tokens: int, device: str) -> dict:
    triton = kernels != "auto" or device == "cuda"
    launch = launch_for(
        model,
        device=device,
        tensor_parallel_size=ranks,
        expert_parallel=expert_parallel,
        kernels=kernels,
        batch_invariant=not triton,
        max_model_len=256,
        num_tokens=1024,
        max_num_seqs=len(PROMPTS),
    )
    start = time.perf_counter()
    client = EngineClient(launch, ready_timeout_s=900)
    await client.start()
    ready = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=0)
    out = []
    try:
        for i, prompt in enumerate(PROMPTS):
            ids, lps = [], []
            async for o in client.generate(f"p{i}", prompt, params):
                ids += [t.token_id for t in o.tokens]
                lps += [t.logprob for t in o.tokens]
            out.append((ids, lps))
    finally:
        await client.shutdown()
    return {"ready": ready, "total": time.perf_counter() - start, "out": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--kernels", default="auto", help="auto (torch on the CPU) or e.g. all=triton")
    parser.add_argument("--tokens", type=int, default=8, help="greedy tokens per prompt")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    opts = parser.parse_args()
    if opts.kernels != "auto" and opts.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # inherited by the spawned ranks
    model = ensure_tiny(read_environment().cache_dir, split=True)
    one = asyncio.run(_run(model, 1, False, opts.kernels, opts.tokens, opts.device))
    headers = ["ranks", "experts", "ready s", "total s", "prompts with 1 rank's tokens", "max |dlogprob|"]
    rows = [["1", "-", f"{one['ready']:.1f}", f"{one['total']:.1f}", "-", "-"]]
    for ranks in opts.ranks:
        for ep in (False, True):
            r = asyncio.run(_run(model, ranks, ep, opts.kernels, opts.tokens, opts.device))
            same = sum(a[0] == b[0] for a, b in zip(r["out"], one["out"]))
            diff = max(abs(x - y) for a, b in zip(r["out"], one["out"]) for x, y in zip(a[1], b[1]))
            experts = "owned (EP)" if ep else "split"
            rows.append([str(ranks), experts, f"{r['ready']:.1f}", f"{r['total']:.1f}", f"{same} / 3", f"{diff:.3g}"])
    print(f"{opts.device}, kernels {opts.kernels}, {opts.tokens} greedy tokens x 3 prompts (7, 39, 100 tokens)")
    print(format_table(headers, rows))


if __name__ == "__main__":
    main()
