"""Engine fixtures: a real worker process over real IPC, driven from an event loop in a thread."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from dsv4serve.ipc.messages import Sourced, WorkerLaunch
from dsv4serve.supervisor import EngineClient


class LoopThread:
    """An asyncio loop in a background thread, so one engine client can serve many sync tests."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def launch_for(model_dir: Path, **overrides) -> WorkerLaunch:
    """A launch for dsv4-tiny on the CPU; a plain override value is a setting given on the command line."""
    base = dict(
        to_worker="",
        from_worker="",
        model_path=str(model_dir),
        device="cpu",
        max_num_seqs=Sourced(8),
        max_queued_requests=Sourced(16),
        max_model_len=Sourced(4096, "model-rule"),
        max_prefill_length=Sourced(None),
        num_tokens=Sourced(None),
        # the engine tests compare tokens with the model run alone, and requests with each other: bitwise
        batch_invariant=Sourced(True, "cli"),
    )
    given = {
        k: v if k in ("device", "model_path", "log_level") or isinstance(v, Sourced) else Sourced(v, "cli")
        for k, v in overrides.items()
    }
    return WorkerLaunch(**{**base, **given})


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


def start_client(lt: LoopThread, launch: WorkerLaunch) -> EngineClient:
    client = EngineClient(launch, ready_timeout_s=180)
    lt.run(client.start(), timeout=200)
    return client


@pytest.fixture(scope="module")
def engine(tiny_dir):
    """One worker on dsv4-tiny shared by a module's tests."""
    lt = LoopThread()
    client = start_client(lt, launch_for(tiny_dir))
    yield lt, client
    lt.run(client.shutdown())
    lt.close()
