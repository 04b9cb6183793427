"""Serving under load: NVIDIA's aiperf (a client no one here wrote) drives a real `dsv4serve`.

Starts `dsv4serve --model dsv4-tiny --max-num-seqs 64` on a free port (ready when GET /health
answers 200), then runs `aiperf profile` (streamed chat completions, synthetic prompts) at each
concurrency level, for `--rounds` rounds, the level order reversed every other round so load on
this shared machine hits all levels alike. Numbers come from aiperf's JSON export
(`profile_export_aiperf.json`), never its console: TTFT, inter-token latency, output tokens/s and
the error rate per level (medians over rounds, with min / max of the output rate), and the batching
gain = aggregate output tokens/s at concurrency 16 / at 1.

aiperf needs no torch and lives in its own venv (`python3 -m venv /work/aiperf-venv &&
/work/aiperf-venv/bin/pip install aiperf==0.13.0`); it reads the tokenizer from the local dsv4-tiny
folder (with HF_HUB_OFFLINE=1 it would take a local path for a repo id) and makes no network request.

    python bench/bench_serving.py [--levels 1 4 16 64] [--rounds 2] [--aiperf PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from dsv4serve.env import read_environment
from dsv4serve.tiny.builder import ensure_tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench.report`
from bench.report import format_table

EXPORT_NAME = "profile_export_aiperf.json"


@dataclass(frozen=True)
class LevelResult:
    """One aiperf run at one concurrency, from its JSON export (times in ms)."""

    concurrency: int
    requests: int  # sent
    completed: int
    error_rate_pct: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    output_tokens_per_s: float  # aggregate over all requests
    requests_per_s: float


def parse_export(data: dict, concurrency: int) -> LevelResult:
    """aiperf 0.13's profile_export_aiperf.json -> LevelResult. A run where every request failed has
    no latency metrics: those read as NaN, the error rate still says what happened."""

    def metric(key: str, stat: str) -> float:
        return float(data.get(key, {}).get(stat, float("nan")))

    completed = int(data.get("completed_request_count", data.get("request_count", {})).get("avg", 0))
    if "error_request_count" in data:
        errors = int(metric("error_request_count", "avg"))
    else:
        errors = sum(int(e.get("count", 1)) for e in data.get("error_summary") or [])
    sent = completed + errors
    error_rate = metric("request_error_rate", "avg") if "request_error_rate" in data else 100.0 * errors / max(sent, 1)
    return LevelResult(
        concurrency,
        sent,
        completed,
        error_rate,
        metric("time_to_first_token", "p50"),
        metric("time_to_first_token", "p90"),
        metric("inter_token_latency", "p50"),
        metric("inter_token_latency", "p90"),
        metric("output_token_throughput", "avg"),
        metric("request_throughput", "avg"),
    )


def batching_gain(results: list[LevelResult], high: int = 16, low: int = 1) -> float | None:
    """Median aggregate output tokens/s at `high` over the median at `low` (None if either is missing)."""

    def median_rate(c: int) -> float | None:
        rates = [r.output_tokens_per_s for r in results if r.concurrency == c]
        return statistics.median(rates) if rates else None

    hi, lo = median_rate(high), median_rate(low)
    return hi / lo if hi is not None and lo else None


def level_rows(results: list[LevelResult]) -> list[list[str]]:
    """One row per concurrency: medians over rounds; output tokens/s as min / median / max."""
    rows = []
    for c in sorted({r.concurrency for r in results}):
        runs = [r for r in results if r.concurrency == c]
        med = {
            k: statistics.median(getattr(r, k) for r in runs)
            for k in ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms", "error_rate_pct")
        }
        out = [r.output_tokens_per_s for r in runs]
        rows.append(
            [
                str(c),
                str(len(runs)),
                f"{sum(r.completed for r in runs)}/{sum(r.requests for r in runs)}",
                f"{med['ttft_p50_ms']:.0f}",
                f"{med['ttft_p90_ms']:.0f}",
                f"{med['itl_p50_ms']:.0f}",
                f"{med['itl_p90_ms']:.0f}",
                f"{min(out):.1f} / {statistics.median(out):.1f} / {max(out):.1f}",
                f"{med['error_rate_pct']:.1f}",
            ]
        )
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, log_path: Path, max_running: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "dsv4serve",
        "--model",
        "dsv4-tiny",
        "--port",
        str(port),
        "--max-num-seqs",
        str(max_running),
    ]
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); log: {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"the server was not healthy within 300 s; log: {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def warm_up(port: int, requests: int = 3) -> None:
    """A few short completions before the first level, so none of it pays for the server's first steps."""
    body = {"model": "dsv4-tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    for _ in range(requests):
        httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120).raise_for_status()


def run_aiperf(
    aiperf: Path, port: int, tokenizer: Path, concurrency: int, requests: int, isl: int, osl: int, out_dir: Path
) -> LevelResult:
    cmd = [
        str(aiperf),
        "profile",
        "--model",
        "dsv4-tiny",
        "--url",
        f"http://127.0.0.1:{port}",
        "--endpoint-type",
        "chat",
        "--streaming",
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(requests),
        "--warmup-request-count",
        str(min(concurrency, 4)),
        "--isl",
        str(isl),
        "--osl",
        str(osl),
        "--random-seed",
        "1",
        "--tokenizer",
        str(tokenizer),
        "--artifact-dir",
        str(out_dir),
        "--ui-type",
        "simple",
    ]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    with (out_dir.parent / f"{out_dir.name}.log").open("w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    export = out_dir / EXPORT_NAME
    if not export.is_file():  # aiperf writes no export when every request failed: a row, not a crash
        return LevelResult(concurrency, requests, 0, 100.0, *[float("nan")] * 6)
    return parse_export(json.loads(export.read_text()), concurrency)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--requests-per-level",
        type=int,
        default=2,
        help="requests sent at each level = this x concurrency (at least 8)",
    )
    parser.add_argument("--isl", type=int, default=32, help="prompt tokens")
    parser.add_argument("--osl", type=int, default=8, help="output tokens")
    parser.add_argument("--aiperf", type=Path, default=Path(os.environ.get("AIPERF", "/work/aiperf-venv/bin/aiperf")))
    parser.add_argument("--out", type=Path, help="artifact folder (default: a fresh temporary one)")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    opts = parser.parse_args()
    if not opts.aiperf.is_file():
        sys.exit(f"aiperf not found at {opts.aiperf}: install it in its own venv (see this script's docstring)")
    out = opts.out or Path(tempfile.mkdtemp(prefix="bench-serving-"))
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = ensure_tiny(read_environment().cache_dir)
    port = free_port()
    server = start_server(port, out / "server.log", max(opts.levels))
    results: list[LevelResult] = []
    try:
        warm_up(port)
        for rnd in range(opts.rounds):
            for c in opts.levels if rnd % 2 == 0 else opts.levels[::-1]:
                n = max(8, opts.requests_per_level * c)
                res = run_aiperf(opts.aiperf, port, tokenizer, c, n, opts.isl, opts.osl, out / f"r{rnd}-c{c}")
                results.append(res)
                print(
                    f"round {rnd + 1}, concurrency {c}: {res.output_tokens_per_s:.1f} output tok/s, "
                    f"{res.completed}/{res.requests} completed",
                    flush=True,
                )
    finally:
        stop_server(server)
    gain = batching_gain(results)
    if opts.json:
        opts.json.write_text(
            json.dumps(
                {
                    "isl": opts.isl,
                    "osl": opts.osl,
                    "rounds": opts.rounds,
                    "runs": [asdict(r) for r in results],
                    "batching_gain_16_over_1": gain,
                },
                indent=2,
            )
        )
    print(
        f"\ndsv4-tiny on the CPU path, aiperf streamed chat, ISL {opts.isl}, OSL {opts.osl}, {opts.rounds} rounds "
        f"(artifacts: {out}); latencies: medians over rounds of each run's p50 / p90"
    )
    print(
        format_table(
            [
                "concurrency",
                "runs",
                "completed",
                "TTFT p50 ms",
                "TTFT p90 ms",
                "ITL p50 ms",
                "ITL p90 ms",
                "output tok/s min / med / max",
                "errors %",
            ],
            level_rows(results),
        )
    )
    print(
        f"batching gain (aggregate output tok/s at 16 / at 1): {gain:.2f}"
        if gain
        else "batching gain: needs levels 1 and 16"
    )


if __name__ == "__main__":
    main()
