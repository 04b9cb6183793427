"""Faults through the HTTP API: client disconnects abort; a dead worker fails streams cleanly."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from .api_server import ONE_TORCH_THREAD, ServerProcess

HELLO = [{"role": "user", "content": "Hello!"}]
LONG = {"messages": HELLO, "max_tokens": 1000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(tiny_cache, tmp_path_factory):
    log = tmp_path_factory.mktemp("faults") / "server.log"
    srv = ServerProcess(tiny_cache, log, "--max-model-len", "2048", env=ONE_TORCH_THREAD)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(f"dsv4serve:{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def wait_for(check, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def test_client_disconnect_aborts_the_request(server):
    with httpx.Client(base_url=server.base, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=LONG) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            assert wait_for(lambda: metric(server.base, "num_requests_running") == 1, 5)
    # the connection is closed: the engine request must be gone (stats are sent every ~0.5 s)
    assert wait_for(
        lambda: metric(server.base, "num_requests_running") == 0 and metric(server.base, "kv_cache_usage_perc") == 0, 3
    )


def test_non_streamed_disconnect_aborts_too(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/chat/completions", json={**LONG, "stream": False}, timeout=2)
    assert wait_for(lambda: metric(server.base, "num_requests_running") == 0, 3)


def test_worker_death_mid_stream_gives_an_error_event_then_done(server):
    with httpx.Client(base_url=server.base, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=LONG) as resp:
            lines = (line for line in resp.iter_lines() if line)
            assert next(lines).startswith("data: ")
            next(lines)
            for pid in server.worker_pids():
                os.kill(pid, signal.SIGKILL)
            rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: ") :])
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert wait_for(lambda: httpx.get(server.base + "/health").status_code == 503, 3)
    resp = httpx.post(server.base + "/v1/chat/completions", json={"messages": HELLO, "max_tokens": 1})
    assert resp.status_code in (200, 503)  # 503 while restarting, never a hang or a 500
    server.wait_healthy(120)
    assert metric(server.base, "worker_restarts_total") == 1
    ok = httpx.post(server.base + "/v1/chat/completions", json={"messages": HELLO, "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200


def test_ctrl_c_ends_running_streams_with_abort_then_exits_cleanly(server):
    """Last in this module: it stops the server."""
    with httpx.Client(base_url=server.base, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=LONG) as resp:
            lines = (line for line in resp.iter_lines() if line)
            assert next(lines).startswith("data: ")
            server.proc.send_signal(signal.SIGINT)
            rest = list(lines)
    assert rest[-1] == "data: [DONE]"
    finishes = [c["finish_reason"] for e in rest[:-1] for c in json.loads(e[6:])["choices"] if c["finish_reason"]]
    assert finishes == ["abort"]
    assert server.proc.wait(30) == 0
