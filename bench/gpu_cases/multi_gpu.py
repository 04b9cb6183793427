"""The forward split over GPUs (issue 21): T ranks over NCCL against one rank, when the machine has T GPUs.

`dsv4serve.parallel.split_check` runs the model split by `partition.py` (tensor-parallel attention, shared
expert, embedding and head by vocabulary; routed experts split, or owned whole per rank with expert parallelism)
on its tiny model that splits (`split_tiny_args`), one process a rank (torch.multiprocessing spawn, env://
rendezvous, rank r on cuda:r), prefilling 3 prompts and decoding 4 greedy steps, then serving them again through
the runner's decode buckets (captured as CUDA graphs, NCCL collectives inside: what the worker does per rank); the
same job on one rank is the reference. Cases (with T = 2, and 4 when there are 4 GPUs; none on a one-GPU machine,
which a note says):
  `multi_gpu T=T [torch]` and `[torch, EP]`: the torch kernels, whose split sums land on one rank's values
      (on the CPU over gloo they are bit for bit: tests/unit/test_tp_forward.py): atol 1e-3;
  `multi_gpu T=T [triton]` and `[triton, EP]`: every kernel on Triton. The FP8 GEMM hands row-parallel partials
      over in fp32, but with every expert's columns split the MXFP4 kernel rounds each rank's share of an expert's
      output to bf16 before the sum: atol 0.5 on logits of scale ~4 (0.26 on the CPU's interpreter; EP there: 0),
      same greedy tokens expected (see notes).
A run is a spawn of T processes, so the time column means nothing (one call, cached); the notes give each run's
wall time, the greedy tokens' agreement and the collectives of a decode step (all-reduces and all-gathers,
counted by the ranks: 10 for the tiny model's 4 layers, as `comm_volume.py` projects).
`smoke_cases` runs T = 2 over gloo on the CPU (torch kernels, experts split and owned).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.gpu_cases import GpuCase


@dataclass(frozen=True)
class SplitCase(GpuCase):
    max_warmup: int = 0  # a run spawns processes: gpu_check times the cached result once
    max_repeats: int = 1
    notes: object = None


class SplitProbe:
    def __init__(self, job, label: str, lines: list[str]):
        self.job, self.label, self.lines = job, label, lines
        self.result = None
        self.reference_result = None

    def _run(self, job):
        from dsv4serve.parallel.split_check import run_split

        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as out:
            results = run_split(job, Path(out))
        return results, time.monotonic() - t0

    def run(self) -> torch.Tensor:
        if self.result is None:
            self.result, seconds = self._run(self.job)
            calls = self.result[0].decode_calls
            kinds = sorted({c.op for c in calls})
            self.lines.append(
                f"multi_gpu {self.label}: {seconds:.1f} s for the {self.job.tp_size}-rank run; a decode step's "
                f"collectives on rank 0: {len(calls)} ({', '.join(kinds)})"
            )
        return self.result[0].logits

    def reference(self) -> torch.Tensor:
        if self.reference_result is None:
            self.reference_result, seconds = self._run(dataclasses.replace(self.job, tp_size=1))
        want = self.reference_result[0].tokens
        got = self.result[0].tokens if self.result is not None else want
        same = float((got == want).float().mean())
        self.lines.append(
            f"multi_gpu {self.label}: greedy tokens equal to one rank's at {100 * same:.0f}% of positions"
        )
        if self.result is not None:  # the runner's decode buckets: CUDA graphs with the collectives inside, on GPUs
            equal = self.result[0].served == self.reference_result[0].served
            self.lines.append(
                f"multi_gpu {self.label}: served through decode buckets {sorted(set(self.result[0].buckets))}: "
                f"tokens {'equal to' if equal else 'DIFFERENT from'} one rank's"
            )
        return self.reference_result[0].logits

    def notes(self) -> list[str]:
        return list(self.lines)


def build(device_kind: str, sizes: tuple[int, ...], with_triton: bool) -> list[GpuCase]:
    from dsv4serve.model.backends import TORCH, KernelBackends
    from dsv4serve.parallel.split_check import SplitJob

    out: list[GpuCase] = []
    for t in sizes:
        variants = [("torch", TORCH, False, 1e-3), ("torch, EP", TORCH, True, 1e-3)]
        if with_triton:
            triton = KernelBackends.every("triton")
            variants += [("triton", triton, False, 0.5), ("triton, EP", triton, True, 0.5)]
        for label, backends, ep, atol in variants:
            job = SplitJob(tp_size=t, expert_parallel=ep, backends=backends, device=device_kind, served=True)
            probe = SplitProbe(job, f"T={t} [{label}]", [])
            out.append(
                SplitCase(
                    f"multi_gpu T={t} [{label}]", probe.run, probe.reference, atol, 0.0, bytes_moved=0,
                    notes=probe.notes,
                )
            )  # fmt: skip
    return out


def cases(device: torch.device) -> list[GpuCase]:
    n = torch.cuda.device_count()
    sizes = tuple(t for t in (2, 4) if t <= n)
    if not sizes:
        print(f"multi_gpu: {n} GPU on this machine: no split run (it needs 2 or 4)")
    return build("cuda", sizes, with_triton=True)


def smoke_cases(device: torch.device) -> list[GpuCase]:
    """T = 2 over gloo on the CPU, torch kernels, experts split and owned."""
    return build("cpu", (2,), with_triton=False)
