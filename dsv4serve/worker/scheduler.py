"""Continuous batching without tensors: which tokens of which requests run in the next step.

Every step runs every decoding request (one token each) and fills the rest of the step's token
budget, the prefill chunk the planner allows, with prompt chunks: a decode waits at most one chunk.
KV is reserved in pages as tokens are computed; when the pool is full the most recently admitted
request is preempted (its state dropped, recomputed later) rather than anyone waiting forever.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dsv4serve.ipc.messages import AddRequest, Rejected, TokenOut
from dsv4serve.worker.request import Request, Status


@dataclass(frozen=True)
class ScheduledRow:
    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    sample: bool  # the row reaches the end of its known tokens: sample the next one


@dataclass(frozen=True)
class StepPlan:
    rows: tuple[ScheduledRow, ...]
    dropped: tuple[str, ...]  # requests whose state the runner must free (preempted, finished, aborted)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @property
    def max_prefill_tokens(self) -> int:
        return max((len(r.token_ids) for r in self.rows), default=0)


@dataclass(frozen=True)
class SchedulerLimits:
    max_running: int
    max_waiting: int
    kv_capacity_tokens: int
    page_tokens: int
    max_model_len: int
    eos_token_id: int


class Scheduler:
    def __init__(self, limits: SchedulerLimits):
        self.limits = limits
        self.num_pages_total = limits.kv_capacity_tokens // limits.page_tokens
        self.num_pages_free = self.num_pages_total
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self._to_drop: list[str] = []
        self._preempted_now = False
        self.finished_without_step: list[Request] = []  # finished while planning; their outputs must be sent

    # ------------------------------------------------------------------ admission
    def add(self, msg: AddRequest) -> Rejected | None:
        if msg.request_id in self.requests:
            return Rejected(msg.request_id, 400, f"request id {msg.request_id} is already in use")
        free_slots = max(self.limits.max_running - len(self.running), 0)
        if len(self.waiting) >= self.limits.max_waiting + free_slots:
            return Rejected(msg.request_id, 503, f"the queue is full ({self.limits.max_waiting} waiting "
                                                 "requests, --max-queued-requests); retry later")
        need = len(msg.prompt_token_ids) + 1
        if need > min(self.limits.max_model_len, self.num_pages_total * self.limits.page_tokens):
            return Rejected(msg.request_id, 400, f"the prompt needs {need} tokens of KV; this server holds "
                                                 f"{self.limits.kv_capacity_tokens}")
        req = Request(msg.request_id, list(msg.prompt_token_ids), msg.sampling, self._arrivals)
        self._arrivals += 1
        self.requests[req.request_id] = req
        self.waiting.append(req)
        return None

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return None
        self._finish(req, "abort")
        return req

    # ------------------------------------------------------------------ planning
    def schedule(self, chunk_tokens: int) -> StepPlan:
        """The next step under a budget of `chunk_tokens` (decodes first, then prompt chunks)."""
        rows: list[ScheduledRow] = []
        self._preempted_now = False
        decoding = [r for r in self.running if r.num_computed_tokens == r.num_tokens - 1]
        for req in sorted(decoding, key=lambda r: r.arrival):
            if req.status is not Status.RUNNING:
                continue
            if self._reserve_or_preempt(req, req.num_tokens):
                rows.append(self._row(req, 1))
            elif not any(r.arrival < req.arrival for r in self.running):
                # the oldest request cannot grow and nobody can make room: it has reached the pool's end
                self._finish(req, "length")
                self.finished_without_step.append(req)
        budget = max(chunk_tokens - len(rows), 1)
        for req in sorted(self.running, key=lambda r: r.arrival):
            if budget <= 0:
                break
            if req.num_tokens - req.num_computed_tokens > 1 and req.status is Status.RUNNING:
                n = self._prefill_tokens(req, budget)
                if n:
                    rows.append(self._row(req, n))
                    budget -= n
        # a request preempted for room in this step is not re-admitted in the same step (no thrashing)
        while (self.waiting and budget > 0 and len(self.running) < self.limits.max_running
               and not self._preempted_now):
            req = self.waiting[0]
            n = self._prefill_tokens(req, budget)
            if not n:
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            rows.append(self._row(req, n))
            budget -= n
        dropped, self._to_drop = tuple(self._to_drop), []
        return StepPlan(tuple(rows), dropped)

    def _prefill_tokens(self, req: Request, budget: int) -> int:
        """How many of the request's pending tokens fit the budget and the free pages (0: none).

        Prompt chunks never preempt: only decodes do, so a row already planned is never dropped.
        """
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        page = self.limits.page_tokens
        have = (req.num_pages + self.num_pages_free) * page - req.num_computed_tokens
        n = min(n, have)
        if n <= 0:
            return 0
        self._take_pages(req, req.num_computed_tokens + n)
        return n

    def _row(self, req: Request, n: int) -> ScheduledRow:
        start = req.num_computed_tokens
        return ScheduledRow(req.request_id, tuple(req.token_ids(start, start + n)), start,
                            sample=start + n == req.num_tokens)

    def _reserve_or_preempt(self, req: Request, n_tokens: int) -> bool:
        """Reserve pages so `req` holds `n_tokens`, preempting newer requests if the pool is full.

        Decodes are planned oldest first, so a victim (always newer) has no row in this step yet.
        """
        need = -(-n_tokens // self.limits.page_tokens) - req.num_pages
        while need > self.num_pages_free:
            victim = max((r for r in self.running if r is not req), key=lambda r: r.arrival, default=None)
            if victim is None or victim.arrival < req.arrival:
                return False
            self._preempt(victim)
        self._take_pages(req, n_tokens)
        return True

    def _take_pages(self, req: Request, n_tokens: int) -> None:
        need = -(-n_tokens // self.limits.page_tokens) - req.num_pages
        if need > 0:
            self.num_pages_free -= need
            req.num_pages += need

    def _preempt(self, req: Request) -> None:
        self._preempted_now = True
        self._release(req)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        self.num_pages_free += req.num_pages
        req.num_pages = 0
        if req in self.running:
            self.running.remove(req)
            self._to_drop.append(req.request_id)

    # ------------------------------------------------------------------ results
    def reset(self, request_ids: list[str]) -> None:
        """Forget the computed state of these requests (after a failed step): they recompute."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and req.status is Status.RUNNING:
                self._preempt(req)

    def complete(self, plan: StepPlan, sampled: dict[str, TokenOut]) -> list[Request]:
        """Advance after a step; returns the requests that produced output or finished."""
        touched: list[Request] = []
        for row in plan.rows:
            req = self.requests.get(row.request_id)
            if req is None or req.status is not Status.RUNNING:
                continue
            req.num_computed_tokens += len(row.token_ids)
            if row.sample and row.request_id in sampled:
                req.output.append(sampled[row.request_id])
                reason = self._stop_reason(req)
                if reason:
                    self._finish(req, reason)
                touched.append(req)
        return touched

    def _stop_reason(self, req: Request) -> str | None:
        s, token = req.sampling, req.output[-1].token_id
        if token in s.stop_token_ids or (token == self.limits.eos_token_id and not s.ignore_eos):
            return "stop"
        if (s.max_tokens is not None and len(req.output) >= s.max_tokens) or \
                req.num_tokens >= self.limits.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason

    def forget(self, request_id: str) -> None:
        """Drop a finished request once its last output was sent."""
        req = self.requests.get(request_id)
        if req is not None and req.status is Status.FINISHED:
            del self.requests[request_id]

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_pages_free / self.num_pages_total if self.num_pages_total else 0.0
