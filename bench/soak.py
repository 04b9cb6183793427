"""Soak: N concurrent clients against a real `dsv4serve --model dsv4-tiny` on loopback for a bounded time,
with random lengths, sampling settings, APIs and disconnects; then the server must be back to rest.

Each client loops until the deadline (or the request cap): it picks an API (chat streamed or not,
structured output, Anthropic Messages streamed, Responses streamed), a max_tokens in [1, 48], a
temperature / top_p / top_k / seed, n in {1, 2}, and with probability --disconnect it closes the stream
after a random number of events. At the end, within 10 s: running = 0, waiting = 0, KV usage = 0
(/metrics), and the worker's RSS within --rss-bound-mib of what it was after a warm-up. Prints a table
and PASS / FAIL (exit 1 on FAIL); `--json PATH` writes the numbers.

    python bench/soak.py [--duration 180] [--concurrency 32] [--disconnect 0.3] [--max-requests 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: `bench.report`, `tests.e2e`
from bench.report import format_table
from tests.e2e.api_server import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
}
KINDS = ("chat-stream", "chat", "structured", "messages-stream", "responses-stream")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def random_request(rng: random.Random) -> tuple[str, str, dict]:
    """(kind, path, body)."""
    kind = rng.choice(KINDS)
    sampling = {"temperature": rng.choice([0.0, 0.7, 1.0, 1.5]), "top_p": rng.choice([1.0, 0.9, 0.5])}
    if rng.random() < 0.3:
        sampling["seed"] = rng.randrange(2**31)
    text = "Tell me about " + " ".join(
        rng.choice(["cats", "rain", "code", "tea", "maps"]) for _ in range(rng.randint(1, 40))
    )
    max_tokens = rng.randint(1, 48)
    if kind == "messages-stream":
        body = {"max_tokens": max_tokens, "messages": [{"role": "user", "content": text}], "stream": True}
        return kind, "/v1/messages", {**body, "temperature": min(sampling["temperature"], 1.0)}
    if kind == "responses-stream":
        return kind, "/v1/responses", {"input": text, "max_output_tokens": max_tokens, "stream": True, **sampling}
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "n": rng.choice([1, 2])}
    body.update(sampling, top_k=rng.choice([-1, 5, 50]), stream=kind != "chat")
    if kind == "structured":
        body.update(max_tokens=64, chat_template_kwargs={"thinking": False})
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    return kind, "/v1/chat/completions", body


async def client_loop(http: httpx.AsyncClient, rng: random.Random, deadline: float, args, tally: dict) -> None:
    while time.monotonic() < deadline and tally["requests"] < args.max_requests:
        kind, path, body = random_request(rng)
        tally["requests"] += 1
        cut = rng.randint(1, 12) if body.get("stream") and rng.random() < args.disconnect else None
        try:
            if not body.get("stream"):
                resp = await http.post(path, json=body)
                if resp.status_code != 200:
                    note_error(tally, f"{kind}: HTTP {resp.status_code} {resp.text[:200]}")
                continue
            async with http.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    note_error(tally, f"{kind}: HTTP {resp.status_code} {(await resp.aread())[:200]!r}")
                    continue
                events = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data:"):
                        events += 1
                        if '"error"' in line[:40]:
                            note_error(tally, f"{kind}: error event {line[:200]}")
                    if cut is not None and events >= cut:
                        tally["disconnects"] += 1
                        break  # leaving the block closes the connection: the server must abort
        except httpx.HTTPError as exc:
            note_error(tally, f"{kind}: {type(exc).__name__} {exc}"[:200])


def note_error(tally: dict, what: str) -> None:
    """Count an error and keep the first few, so a FAIL says what went wrong."""
    tally["errors"] += 1
    if len(tally["error_samples"]) < 5:
        tally["error_samples"].append(what)


def engine_gauges(metrics_text: str) -> dict[str, float]:
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    out = {}
    for line in metrics_text.splitlines():
        for name in names:
            if line.startswith(f"dsv4serve:{name} "):
                out[name] = float(line.split()[1])
    return out


async def settle(http: httpx.AsyncClient, timeout_s: float = 10.0) -> tuple[dict[str, float], float]:
    """The engine gauges once they read all zero (or at the timeout), and how long that took."""
    start = time.monotonic()
    while True:
        gauges = engine_gauges((await http.get("/metrics")).text)
        if not any(gauges.values()) or time.monotonic() - start > timeout_s:
            return gauges, time.monotonic() - start
        await asyncio.sleep(0.2)


async def soak(base: str, worker_pid: int, args) -> dict:
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as http:
        warm = await http.post("/v1/chat/completions", json=random_request(random.Random(0))[2] | {"stream": False})
        assert warm.status_code == 200, warm.text
        rss_start = rss_bytes(worker_pid)
        tally: dict = {"requests": 0, "errors": 0, "disconnects": 0, "error_samples": []}
        deadline = time.monotonic() + args.duration
        started = time.monotonic()
        rngs = [random.Random(args.seed * 1000 + i) for i in range(args.concurrency)]
        await asyncio.gather(*[client_loop(http, rng, deadline, args, tally) for rng in rngs])
        elapsed = time.monotonic() - started
        gauges, settle_s = await settle(http)
        rss_end = rss_bytes(worker_pid)
    return {**tally, "seconds": elapsed, "settle_s": settle_s, **gauges, "rss_start": rss_start, "rss_end": rss_end}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--disconnect", type=float, default=0.3, help="share of streams cut mid-way")
    parser.add_argument("--max-requests", type=int, default=5000)
    parser.add_argument("--rss-bound-mib", type=float, default=256.0, help="allowed worker RSS growth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(os.environ.get("DSV4SERVE_TEST_CACHE", "/tmp/dsv4cache"))
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    server = ServerProcess(
        args.cache_dir, Path("/tmp/dsv4serve-soak.log"), "--max-model-len", "2048", "--max-num-seqs", "16"
    )
    try:
        server.wait_healthy()
        (worker,) = server.worker_pids()
        result = asyncio.run(soak(server.base, worker, args))
    finally:
        server.stop()
    growth_mib = (result["rss_end"] - result["rss_start"]) / 2**20
    at_rest = all(
        result.get(k, 1) == 0 for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    )
    ok = at_rest and growth_mib <= args.rss_bound_mib and result["errors"] == 0
    gauges = " / ".join(
        str(result.get(k)) for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    )
    rss = f"{result['rss_start'] / 2**20:.0f} -> {result['rss_end'] / 2**20:.0f} MiB"
    rows = [
        ["requests / errors / disconnects", f"{result['requests']} / {result['errors']} / {result['disconnects']}"],
        ["load", f"{result['seconds']:.0f} s, {args.concurrency} clients"],
        ["running / waiting / KV usage after", f"{gauges} (in {result['settle_s']:.1f} s)"],
        ["worker RSS start -> end", f"{rss} ({growth_mib:+.0f}, bound {args.rss_bound_mib:.0f})"],
    ]
    print(format_table(["soak", "result"], rows))
    for what in result["error_samples"]:
        print("error:", what)
    print("PASS" if ok else "FAIL")
    if args.json:
        args.json.write_text(json.dumps({**result, "rss_growth_mib": growth_mib, "pass": ok}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
