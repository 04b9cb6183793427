"""The API process's handle on the worker: start it, talk to it, notice its death, restart it.

A monitor thread per worker receives its messages (handing them to the event loop) and checks every
`POLL_S` that the process is alive, so a dead worker is noticed within a second. Then every
in-flight request gets an error (never a hang), `healthy` is False (/health answers 503), and a new
worker is started after a backoff that grows while the worker keeps dying soon after starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from dsv4serve.ipc.channel import ApiChannel, new_endpoints
from dsv4serve.ipc.messages import (
    AbortRequest,
    AddRequest,
    Ready,
    Rejected,
    RequestOutput,
    Shutdown,
    Stats,
    WorkerFailed,
    WorkerLaunch,
)
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.parallel.rendezvous import free_port

log = logging.getLogger("dsv4serve.supervisor")
# the worker's entry point, imported only in the spawned child: the API process never loads torch
WORKER_MODULE = "dsv4serve.worker.main"
POLL_S = 0.1
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
STABLE_AFTER_S = 30.0  # a worker that lived this long resets the backoff


class EngineUnavailable(RuntimeError):
    """No worker is ready (starting, restarting, or failed): answer 503."""


class RequestRejected(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class RequestFailed(RuntimeError):
    """The request ended without a normal finish: the worker died, or failed it (e.g. out of memory)."""


class WorkerDied(RequestFailed):
    """The worker died while this request was in flight."""


@dataclass
class _Incarnation:
    process: mp.process.BaseProcess  # rank 0: the scheduler's worker, the one on the channel
    channel: ApiChannel
    started: float
    ready: Ready | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    monitor: threading.Thread | None = None
    ranks: list[mp.process.BaseProcess] = field(default_factory=list)  # --tensor-parallel-size N: ranks 1..N-1

    @property
    def processes(self) -> list[mp.process.BaseProcess]:
        return [self.process, *self.ranks]

    def dead(self) -> str | None:
        """Which processes have ended, with their exit codes ("the worker process (exit code -9)", "rank 1 of
        the worker's 2 (exit code -9)"); None while all live."""
        ended = [(r, p.exitcode) for r, p in enumerate(self.processes) if not p.is_alive()]
        if not ended:
            return None
        if not self.ranks:
            return f"the worker process (exit code {ended[0][1]})"
        return ", ".join(f"rank {r} of the worker's {len(self.processes)} (exit code {c})" for r, c in ended)

    def kill_all(self) -> None:
        """A group lives and dies whole: what one rank's death leaves behind waits in a collective forever."""
        for p in self.processes:
            if p.is_alive():
                p.kill()


class EngineClient:
    def __init__(self, launch: WorkerLaunch, ready_timeout_s: float = 600.0):
        self._launch = launch
        self._ready_timeout_s = ready_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._current: _Incarnation | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._ready_event: asyncio.Event | None = None
        self._closing = False
        self._failures_in_a_row = 0
        self._ever_ready = False
        self.worker_restarts_total = 0
        self.stats: Stats | None = None
        self.last_failure: str | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> Ready:
        """Start the first worker and wait for its handshake; raises if it fails or times out."""
        self._loop = asyncio.get_running_loop()
        self._ready_event = asyncio.Event()
        self._spawn()
        try:
            await asyncio.wait_for(self._ready_event.wait(), self._ready_timeout_s)
        except asyncio.TimeoutError:
            await self.shutdown()
            raise EngineUnavailable(f"the worker did not become ready within {self._ready_timeout_s:.0f} s") from None
        if self._current is None or self._current.ready is None:
            failure = self.last_failure or "unknown"
            await self.shutdown()
            raise EngineUnavailable(f"the worker failed to start: {failure}")
        return self._current.ready

    @property
    def healthy(self) -> bool:
        return self._current is not None and self._current.ready is not None and not self._closing

    @property
    def ready_info(self) -> Ready | None:
        return self._current.ready if self._current else None

    def _spawn(self) -> None:
        """Start the worker: one process, or with --tensor-parallel-size N one per rank (a fresh rendezvous port
        each time: a restarted group never meets a stale one)."""
        endpoints, folder = new_endpoints()
        channel = ApiChannel(endpoints, folder)
        n = self._launch.tensor_parallel_size.value
        launch = msgspec.structs.replace(
            self._launch,
            to_worker=endpoints.to_worker,
            from_worker=endpoints.from_worker,
            rendezvous_port=free_port() if n > 1 else 0,
        )
        procs: list[mp.process.BaseProcess] = []
        for rank in range(n):
            proc = mp.get_context("spawn").Process(
                target=run_module_main,
                args=(WORKER_MODULE, msgspec.msgpack.encode(msgspec.structs.replace(launch, rank=rank))),
                name="dsv4serve-worker" if rank == 0 else f"dsv4serve-rank{rank}",
                daemon=True,
            )
            proc.start()
            procs.append(proc)
        inc = _Incarnation(procs[0], channel, time.monotonic(), ranks=procs[1:])
        self._current = inc
        inc.monitor = threading.Thread(target=self._monitor, args=(inc,), name="dsv4serve-monitor", daemon=True)
        inc.monitor.start()
        if n == 1:
            log.info("worker started (pid %s)", procs[0].pid)
        else:
            log.info("worker started: %d ranks (pids %s)", n, ", ".join(str(p.pid) for p in procs))

    def _monitor(self, inc: _Incarnation) -> None:
        """Runs in a thread: forwards messages, and reports the process's death."""
        assert self._loop is not None
        while not inc.stop.is_set():
            try:
                msg = inc.channel.recv(POLL_S)
            except Exception as exc:  # a malformed message is a worker bug: treat as death
                log.error("bad message from the worker: %s", exc)
                inc.process.kill()
                msg = None
            if msg is not None:
                self._loop.call_soon_threadsafe(self._dispatch, inc, msg)
                continue
            dead = inc.dead()
            if dead is not None:
                inc.kill_all()
                self._loop.call_soon_threadsafe(self._on_death, inc, dead)
                return

    def _dispatch(self, inc: _Incarnation, msg) -> None:
        if inc is not self._current:
            return
        if isinstance(msg, Ready):
            inc.ready = msg
            self._ever_ready = True
            log.info(
                "worker ready (pid %s): KV %d tokens, chunk %d tokens (%s)",
                inc.process.pid,
                msg.kv_capacity_tokens,
                msg.chunk.effective_tokens,
                msg.chunk.binding,
            )
            if self._ready_event:
                self._ready_event.set()
        elif isinstance(msg, Stats):
            self.stats = msg
        elif isinstance(msg, WorkerFailed):
            self.last_failure = msg.message
            log.error("worker failed: %s", msg.message)
        elif isinstance(msg, (RequestOutput, Rejected)):
            queue = self._queues.get(msg.request_id)
            if queue is not None:
                queue.put_nowait(msg)

    def _on_death(self, inc: _Incarnation, who: str) -> None:
        """`who`: the processes that ended, with their exit codes (_Incarnation.dead)."""
        if inc is not self._current:
            return
        was_ready = inc.ready is not None
        inc.ready = None
        inc.stop.set()
        inc.channel.close()
        message = f"{who} died; the request was not finished"
        for queue in self._queues.values():
            queue.put_nowait(WorkerDied(message))
        if self._closing:
            return
        if not self._ever_ready:  # the first start failed: start() reports it, nothing is restarted
            if self._ready_event:
                self._ready_event.set()
            return
        lived = time.monotonic() - inc.started
        self._failures_in_a_row = 0 if (was_ready and lived > STABLE_AFTER_S) else self._failures_in_a_row + 1
        delay = BACKOFF_S[min(self._failures_in_a_row, len(BACKOFF_S) - 1)]
        if self._failures_in_a_row >= 3:
            log.error(
                "the worker keeps dying (%d times in a row, last: %s); next start in %.1f s",
                self._failures_in_a_row,
                self.last_failure or who,
                delay,
            )
        else:
            log.error("%s died; restarting in %.1f s", who, delay)
        assert self._loop is not None
        self._loop.call_later(delay, self._restart)

    def _restart(self) -> None:
        if self._closing:
            return
        self.worker_restarts_total += 1
        self._spawn()

    async def shutdown(self) -> None:
        self._closing = True
        inc = self._current
        if inc is None:
            return
        if inc.process.is_alive():
            with contextlib.suppress(Exception):  # the channel may be gone with the worker
                inc.channel.send(Shutdown())  # rank 0 tells the other ranks to stop
        for proc in inc.processes:
            await asyncio.to_thread(proc.join, 5.0)
        inc.kill_all()
        inc.stop.set()
        if inc.monitor is not None:  # the monitor polls the channel: it must stop before the close
            await asyncio.to_thread(inc.monitor.join, 2 * POLL_S + 1.0)
        inc.channel.close()

    # ------------------------------------------------------------------ requests
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing the iterator early aborts the request."""
        inc = self._current
        if inc is None or inc.ready is None or self._closing:
            raise EngineUnavailable("the worker is not ready (starting or restarting)")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            inc.channel.send(AddRequest(request_id, prompt_token_ids, sampling))
            while True:
                item = await queue.get()
                if isinstance(item, WorkerDied):
                    finished = True
                    raise item
                if isinstance(item, Rejected):
                    finished = True
                    raise RequestRejected(item.status, item.message)
                if item.error is not None:
                    finished = True
                    raise RequestFailed(item.error)
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        inc = self._current
        if inc is not None and inc.ready is not None:
            try:
                inc.channel.send(AbortRequest(request_id))
            except Exception as exc:
                log.warning("could not send abort for %s: %s", request_id, exc)

    @property
    def worker_pid(self) -> int | None:
        return self._current.process.pid if self._current else None

    @property
    def worker_pids(self) -> list[int | None]:
        """Every rank's process id, rank order (one entry without tensor parallelism)."""
        return [p.pid for p in self._current.processes] if self._current else []


def run_module_main(module: str, launch_bytes: bytes) -> None:
    """The spawned child's target: import `module` (there, not in the parent) and run its worker_main."""
    importlib.import_module(module).worker_main(launch_bytes)
