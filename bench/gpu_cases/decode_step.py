"""The decode step as the engine runs it: eager vs CUDA graphs, experts resident vs an expert-slot cache.

DeepSeek-V4-Flash's real dimensions with 2 layers (one CSA, one HCA: end_to_end.bench_args), a random model
(model.random_init) with the worker's numerics (worker_numerics, --kernels auto: every kernel on Triton on
CUDA, no batch invariance), at batch 1, 8 and 64. Two ways to run a step:
  eager:  build_layout (one pinned upload) + Transformer.run, what --enforce-eager runs;
  graphs: worker/graphs.DecodeGraphs with capture=True (every bucket 1, 2, 4, ..., 64 captured when the
          first graphs case of an expert home runs), one replay per step.
and these homes for the routed experts: all resident (the stacked MXFP4 copies); an ExpertSlotCache whose
bank is the model's packed experts copied to host memory (pinned on CUDA) and whose device slots hold half
of them (its initial fill: the costliest misses' layers first, else an equal share per layer; promotions follow the
routing); "staged", the same with the
last layer's bank pageable, as beyond a pin budget (on CUDA the host stages its misses mid-step: the decode
graphs are cut there, experts/graph_cuts.py, after the worker's start-up check of a cut, whose verdict the
first staged graphs case notes; the replay is checked against the eager step bit for bit); and, when kt-kernel is
installed, --moe-backend hybrid over that cache (experts/attach.attach_cpu_experts: kt-kernel's copy of the
bank, the split's costs measured, the misses it gives the CPU computed there), eager steps at batch <= 8
checked against the device path layer by layer: each MoE layer rerun on the slot cache's path on the input it
had in the hybrid step (HYBRID_LAYER_BOUND), the step's logits not compared (HYBRID_ATOL says why); and hybrid
replays (experts/hybrid_graph.py: each layer's CPU set fixed between steps, kt-kernel as stream host nodes),
checked against DecodeGraphs' eager form of the same step (HYBRID_GRAPH_ATOL).

The rows (_decode_engine.DecodeBench, built by the first case that runs): an engine KvPool as
worker/engine_setup.py builds it (every row its own sequence slot and pages, then one padding slot and one
padding page; here also one snapshot slot per row), 64 rows each prefilled with 2,048 random tokens (4 rows
a forward). Teacher forcing: row r's input at position p is always tokens[r][p], whichever way the step
runs, so eager and graphs stay in step; batch B runs rows 0..B-1 and each step adds one token to each of
them (the context stays about 2,048: row 0, in all 12 cases, ends below 2,150).

Cases, per expert home and batch size; `run` is timed, `reference` is computed once, from the state the first
`run` started at (the rows' slots copied aside before it and back after; their pages are rewritten):
  `decode_step bs=B eager [...]`:  run an eager step; reference: the same step under
      torch.cuda.set_sync_debug_mode("error"). Its note says "no host sync", or names the first sync (the
      error and the project line that made it) and every sync of the step run again under "warn".
  `decode_step bs=B graphs [...]`: run a replay; reference: the eager step on the layout the replay runs
      (DecodeGraphs' block-table width and length bound: the same kernels on the same shapes, so a difference
      is the capture's). Its note: the capture (time, graph memory), the host syncs of the replay path (under
      "warn"), the engine's own eager step vs the replay (its shorter block table and length bound change
      the attention's split order: bf16 noise, which can flip a near-tied expert choice and so move a whole
      row, hence not checked), the slot cache's hits.
Each case times at most MAX_WARMUP + MAX_REPEATS calls (gpu_check's per-case caps). On an H200 the module
should take about 1-2 minutes, nearly all of it set-up: drawing and packing the random model (~15 s), 16
prefill forwards, Triton's first compiles of every decode shape, 2 x 7 bucket captures; the 12 cases' timed
steps take a few seconds.

`notes` sets eager and graphs side by side (the graphs' speed-up), projects both to 43 layers (ms x 43 / 2:
the head counted 21.5 times, an upper bound) as tokens/s, and compares with the bandwidth bound at that batch
size (`step_bytes` over the measured copy bandwidth). Sampling is in no time (the forward only).
"""

from __future__ import annotations

import math
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from bench.gpu_cases import GpuCase, real_config_dir
from bench.gpu_cases._decode_engine import DecodeBench
from bench.gpu_cases._sync_debug import describe_syncs, project_site, sync_debug
from bench.gpu_cases.end_to_end import N_LAYERS, REAL_LAYERS, bench_args
from dsv4serve.experts.kt_backend import kt_kernel_available
from dsv4serve.model.moe_output import Combined

BATCH_SIZES = (1, 8, 64)
HYBRID_MAX_BATCH = 8  # --moe-backend hybrid (kt-kernel installed): eager steps, checked against the slots'
CONTEXT_TOKENS = 2048
# every case runs at most 1 + MAX_WARMUP + MAX_REPEATS steps on rows 0..B-1; row 0 is in all 12 cases
EXTRA_TOKENS = 256
MAX_WARMUP, MAX_REPEATS = 2, 5
# bf16 noise through 2 layers of FP8 activation quantization (a flipped rounding moves a logit by ~1e-2):
# end_to_end's tolerance for logits of the same model
ATOL, RTOL = 0.05, 0.02
# hybrid vs the offload step, checked layer by layer (StepProbe.moe_line), not by logits: kt-kernel feeds w2 the
# bf16 SwiGLU output where the model (and the device path) quantizes it to FP8 first, 2.5-2.7% relative L2 on an
# expert's output at dsv4-tiny's and V4-Flash's dims (~1% on a layer's output in the smoke run), and a random
# 2-layer model turns that into logits apart by ~2 (the H200 host, bench/RESULTS.md 2026-12-04b and 2026-12-06):
# the logits are not checked (NaN still fails), each MoE layer on its own input must be within
# tests/model/test_hybrid_moe.py's bound for the FP8 rounding the CPU experts skip
HYBRID_ATOL = math.inf
HYBRID_LAYER_BOUND = 2.0**-4
# a hybrid replay vs the eager form of the same split (DecodeGraphs.run(eager=True, same_split=True): the same
# kernels, kt-kernel on the same CPU sets): the graphs' own tolerance
HYBRID_GRAPH_ATOL = ATOL
NAME = re.compile(r"decode_step bs=(\d+) (eager|graphs) \[(.+)\]")


@dataclass(frozen=True)
class StepCase(GpuCase):
    """A case every call of which is a decode step on shared rows: it caps its own timing, and reports what
    the step saw besides its time (gpu_check reads `max_warmup`, `max_repeats` and `notes`)."""

    max_warmup: int = MAX_WARMUP
    max_repeats: int = MAX_REPEATS
    notes: Callable[[], list[str]] | None = None


class StepProbe:
    """One case: `run` (a step of rows 0..n-1, timed) and `reference` (once, right after the first run: the
    eager step from the state that run started at, under the sync debug mode for an eager case)."""

    def __init__(self, bench: DecodeBench, mode: str, n: int, replay: bool):
        self.bench, self.mode, self.n, self.replay = bench, mode, n, replay
        self.first = True
        self.out: torch.Tensor | None = None  # the first run's logits
        self.lines: list[str] = []
        self.moe_io: list[tuple[torch.nn.Module, tuple, torch.Tensor]] = []  # hybrid: each MoE's (input, output)

    def _step(self) -> torch.Tensor:
        self.bench.use(self.mode)
        return self.bench.graph_step(self.mode, self.n) if self.replay else self.bench.eager_step(self.n)

    def run(self) -> torch.Tensor:
        b = self.bench
        if not self.first:
            return self._step()
        self.first = False
        b.setup()
        if self.replay and self.mode not in b.graphs:
            if self.mode == "staged":  # the worker's start-up check of a cut graph, before the capture
                self.lines.append(b.cut_check_line())
            self.lines.append(f"built {b.decode_graphs(self.mode).report.describe()}")
        b.snapshot(self.n)
        if not (self.replay and b.device.type == "cuda"):
            self.out = (self._step_keeping_moe_io() if self.mode == "hybrid" else self._step()).clone()
            return self.out
        with sync_debug("warn") as sites:  # the replay path's host side: bucket fill, upload, cache boundary
            self.out = self._step().clone()
        self.lines.append(f"replay: {describe_syncs(sites)}")
        return self.out

    def _step_keeping_moe_io(self) -> torch.Tensor:
        """The hybrid step with each MoE layer's input and output kept, for `moe_line`."""

        def keep(module: torch.nn.Module, args: tuple, out: torch.Tensor | Combined) -> None:
            out = out.value() if isinstance(out, Combined) else out  # a sum left to the post launch: made here
            self.moe_io.append((module, tuple(a.clone() if torch.is_tensor(a) else a for a in args), out.clone()))

        handles = [moe.register_forward_hook(keep) for moe in self.bench.moes]
        try:
            return self._step()
        finally:
            for h in handles:
                h.remove()

    def moe_line(self) -> str:
        """Each MoE layer of the hybrid step against the offload path on that layer's own input (teacher-forced:
        whole steps of a random 2-layer model are chaotic, see HYBRID_ATOL): relative L2 per layer; past
        HYBRID_LAYER_BOUND the case fails (raises). Run with the slots home in use."""
        from dsv4serve.experts.kt_check import relative_error

        with torch.no_grad():
            errs = [relative_error(got, moe(*args)) for moe, args, got in self.moe_io]
        per_layer = ", ".join(f"{e:.2e}" for e in errs)
        line = f"each MoE layer on the hybrid step's own input, hybrid vs offload: relative L2 {per_layer}"
        if not errs or not max(errs) <= HYBRID_LAYER_BOUND:  # NaN fails too
            raise RuntimeError(f"{line}: past the bound {HYBRID_LAYER_BOUND:.3g} (or no MoE layer ran)")
        return f"{line} (bound {HYBRID_LAYER_BOUND:.3g})"

    def reference(self) -> torch.Tensor:
        b = self.bench
        b.restore()
        if self.mode == "hybrid" and self.replay:  # the graph split's eager form, the replay's CPU sets kept
            b.use("hybrid")
            out = b.graph_step("hybrid", self.n, eager=True)
            self.lines.append(f"replay vs its eager form on the same CPU sets: {differences(out, self.out)}")
            return out
        if self.mode == "hybrid":  # the same step with every miss on the device path (the offload step)
            b.use("slots")
            self.lines.append(self.moe_line())
            out = b.eager_step(self.n)
            stats, costs = b.hybrid.stats, b.hybrid.describe()
            self.lines.append(f"hybrid: {costs}; so far {stats.layer_steps} layer steps routed to "
                              f"{stats.routed_experts} experts, {stats.cpu_experts} of them computed on the CPU, "
                              f"{stats.fetched_misses} misses left to the device path")  # fmt: skip
            return out
        b.use(self.mode)
        if self.replay:  # the engine's eager step (informative), then the one on the replay's layout (checked)
            self.lines.append(f"eager step vs replay: {differences(b.eager_step(self.n), self.out)}")
            b.restore()
            return b.eager_step(self.n, static=True)
        if b.device.type != "cuda":
            self.lines.append("sync debug not run: torch.cuda.set_sync_debug_mode needs CUDA")
            return b.eager_step(self.n)
        try:
            with sync_debug("error"):
                out = b.eager_step(self.n)
            self.lines.append("eager step under set_sync_debug_mode('error'): no host sync")
            return out
        except RuntimeError as exc:
            if "synchroniz" not in str(exc):
                raise
            first = f"{str(exc).splitlines()[0][:80]} at {project_site(traceback.extract_tb(exc.__traceback__))}"
        b.restore()  # the failed step stopped part-way: its rows run again from the snapshot
        with sync_debug("warn") as sites:
            out = b.eager_step(self.n)
        self.lines.append(
            f"eager step under set_sync_debug_mode('error'): {first}; under 'warn': {describe_syncs(sites)}"
        )
        return out

    def notes(self, name: str) -> list[str]:
        lines = [f"{name}: {line}" for line in self.lines]
        if self.replay and self.mode in ("slots", "staged") and self.bench.ready:
            lines.append(f"{name}: {self.bench.cache_line(self.mode)}")
        return lines


def differences(got: torch.Tensor, want: torch.Tensor) -> str:
    """got, want [rows, vocab] fp32: the largest difference and the rows past the check's tolerance."""
    err = (got.float() - want.float()).abs()
    bad = (~(err <= ATOL + RTOL * want.float().abs())).any(dim=-1)
    return f"max |diff| {float(err.max()):.3g}, {int(bad.sum())} of {bad.numel()} rows past the tolerance"


def step_bytes(args, rows: int) -> int:
    """Checkpoint bytes (as stored) one decode step of `rows` rows reads: every tensor but the embedding table
    and the routed experts, plus each layer's routed experts that the rows touch, under uniform routing
    E (1 - (1 - k / E)^rows) of its E (k / E of them at batch 1: end_to_end.decode_bytes_per_token). The KV
    cache (about 20 MB a row at 2,048 tokens over 43 layers) is left out."""
    from dsv4serve.model.schema import checkpoint_schema

    specs = checkpoint_schema(args, include_mtp=False)
    routed = sum(s.nbytes for s in specs if s.group == "routed_experts")
    rest = sum(s.nbytes for s in specs if s.group not in ("routed_experts", "embed"))
    touched = 1 - (1 - args.n_activated_experts / args.n_routed_experts) ** rows
    return rest + round(routed * touched)


def build(device: torch.device, args, batch_sizes: tuple[int, ...], context_tokens: int, extra_tokens: int):
    from dsv4serve.model.backends import default_backends

    bench = DecodeBench(device, args, max(batch_sizes), context_tokens, extra_tokens)
    label = "triton" if default_backends(device).uses_triton() else "torch"
    homes = {"resident": "resident", "slots": f"slot cache {bench.n_slots}/{bench.n_experts}"}
    if device.type == "cuda":  # the last layer's bank pageable (beyond a pin budget): the host stages its misses, the
        # graphs are cut there; a CPU reads every bank layer in place (nothing staged: the slots home again)
        homes["staged"] = f"slot cache {bench.n_slots}/{bench.n_experts}, last layer pageable"
    if kt_kernel_available()[0]:  # --moe-backend hybrid: eager (the per-step split) and replays (the fixed one)
        homes["hybrid"] = f"hybrid: slot cache {bench.n_slots}/{bench.n_experts}, misses on kt-kernel"
    cases = []
    for mode, tag in homes.items():
        for n in [n for n in batch_sizes if mode != "hybrid" or n <= HYBRID_MAX_BATCH]:
            for replay in (False, True):
                name = f"decode_step bs={n} {'graphs' if replay else 'eager'} [{tag}, {label}]"
                probe = StepProbe(bench, mode, n, replay)
                hybrid_atol = HYBRID_GRAPH_ATOL if replay else HYBRID_ATOL
                cases.append(
                    StepCase(
                        name,
                        probe.run,
                        probe.reference,
                        hybrid_atol if mode == "hybrid" else ATOL,
                        RTOL,
                        bytes_moved=step_bytes(args, n),
                        notes=partial(probe.notes, name),
                    )
                )
    return cases


def cases(device: torch.device) -> list[GpuCase]:
    from dsv4serve.model.args import read_model_args

    return build(device, bench_args(read_model_args(real_config_dir())), BATCH_SIZES, CONTEXT_TOKENS, EXTRA_TOKENS)


def smoke_cases(device: torch.device) -> list[GpuCase]:
    """dsv4-tiny's architecture, 2 layers, batch 1 and 4, 136-token contexts (the HCA layer's 128-token window
    closes once); DecodeGraphs(capture=False) stands in for the graphs; no sync debug (it needs CUDA)."""
    from dsv4serve.env import read_environment
    from dsv4serve.model.args import read_model_args
    from dsv4serve.tiny.builder import ensure_tiny

    tiny = read_model_args(ensure_tiny(read_environment().cache_dir))
    return build(device, bench_args(tiny), (1, 4), 136, 64)


def notes(times_ms: dict[str, float], ceilings: dict[str, float]) -> list[str]:
    """Eager and graphs per batch size and expert home, projected to 43 layers, against the bandwidth bound."""
    from dsv4serve.model.args import read_model_args

    real = read_model_args(real_config_dir())
    bandwidth = ceilings["copy_GBps"] * 1e9
    steps: dict[tuple[str, int], dict[str, float]] = {}
    for name, ms in times_ms.items():
        m = NAME.match(name)
        if m:
            steps.setdefault((m[3], int(m[1])), {})[m[2]] = ms
    lines = [
        f"decode_step: ms per {N_LAYERS}-layer step -> {REAL_LAYERS} layers (x {REAL_LAYERS / N_LAYERS}, head "
        "included: an upper bound); bound = rows x copy bandwidth / weight bytes a step reads (uniform routing)"
    ]
    for (home, n), t in steps.items():
        bound_bytes = step_bytes(real, n)
        bound_tps = n * bandwidth / bound_bytes
        parts = []
        for kind, ms in sorted(t.items()):
            full_ms = ms * REAL_LAYERS / N_LAYERS
            tps = n * 1e3 / full_ms
            parts.append(
                f"{kind} {ms:.2f} ms -> {full_ms:.1f} ms = {tps:.1f} tok/s ({100 * tps / bound_tps:.1f}% of the bound)"
            )
        speedup = f"; graphs {t['eager'] / t['graphs']:.2f}x eager" if len(t) == 2 else ""
        lines.append(
            f"decode_step bs={n} [{home}]: {', '.join(parts)}{speedup}; bound {bound_tps:.0f} tok/s "
            f"({bound_bytes / 1e9:.1f} GB a step)"
        )
    return lines
