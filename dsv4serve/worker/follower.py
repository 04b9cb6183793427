"""A tensor-parallel rank other than 0: builds its part of the engine, then runs what rank 0 says.

    follower_main(launch)      the process of rank launch.rank > 0 (worker/main.worker_main sends it here)

It has no scheduler of its own and no channel from the API process: each step's plan comes from rank 0
(parallel/step_link.py), its forward meets rank 0's collectives, and the sampled tokens come back from rank 0.
A failure to start is reported to the API process (the one message it may send); any other failure ends the
process, and the supervisor, seeing a rank gone, stops and restarts the whole group.
"""

from __future__ import annotations

import logging
import time
import traceback

import torch

from dsv4serve.ipc.channel import ReportChannel
from dsv4serve.ipc.messages import WorkerFailed, WorkerLaunch
from dsv4serve.parallel.group import stop_group
from dsv4serve.parallel.step_link import Ping, RunStep, StepLink, Stop
from dsv4serve.worker.engine_setup import EngineParts, build_engine
from dsv4serve.worker.runner import Runner

log = logging.getLogger("dsv4serve.worker")


def follower_main(launch: WorkerLaunch) -> None:
    try:
        parts = build_engine(launch)
    except Exception as exc:
        log.error("rank %d: startup failed: %s", launch.rank, traceback.format_exc())
        report = ReportChannel(launch.from_worker)
        report.send(WorkerFailed(f"rank {launch.rank}: {type(exc).__name__}: {exc}"))
        time.sleep(0.2)  # let the message leave before the process ends
        report.close()
        raise SystemExit(1) from exc
    try:
        follow(parts)
    finally:
        stop_group(parts.group)


def follow(parts: EngineParts) -> None:
    """Run rank 0's plans until it says stop."""
    runner: Runner = parts.runner
    link = runner.link
    assert isinstance(link, StepLink) and not link.root
    while True:
        msg = link.recv()
        if isinstance(msg, Stop):
            log.info("rank %d: stopping", parts.group.rank)
            return
        if isinstance(msg, Ping):
            continue
        assert isinstance(msg, RunStep)
        try:
            runner.execute(msg.plan)
        except torch.OutOfMemoryError:
            if not runner.fault_injected:  # mid-forward: the group's collectives are out of step; it restarts
                raise
            runner.drop([r.request_id for r in msg.plan.rows])  # as rank 0 does, before any collective
