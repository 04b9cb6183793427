"""Engine fixtures: a real worker process over real IPC, driven from an event loop in a thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dsv4serve.ipc.messages import WorkerLaunch
from dsv4serve.supervisor import EngineClient
from tests.worker_launch import launch_for  # the e2e tests import it from here


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
