"""Continuous batching without tensors: which tokens of which requests run in the next step.

Every step runs every decoding request (one token each) and fills the rest of the step's token
budget, the prefill chunk the planner allows, with prompt chunks: a decode waits at most one chunk.
KV is reserved in pages as tokens are computed; when the pool is full the least recently used cached
prefixes are evicted first, then the most recently admitted request is preempted (its state dropped,
recomputed later) rather than anyone waiting forever.

Prefix reuse: a prompt's state is saved at its last whole page (the chunk is cut to end there), and
a later prompt that starts with the same whole pages starts from a copy of it. The model is exact at
any chunk boundary, so the output is the same with and without reuse.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dsv4serve.ipc.messages import AddRequest, Rejected, TokenOut
from dsv4serve.worker.prefix_index import PrefixIndex
from dsv4serve.worker.request import Request, Status


@dataclass(frozen=True)
class ScheduledRow:
    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    sample: bool  # the row reaches the end of its known tokens: sample the next one
    restore_key: bytes | None = None  # start from a copy of this cached prefix state
    snapshot_key: bytes | None = None  # after the row, keep a copy of the state under this key


@dataclass(frozen=True)
class StepPlan:
    rows: tuple[ScheduledRow, ...]
    dropped: tuple[str, ...]  # requests whose state the runner must free (preempted, finished, aborted)
    evicted: tuple[bytes, ...] = ()  # cached prefix states the runner must free

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
        self.prefix = PrefixIndex(limits.page_tokens)
        self._evicted: list[bytes] = []
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0

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
        if msg.sampling.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(req.prompt_token_ids)
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
            if req.num_computed_tokens == 0:
                self._attach_prefix(req)
            n = self._prefill_tokens(req, budget)
            if not n:
                req.num_computed_tokens, req.restore_key = 0, None
                break
            self._count_prefix(req)
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            rows.append(self._row(req, n))
            budget -= n
        dropped, self._to_drop = tuple(self._to_drop), []
        evicted, self._evicted = tuple(self._evicted), []
        return StepPlan(tuple(rows), dropped, evicted)

    # ------------------------------------------------------------------ prefix reuse
    def _attach_prefix(self, req: Request) -> None:
        """Start from the longest cached whole-page prefix; plan a snapshot at the last whole page."""
        keys = self.prefix.page_keys(req.token_ids(0, req.num_tokens), req.num_tokens - 1)
        # prompt logprobs need the logits of every prompt position: such a request computes them all
        hit = self.prefix.lookup(keys) if req.prompt_logprobs is None else None
        if hit is not None:
            req.restore_key, req.num_computed_tokens = hit
        last = len(keys) * self.limits.page_tokens
        if keys and last > req.num_computed_tokens and keys[-1] not in self.prefix.entries:
            req.snapshot_at, req.snapshot_key = last, keys[-1]

    def _count_prefix(self, req: Request) -> None:
        if not req.prefix_checked:
            req.prefix_checked = True
            req.num_cached_tokens = req.num_computed_tokens
            self.prefix_queries_tokens += len(req.prompt_token_ids)
            self.prefix_hits_tokens += req.num_cached_tokens

    def _evict_until(self, free_pages: int) -> None:
        while self.num_pages_free < free_pages:
            victim = self.prefix.pop_lru()
            if victim is None:
                return
            key, entry = victim
            self.num_pages_free += entry.num_pages
            self._evicted.append(key)

    def _plan_snapshot(self, req: Request, end: int) -> bytes | None:
        """Reserve pages for a snapshot of `req` at `end` tokens, if that is its planned boundary."""
        if req.snapshot_key is None or end != req.snapshot_at:
            return None
        key, req.snapshot_key = req.snapshot_key, None
        pages = -(-end // self.limits.page_tokens)
        self._evict_until(pages)
        if pages > self.num_pages_free or key in self.prefix.entries:
            return None
        self.num_pages_free -= pages
        self.prefix.insert(key, end, pages, ready=False)
        return key

    def _prefill_tokens(self, req: Request, budget: int) -> int:
        """How many of the request's pending tokens fit the budget and the free pages (0: none).

        Prompt chunks never preempt: only decodes do, so a row already planned is never dropped.
        """
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if req.num_computed_tokens < req.snapshot_at < req.num_computed_tokens + n:
            n = req.snapshot_at - req.num_computed_tokens  # end the chunk on the snapshot boundary
        page = self.limits.page_tokens
        self._evict_until(-(-(req.num_computed_tokens + n) // page) - req.num_pages)
        have = (req.num_pages + self.num_pages_free) * page - req.num_computed_tokens
        n = min(n, have)
        if n <= 0:
            return 0
        self._take_pages(req, req.num_computed_tokens + n)
        return n

    def _row(self, req: Request, n: int) -> ScheduledRow:
        start = req.num_computed_tokens
        restore, req.restore_key = req.restore_key, None
        return ScheduledRow(req.request_id, tuple(req.token_ids(start, start + n)), start,
                            sample=start + n == req.num_tokens, restore_key=restore,
                            snapshot_key=self._plan_snapshot(req, start + n))

    def _reserve_or_preempt(self, req: Request, n_tokens: int) -> bool:
        """Reserve pages so `req` holds `n_tokens`, preempting newer requests if the pool is full.

        Decodes are planned oldest first, so a victim (always newer) has no row in this step yet.
        """
        need = -(-n_tokens // self.limits.page_tokens) - req.num_pages
        self._evict_until(need)
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
    def reset(self, plan: StepPlan) -> None:
        """After a failed step: its requests recompute from scratch, its planned snapshots are void."""
        for row in plan.rows:
            req = self.requests.get(row.request_id)
            if req is not None and req.status is Status.RUNNING:
                self._preempt(req)
            entry = self.prefix.entries.pop(row.snapshot_key, None) if row.snapshot_key else None
            if entry is not None:
                self.num_pages_free += entry.num_pages

    def complete(self, plan: StepPlan, sampled: dict[str, TokenOut]) -> list[Request]:
        """Advance after a step; returns the requests that produced output or finished."""
        touched: list[Request] = []
        for row in plan.rows:
            if row.snapshot_key is not None:
                self.prefix.mark_ready(row.snapshot_key)
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
        """Share of the pool held by requests (cached prefixes are evictable, so they count as free)."""
        if not self.num_pages_total:
            return 0.0
        return (self.num_pages_total - self.num_pages_free - self.prefix.num_pages) / self.num_pages_total
