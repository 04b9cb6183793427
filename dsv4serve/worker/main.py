"""The worker process: loads the model, answers the handshake, then runs the engine loop.

Started with the spawn method; its only argument is a msgpack-encoded WorkerLaunch. Anything that
stops it from starting is reported to the API process as WorkerFailed before it exits.
"""

from __future__ import annotations

import logging
import time
import traceback

import msgspec
import torch

from dsv4serve.ipc.channel import Endpoints, WorkerChannel
from dsv4serve.ipc.messages import (
    AbortRequest,
    AddRequest,
    Rejected,
    RequestOutput,
    Shutdown,
    Stats,
    WorkerFailed,
    WorkerLaunch,
)
from dsv4serve.parallel.group import stop_group
from dsv4serve.parallel.step_link import Ping, RunStep, Stop
from dsv4serve.worker.engine_setup import EngineParts, build_engine
from dsv4serve.worker.follower import follower_main
from dsv4serve.worker.step import StepPlan

log = logging.getLogger("dsv4serve.worker")
STATS_INTERVAL_S = 0.2
IDLE_POLL_S = 0.05
SPEC_LOG_INTERVAL_S = 10.0
PING_S = 60.0  # an idle rank 0 pings the other ranks this often (well within parallel/group.GROUP_TIMEOUT)


def worker_main(launch_bytes: bytes) -> None:
    launch = msgspec.msgpack.decode(launch_bytes, type=WorkerLaunch)
    who = "worker" if launch.tensor_parallel_size.value == 1 else f"rank {launch.rank}"
    logging.basicConfig(
        level=launch.log_level.upper(), format=f"%(asctime)s %(levelname)s %(name)s[{who}]: %(message)s"
    )
    if launch.rank > 0:
        follower_main(launch)
        return
    channel = WorkerChannel(Endpoints(launch.to_worker, launch.from_worker))
    try:
        parts = build_engine(launch)
    except Exception as exc:  # any startup failure is reported, never silently lost
        log.error("worker startup failed: %s", traceback.format_exc())
        channel.send(WorkerFailed(f"{type(exc).__name__}: {exc}"))
        time.sleep(0.2)  # let the message leave before the process ends
        channel.close()
        return
    channel.send(parts.ready)
    try:
        EngineLoop(parts, channel).run()
    finally:
        channel.close()
        stop_group(parts.group)


class EngineLoop:
    def __init__(self, parts: EngineParts, channel: WorkerChannel):
        self.p, self.channel = parts, channel
        self.link = parts.runner.link  # tensor parallel: the other ranks run the plans this loop sends them
        self.oom_recoveries = 0
        self._last_stats = 0.0
        self._last_sent = time.monotonic()  # the last message to the other ranks (they are pinged when idle)
        self._spec_logged, self._spec_logged_at = (0, 0), 0.0  # (draft tokens, accepted) at the last log line

    def run(self) -> None:
        while True:
            busy = self.p.scheduler.has_work
            msg = self.channel.recv(0 if busy else IDLE_POLL_S)
            while msg is not None:
                if isinstance(msg, Shutdown):
                    self._to_ranks(Stop())
                    return
                self._handle(msg)
                msg = self.channel.recv(0)
            if self.p.scheduler.has_work:
                self.step()
            elif self.link is not None and time.monotonic() - self._last_sent > PING_S:
                self._to_ranks(Ping())
            self._maybe_stats(force=not busy)

    def _to_ranks(self, message: RunStep | Ping | Stop) -> None:
        if self.link is not None:
            self.link.send(message)
            self._last_sent = time.monotonic()

    def _handle(self, msg: AddRequest | AbortRequest) -> None:
        if isinstance(msg, AddRequest):
            problem = self.p.runner.grammars.check(msg.sampling)  # a constraint xgrammar rejects is a 400
            rejected = Rejected(msg.request_id, 400, problem) if problem else self.p.scheduler.add(msg)
            if rejected is not None:
                self.channel.send(rejected)
        else:
            self._send(self.p.scheduler.abort(msg.request_id))

    def step(self) -> None:
        """plan -> runner -> complete: the scheduler plans, the runner runs the plan, the scheduler
        takes the output (worker/step.py)."""
        sched = self.p.scheduler
        plan = sched.schedule(self.p.chunk.chunk_tokens)
        self._to_ranks(RunStep(plan))  # every rank runs the plan's forward; this one samples
        try:
            out = self.p.runner.execute(plan)
        except torch.OutOfMemoryError as exc:
            if self.link is not None and not self.p.runner.fault_injected:
                # out of memory mid-forward: the ranks' collectives are out of step, so the group cannot go on;
                # this rank ends, and the supervisor restarts the group (in-flight requests get an error)
                log.error("out of memory in a tensor-parallel step (%s): the rank group restarts", exc)
                raise
            self._recover_from_oom(plan, exc)
            return
        for message in sched.complete(plan, out):
            self._send(message)

    def _recover_from_oom(self, plan: StepPlan, exc: Exception) -> None:
        """Shrink the chunk, drop the (possibly half-advanced) states of the step, and recompute.

        A step of 1-token rows cannot shrink further: its requests end with an error instead of
        retrying forever."""
        self.oom_recoveries += 1
        failed = plan.max_prefill_tokens
        ids = [r.request_id for r in plan.rows]
        self.p.runner.drop(ids)
        for message in self.p.scheduler.reset(plan):  # requests that ended while the step was planned
            self._send(message)
        if failed <= 1:
            log.error("out of memory even in a step of 1-token rows (%s): failing %d request(s)", exc, len(ids))
            for rid in ids:
                self._send(self.p.scheduler.abort(rid, f"out of memory on the device even at 1-token steps: {exc}"))
            return
        self.p.chunk.after_oom(failed)
        log.warning(
            "out of memory in a step of %d tokens (%s); prefill chunk lowered to %d tokens (%s); "
            "retrying %d request(s)",
            plan.num_tokens,
            exc,
            self.p.chunk.chunk_tokens,
            self.p.chunk.reason,
            len(ids),
        )
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _send(self, message: RequestOutput | None) -> None:
        if message is not None:
            self.channel.send(message)

    def _maybe_stats(self, force: bool) -> None:
        now = time.monotonic()
        if now - self._last_stats < STATS_INTERVAL_S and not (force and now - self._last_stats > 1.0):
            return
        self._last_stats = now
        s = self.p.scheduler
        self.channel.send(
            Stats(
                num_running=len(s.running),
                num_waiting=len(s.waiting),
                kv_usage=s.kv_usage,
                prefill_chunk_tokens=self.p.chunk.chunk_tokens,
                oom_recoveries_total=self.oom_recoveries,
                prefix_cache_queries_total=s.prefix_queries_tokens,
                prefix_cache_hits_total=s.prefix_hits_tokens,
                **(self.p.expert_cache.stats.stats_fields() if self.p.expert_cache else {}),
                **s.spec_stats_fields(),
            )
        )
        self._log_acceptance(now)

    def _log_acceptance(self, now: float) -> None:
        """Speculative decoding's acceptance since the last line, at most every SPEC_LOG_INTERVAL_S."""
        s = self.p.scheduler
        drafts, accepted = s.spec_draft_tokens_total, s.spec_accepted_tokens_total
        last_drafts, last_accepted = self._spec_logged
        if drafts == last_drafts or now - self._spec_logged_at < SPEC_LOG_INTERVAL_S:
            return
        new_drafts, new_accepted = drafts - last_drafts, accepted - last_accepted
        log.info(
            "speculative decoding: %.1f%% of %d draft tokens accepted (%.1f%% over %d since start)",
            100 * new_accepted / new_drafts,
            new_drafts,
            100 * accepted / drafts,
            drafts,
        )
        self._spec_logged, self._spec_logged_at = (drafts, accepted), now
