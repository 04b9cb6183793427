"""Time per decode step spent outside the model forward (scheduler, runner, sampler, outputs), and
the API process's time per streamed token (IPC decode, detokenize, chat parser, SSE framing).

Engine: the real worker parts from `build_engine` on dsv4-tiny, driven in-process by the worker's
`EngineLoop` with a channel that msgpack-encodes every outgoing message (the real serialization) and
never blocks. With N requests decoding, each timed step is split into the model forward (the model's
`run` wrapped with a timer), the scheduler's `schedule`, the sampler, and the rest; overhead =
step - forward. The N levels alternate, one step at a time, so load on this shared machine hits all
levels alike. Target: overhead < 1 ms per step at 64 running requests.

API: per token of a realistic text (English, tokenized by the model's tokenizer), the work
`run_choice` and the stream body do between the worker's message and the SSE bytes: msgpack decode
of a one-token RequestOutput, `IncrementalDetokenizer.push`, `ChatChoice.on_event` (the DSV4
reasoning / tool-call parser), the chunk envelope and `sse` framing. Not included: the asyncio
queue hops and uvicorn's socket write.

`--loops-off moe_cpu fp8_cpu ...` adds, for each level, an engine whose steps run with those compiled CPU loops
(dsv4serve.model.<name>.compiled) standing down, as where numba cannot compile: its torch ops instead. Both settings'
steps alternate in the one process, so a machine's swings hit them alike (the x one ratio is within a setting).

    python bench/bench_overhead.py [--levels 1 16 64] [--steps 30] [--clock wall|cpu] [--loops-off NAME ...]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from dsv4serve.api.choices import ChatChoice
from dsv4serve.api.detokenize import IncrementalDetokenizer
from dsv4serve.api.generation import ChoiceEvent
from dsv4serve.api.streaming import Reply, sse
from dsv4serve.api.tokenizer import TextTokenizer
from dsv4serve.env import read_environment
from dsv4serve.ipc.messages import AddRequest, Codec, FromWorker, RequestOutput, Sourced, TokenOut, WorkerLaunch
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.tiny.builder import ensure_tiny
from dsv4serve.worker.engine_setup import build_engine
from dsv4serve.worker.main import EngineLoop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench.report`
from bench.report import format_table, spread

PROMPT_TOKENS = 16
API_TEXT = (
    "The scheduler plans every step without touching a tensor: each decoding request gets one "
    "token, and the rest of the budget goes to prompt chunks. Überprüfung: naïve café, 東京, 🙂. "
)


class EncodingChannel:
    """Stands in for the worker's ZeroMQ channel: encodes what is sent (the real cost), receives nothing."""

    def __init__(self) -> None:
        self._codec = Codec(FromWorker)
        self.sent_bytes = 0

    def send(self, message: msgspec.Struct) -> None:
        self.sent_bytes += len(self._codec.encode(message))

    def recv(self, timeout_s: float) -> None:
        return None


@dataclass
class Timers:
    """Seconds spent inside wrapped callables since the last `reset`."""

    seconds: dict[str, float] = field(default_factory=dict)
    clock: Callable[[], float] = time.perf_counter  # or time.process_time: this process's CPU seconds

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + self.clock() - t0

        return timed

    def reset(self) -> None:
        self.seconds = {}


@dataclass
class Level:
    """One engine with `num_running` requests decoding, its timers and its per-step samples (ms)."""

    num_running: int
    loop: EngineLoop
    timers: Timers
    loops_off: tuple[str, ...] = ()  # compiled CPU loops standing down in this level's steps (`--loops-off`)
    samples: dict[str, list[float]] = field(
        default_factory=lambda: {"step": [], "forward": [], "schedule": [], "sample": [], "overhead": []}
    )


def launch_for(model_path: Path, max_running: int) -> WorkerLaunch:
    return WorkerLaunch(
        to_worker="",
        from_worker="",
        model_path=str(model_path),
        device="cpu",
        max_num_seqs=Sourced(max_running, "cli"),
        max_queued_requests=Sourced(max_running, "cli"),
        max_model_len=Sourced(4096, "cli"),
        max_prefill_length=Sourced(None),
        num_tokens=Sourced(None),
        log_level="warning",
    )


def start_level(
    model_path: Path, num_running: int, max_tokens: int, clock: Callable[[], float] = time.perf_counter
) -> Level:
    """Build an engine, admit `num_running` greedy requests and step until all of them decode."""
    parts = build_engine(launch_for(model_path, num_running))
    loop = EngineLoop(parts, EncodingChannel())
    timers = Timers(clock=clock)
    # Transformer.run: what the runner's eager step and DecodeGraphs' buckets both call (the same model object)
    parts.runner.model.run = timers.wrap("forward", parts.runner.model.run)  # type: ignore[method-assign]
    parts.runner._sample = timers.wrap("sample", parts.runner._sample)
    parts.scheduler.schedule = timers.wrap("schedule", parts.scheduler.schedule)
    sampling = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    gen = torch.Generator().manual_seed(num_running)
    for i in range(num_running):
        prompt = torch.randint(0, 1000, (PROMPT_TOKENS,), generator=gen).tolist()
        rejected = parts.scheduler.add(AddRequest(f"r{i}", prompt, sampling))
        if rejected is not None:
            raise RuntimeError(f"the engine rejected a request: {rejected.message}")
    sched = parts.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        loop.step()
    return Level(num_running, loop, timers)


def _no_loop() -> None:
    return None


def timed_step(level: Level) -> None:
    modules = [importlib.import_module(f"dsv4serve.model.{name}") for name in level.loops_off]
    compiled = [m.compiled for m in modules]
    for m in modules:
        m.compiled = _no_loop  # as where numba cannot compile: the torch ops run
    level.timers.reset()
    t0 = level.timers.clock()
    try:
        level.loop.step()
    finally:
        for m, real in zip(modules, compiled):
            m.compiled = real
    step = level.timers.clock() - t0
    s = level.timers.seconds
    level.samples["step"].append(1e3 * step)
    for name in ("forward", "schedule", "sample"):
        level.samples[name].append(1e3 * s.get(name, 0.0))
    level.samples["overhead"].append(1e3 * (step - s.get("forward", 0.0)))


def api_per_token_us(tokenizer: TextTokenizer, repeats: int) -> list[float]:
    """Microseconds per streamed token of the API-side work (module docstring), one value per repeat."""
    ids = tokenizer.encode(API_TEXT * 8)
    codec_out, codec_in = Codec(FromWorker), Codec(FromWorker)
    wire = [codec_out.encode(RequestOutput("r0", [TokenOut(t)], 16, 0)) for t in ids]
    results = []
    for _ in range(repeats):
        detok = IncrementalDetokenizer(tokenizer)
        choice = ChatChoice(0, tokenizer, opens_reasoning=False, logprobs=False)
        reply = Reply("chatcmpl-bench", "chat.completion", "dsv4-tiny", [choice], [0])
        nbytes = 0
        t0 = time.perf_counter()
        for i, data in enumerate(wire):
            out = codec_in.decode(data)
            text = detok.push([t.token_id for t in out.tokens])
            delta = choice.on_event(ChoiceEvent(0, text, list(out.tokens), None, 16, 0, i + 1))
            if delta is not None:
                nbytes += len(sse(reply.envelope("chat.completion.chunk", choices=[delta])))
        results.append(1e6 * (time.perf_counter() - t0) / len(wire))
    return results


def engine_rows(levels: list[Level]) -> tuple[dict, list[list[str]]]:
    """Per level: the JSON summary and a table row. `x one` is the decode throughput against one running
    request's: N * median step(1) / median step(N) (the issue-16 target: >= 10 at 16)."""
    summary, rows = {}, []
    for lv in levels:
        one = [
            statistics.median(o.samples["step"]) for o in levels if o.num_running == 1 and o.loops_off == lv.loops_off
        ]
        s = {name: spread(v) for name, v in lv.samples.items()}
        share = [o / st for o, st in zip(lv.samples["overhead"], lv.samples["step"])]
        speedup = lv.num_running * one[0] / s["step"]["median"] if one else None
        key = f"{lv.num_running}" + (f" loops off: {' '.join(lv.loops_off)}" if lv.loops_off else "")
        summary[key] = {**s, "overhead_share": spread(share), "throughput_vs_one": speedup}
        o = s["overhead"]
        rows.append(
            [
                str(lv.num_running) + (" (loops off)" if lv.loops_off else ""),
                "-" if speedup is None else f"{speedup:.1f}x",
                f"{s['step']['median']:.1f}",
                f"{s['forward']['median']:.1f}",
                f"{s['schedule']['median']:.3f}",
                f"{s['sample']['median']:.3f}",
                f"{o['min']:.3f} / {o['median']:.3f} / {o['max']:.3f}",
                f"{100 * statistics.median(share):.1f}%",
                "yes" if o["median"] < 1.0 else "NO",
            ]
        )
    return summary, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per level")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--api-repeats", type=int, default=7)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU time (one torch thread), robust to other processes taking the cores",
    )
    parser.add_argument(
        "--loops-off",
        nargs="+",
        default=[],
        metavar="NAME",
        help="also run each level with these compiled CPU loops standing down (e.g. moe_cpu compressor_cpu fp8_cpu "
        "hc_cpu sinkhorn_cpu hadamard_cpu), alternating with the levels as they are",
    )
    parser.add_argument("--json", type=Path, help="write the numbers here")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    model_path = ensure_tiny(read_environment().cache_dir)
    max_tokens = opts.warmup + opts.steps + 8
    clock = time.process_time if opts.clock == "cpu" else time.perf_counter
    levels = [start_level(model_path, n, max_tokens, clock) for n in opts.levels]
    if opts.loops_off:
        for name in opts.loops_off:
            importlib.import_module(f"dsv4serve.model.{name}").compiled  # noqa: B018  # a wrong name fails now
        for n in opts.levels:
            level = start_level(model_path, n, max_tokens, clock)
            levels.append(dataclasses.replace(level, loops_off=tuple(opts.loops_off)))
    for _ in range(opts.warmup):
        for lv in levels:
            lv.loop.step()
    for _ in range(opts.steps):
        for lv in levels:  # alternate: one step of each level in turn
            timed_step(lv)
    api = api_per_token_us(TextTokenizer.for_model(model_path), opts.api_repeats)
    summary, rows = engine_rows(levels)
    if opts.json:
        opts.json.write_text(
            json.dumps({"steps": opts.steps, "engine_ms_per_step": summary, "api_us_per_token": spread(api)}, indent=2)
        )
    print(
        f"\ndsv4-tiny, CPU, 1 thread, {opts.steps} decode steps per level (levels alternate), ms per step "
        f"({opts.clock} clock); "
        "overhead = step - model forward (schedule and sample are part of it)"
    )
    print(
        format_table(
            [
                "running",
                "x one",
                "step",
                "forward",
                "schedule",
                "sample",
                "overhead min / med / max",
                "share",
                "< 1 ms",
            ],
            rows,
        )
    )
    a = spread(api)
    print(
        f"\nAPI process per streamed token (IPC decode + detokenize + chat parser + SSE): "
        f"{a['min']:.1f} / {a['median']:.1f} / {a['max']:.1f} us (min / median / max of {opts.api_repeats})"
    )


if __name__ == "__main__":
    main()
