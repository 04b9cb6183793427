"""The speculative steps' CUDA graphs (issue 19 item 5, worker/spec_graphs.py): verify and the MTP chain replayed.

The rows of `_decode_engine.DecodeBench` (DeepSeek-V4-Flash's dimensions cut to 2 layers, a random model WITH its
MTP block and the MTP block's KV layer, the worker's numerics; each row prefilled with 2,048 random tokens), and
two SpecGraphs over the same model and pool for up to 8 rows and N = 3 drafts: one captured (on CUDA; every
(bucket, n) verify bucket and every chain bucket, into one memory pool, as engine_setup captures them) and one
not (the same static buffers run eagerly: the reference a replay must equal).

Cases, per batch size B and drafts n:
  `spec_graphs verify bs=B n=n`: run = a verify replay (rows [token, n random drafts] at each row's next
      position) -> logits [B * (n + 1), V]; reference = the eager run of the same static buffers from the same
      state (the rows' slots copied aside before the first run and back before the reference); baseline = that
      eager run, timed (the "vs baseline" column: the graph's speed-up).
  `spec_graphs chain bs=B`: run = one replayed MTP application of the chain (a draft token and streams per row,
      a chain started afresh each call) -> draft logits [B, V]; reference and baseline as above.
The notes say what was captured (buckets, seconds, memory) and each verify replay's time against a decode
replay of the same rows (DecodeBench.graph_step, timed here): the verify step's cost in decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.gpu_cases import GpuCase, real_config_dir
from bench.gpu_cases._decode_engine import DecodeBench
from bench.gpu_cases.end_to_end import bench_args

BATCH_SIZES = (1, 8)
DRAFTS = (1, 3)
CONTEXT_TOKENS = 2048
EXTRA_TOKENS = 64  # verify steps run at each row's next position, always the same: the rows never advance
ATOL, RTOL = 0.05, 0.02  # as decode_step.py (a replay is expected to be bit for bit the eager run)


@dataclass
class SpecBench:
    """The decode rows plus the two SpecGraphs (captured, eager), built on first use."""

    bench: DecodeBench
    max_drafts: int
    graphs: object = None
    eager: object = None
    lines: list[str] | None = None

    def setup(self) -> None:
        if self.graphs is not None:
            return
        from dsv4serve.worker.spec_graphs import SpecGraphs

        b = self.bench
        b.setup()
        b.use("resident")
        pool = b.pool
        common = (b.model, pool, b.num, b.n_rows, b.graph_len, self.max_drafts, pool.num_slots - 1, pool.num_pages - 1)
        self.eager = SpecGraphs(*common, capture=False)
        cuda = b.device.type == "cuda"
        self.graphs = SpecGraphs(*common, capture=cuda, mempool=torch.cuda.graph_pool_handle() if cuda else None)
        self.lines = [f"spec_graphs: {self.graphs.report.describe()}"]

    def verify_entries(self, n_rows: int, n: int) -> list:
        b, gen = self.bench, torch.Generator().manual_seed(n_rows * 10 + n)
        drafts = torch.randint(0, b.args.vocab_size, (n_rows, n), generator=gen).tolist()
        out = []
        for r in range(n_rows):
            p = b.rows.pos[r]
            pages = b.rows.pages[r][: (p + n) // b.args.page_tokens + 1]
            out.append(([b.rows.tokens[r][p], *drafts[r]], p, r, pages))
        return out

    def chain_inputs(self, n_rows: int) -> tuple[list, torch.Tensor, torch.Tensor]:
        b = self.bench
        entries = [(b.rows.pos[r] + 1, r, b.rows.pages[r][: (b.rows.pos[r] + 1) // b.args.page_tokens + 1])
                   for r in range(n_rows)]  # fmt: skip
        gen = torch.Generator(device=b.device).manual_seed(n_rows)
        tokens = torch.randint(0, b.args.vocab_size, (n_rows,), device=b.device, generator=gen)
        streams = torch.randn(n_rows, b.args.hc_mult, b.args.dim, device=b.device, generator=gen)
        return entries, tokens, streams.to(b.num.compute_dtype)


class Probe:
    """One case's run / reference / baseline on the shared rows (their slots restored before the reference)."""

    def __init__(self, spec: SpecBench, n_rows: int, drafts: int):
        self.spec, self.n_rows, self.drafts = spec, n_rows, drafts  # drafts 0: the chain case
        self.first = True

    def _call(self, which: str) -> torch.Tensor:
        s = self.spec
        graphs = s.graphs if which == "graphs" else s.eager
        if self.drafts:
            return graphs.run_verify(s.verify_entries(self.n_rows, self.drafts))[0]
        entries, tokens, streams = s.chain_inputs(self.n_rows)
        return graphs.chain_start(entries).apply(tokens, streams)[0]

    def run(self) -> torch.Tensor:
        if self.first:
            self.first = False
            self.spec.setup()
            self.spec.bench.snapshot(self.n_rows)
            return self._call("graphs").clone()
        return self._call("graphs")

    def reference(self) -> torch.Tensor:
        self.spec.bench.restore()
        return self._call("eager")

    def baseline(self) -> torch.Tensor:
        return self._call("eager")


def build(device: torch.device, args, batch_sizes, drafts, context: int) -> tuple[list[GpuCase], SpecBench]:
    bench = DecodeBench(device, args, max(batch_sizes), context, EXTRA_TOKENS, mtp=True)
    spec = SpecBench(bench, max(drafts))
    cases = []
    for b in batch_sizes:
        for n in (*drafts, 0):
            probe = Probe(spec, b, n)
            name = f"spec_graphs verify bs={b} n={n}" if n else f"spec_graphs chain bs={b}"
            cases.append(
                GpuCase(
                    name, probe.run, probe.reference, ATOL, RTOL, bytes_moved=0, baseline=probe.baseline,
                    baseline_name="eager static buffers",
                )
            )  # fmt: skip
    return cases, spec


_SPEC: list[SpecBench] = []  # the module's bench, for `notes`


def cases(device: torch.device) -> list[GpuCase]:
    from dsv4serve.model.args import read_model_args

    out, spec = build(device, bench_args(read_model_args(real_config_dir())), BATCH_SIZES, DRAFTS, CONTEXT_TOKENS)
    _SPEC[:] = [spec]
    return out


def smoke_cases(device: torch.device) -> list[GpuCase]:
    """dsv4-tiny's architecture, 2 layers and its MTP block, rows of 136 tokens; the eager buffers stand in."""
    from dsv4serve.env import read_environment
    from dsv4serve.model.args import read_model_args
    from dsv4serve.tiny.builder import ensure_tiny

    out, spec = build(
        device, bench_args(read_model_args(ensure_tiny(read_environment().cache_dir))), (1, 2), (1, 2), 136
    )
    _SPEC[:] = [spec]
    return out


def notes(times_ms: dict[str, float], ceilings: dict[str, float]) -> list[str]:
    """The capture, and each verify replay in decode replays of the same rows (timed here)."""
    from bench.gpu_check import time_ms

    if not _SPEC or _SPEC[0].graphs is None:
        return []
    spec = _SPEC[0]
    lines = list(spec.lines or [])
    b = spec.bench
    for rows in BATCH_SIZES if b.n_rows >= max(BATCH_SIZES) else (1,):
        b.snapshot(rows)
        decode = time_ms(lambda rows=rows: b.graph_step("resident", rows), b.device, 2, 5)
        b.restore()
        for name, ms in times_ms.items():
            if f"bs={rows} " in name and "verify" in name:
                lines.append(f"{name}: {ms:.3f} ms = {ms / decode:.2f} decode replays of {rows} rows ({decode:.3f} ms)")
    return lines
