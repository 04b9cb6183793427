"""Continuous batching without tensors: which tokens of which requests run in the next step.

Every step runs every decoding request (one token each) and fills the rest of the step's token
budget, the prefill chunk the planner allows, with prompt chunks: a decode waits at most one chunk.
KV pages (ids of the runner's pool) are taken as tokens are computed; when the pool is full the
least recently used cached prefixes are evicted first, then the most recently admitted request is
preempted (its pages and slot released, recomputed later) rather than anyone waiting forever. A
running request also holds a sequence slot (window ring + compressor carry).

Prefix reuse: a prompt's state is saved at its last whole page (the chunk is cut to end there): the
entry shares the request's complete pages and the runner copies the slot into a snapshot slot. A
later prompt that starts with the same whole pages shares those pages and starts from a copy of the
snapshot. The model is exact at any chunk boundary, so the output is the same with and without reuse.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dsv4serve.ipc.messages import AddRequest, Rejected, RequestOutput, TokenOut
from dsv4serve.paging import IdAllocator
from dsv4serve.worker.prefix_index import PrefixEntry, PrefixIndex
from dsv4serve.worker.request import Request, Status
from dsv4serve.worker.step import NewRequest, ScheduledRow, StepOutput, StepPlan


@dataclass(frozen=True)
class SchedulerLimits:
    max_running: int
    max_waiting: int
    kv_capacity_tokens: int
    page_tokens: int
    max_model_len: int
    eos_token_id: int
    prefix_slots: int = 0  # snapshot slots for cached prefixes [0: as many as max_running]
    speculative_tokens: int = 0  # --speculative-tokens: drafts verified per decode row (0: off)

    @property
    def num_prefix_slots(self) -> int:
        return self.prefix_slots or self.max_running

    @property
    def num_slots(self) -> int:
        return sequence_slots(self.max_running, self.prefix_slots)


def sequence_slots(max_running: int, prefix_slots: int = 0) -> int:
    """Sequence slots the runner's pool needs: running requests first, then prefix snapshots
    (`prefix_slots`, 0: as many as max_running)."""
    return max_running + (prefix_slots or max_running)


class Scheduler:
    def __init__(self, limits: SchedulerLimits):
        self.limits = limits
        self.num_pages_total = limits.kv_capacity_tokens // limits.page_tokens
        self.pages = IdAllocator(self.num_pages_total)
        self.seq_slots = IdAllocator(limits.max_running)
        self.snapshot_slots = IdAllocator(limits.num_prefix_slots)  # slot id = max_running + this id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = 0
        self._to_drop: list[str] = []  # preempted, finished or aborted: the runner drops their sequences
        self._to_forget: list[str] = []  # finished or aborted: the runner forgets them
        self._finished_now: list[str] = []  # finished while planning the next step
        self._preempted_now = False
        self.prefix = PrefixIndex(limits.page_tokens)
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self.spec_drafts_total = 0  # verify rows (speculative decoding)
        self.spec_draft_tokens_total = 0  # drafts they verified
        self.spec_accepted_tokens_total = 0  # drafts accepted

    # ------------------------------------------------------------------ admission
    def add(self, msg: AddRequest) -> Rejected | None:
        if msg.request_id in self.requests:
            return Rejected(msg.request_id, 400, f"request id {msg.request_id} is already in use")
        free_slots = max(self.limits.max_running - len(self.running), 0)
        if len(self.waiting) >= self.limits.max_waiting + free_slots:
            return Rejected(
                msg.request_id,
                503,
                f"the queue is full ({self.limits.max_waiting} waiting requests, --max-queued-requests); retry later",
            )
        need = len(msg.prompt_token_ids) + 1
        if need > min(self.limits.max_model_len, self.num_pages_total * self.limits.page_tokens):
            return Rejected(
                msg.request_id,
                400,
                f"the prompt needs {need} tokens of KV; this server holds {self.limits.kv_capacity_tokens}",
            )
        req = Request(msg.request_id, list(msg.prompt_token_ids), msg.sampling, self._arrivals)
        if msg.sampling.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(req.prompt_token_ids)
        self._arrivals += 1
        self.requests[req.request_id] = req
        self.waiting.append(req)
        return None

    def abort(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """End a request now (the client left, or the step failed it): its last output, or None when it
        is unknown or over already."""
        req = self.requests.get(request_id)
        if req is None or req.status is Status.FINISHED:
            return None
        self._finish(req, "abort")
        return self._output(req, error)

    @property
    def has_work(self) -> bool:
        """Requests to run, or finished ones the runner has not been told to forget yet."""
        return bool(self.running or self.waiting or self._to_forget)

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
                rows.append(self._row(req, 1, self._drafts(req)))
            elif not any(r.arrival < req.arrival for r in self.running):
                # the oldest request cannot grow and nobody can make room: it has reached the pool's end
                self._finish(req, "length")
                self._finished_now.append(req.request_id)
        budget = max(chunk_tokens - sum(len(r.token_ids) for r in rows), 1)  # drafts count
        for req in sorted(self.running, key=lambda r: r.arrival):
            if budget <= 0:
                break
            if req.num_tokens - req.num_computed_tokens > 1 and req.status is Status.RUNNING:
                n = self._prefill_tokens(req, budget)
                if n:
                    rows.append(self._row(req, n))
                    budget -= n
        # a request preempted for room in this step is not re-admitted in the same step (no thrashing)
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_running and not self._preempted_now:
            req = self.waiting[0]
            if req.num_computed_tokens == 0:
                self._attach_prefix(req)
            n = self._prefill_tokens(req, budget)
            if not n:
                self.pages.release(req.pages)
                req.pages, req.num_computed_tokens, req.restore_slot = [], 0, None
                break
            self._count_prefix(req)
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.slot = self.seq_slots.take()[0]
            self.running.append(req)
            rows.append(self._row(req, n))
            budget -= n
        new = tuple(
            NewRequest(r.request_id, tuple(req.prompt_token_ids), req.sampling)
            for r in rows
            if not (req := self.requests[r.request_id]).announced
        )
        for announced in new:
            self.requests[announced.request_id].announced = True
        dropped, self._to_drop = tuple(self._to_drop), []
        finished, self._to_forget = tuple(self._to_forget), []
        finished_now, self._finished_now = tuple(self._finished_now), []
        return StepPlan(tuple(rows), new, dropped, finished, finished_now)

    # ------------------------------------------------------------------ prefix reuse
    def _attach_prefix(self, req: Request) -> None:
        """Start from the longest cached whole-page prefix; plan a snapshot at the last whole page."""
        keys = self.prefix.page_keys(req.token_ids(0, req.num_tokens), req.num_tokens - 1)
        # prompt logprobs need the logits of every prompt position: such a request computes them all
        hit = self.prefix.lookup(keys) if req.prompt_logprobs is None else None
        if hit is not None:
            req.restore_slot, req.num_computed_tokens = hit.slot, hit.num_tokens
            req.pages = self.pages.share(hit.pages)
        last = len(keys) * self.limits.page_tokens
        if keys and last > req.num_computed_tokens and keys[-1] not in self.prefix.entries:
            req.snapshot_at, req.snapshot_key = last, keys[-1]

    def _count_prefix(self, req: Request) -> None:
        if not req.prefix_checked:
            req.prefix_checked = True
            req.num_cached_tokens = req.num_computed_tokens
            self.prefix_queries_tokens += len(req.prompt_token_ids)
            self.prefix_hits_tokens += req.num_cached_tokens

    def _evict_one(self) -> bool:
        victim = self.prefix.pop_lru()
        if victim is None:
            return False
        self._free_entry(victim[1])
        return True

    def _free_entry(self, entry: PrefixEntry) -> None:
        self.pages.release(entry.pages)
        self.snapshot_slots.release([entry.slot - self.limits.max_running])

    def _evict_until(self, free_pages: int) -> None:
        while self.pages.num_free < free_pages and self._evict_one():
            pass

    def _plan_snapshot(self, req: Request, end: int) -> int | None:
        """Keep `req`'s state at `end` tokens, if that is its planned boundary: the entry shares the
        request's whole pages and gets a snapshot slot; returns that slot."""
        if req.snapshot_key is None or end != req.snapshot_at:
            return None
        key, req.snapshot_key = req.snapshot_key, None
        if key in self.prefix.entries:
            return None
        if not self.snapshot_slots.num_free:
            self._evict_one()
        if not self.snapshot_slots.num_free:
            return None  # every snapshot slot is being saved in this step
        slot = self.limits.max_running + self.snapshot_slots.take()[0]
        pages = self.pages.share(req.pages[: end // self.limits.page_tokens])
        self.prefix.insert(key, PrefixEntry(end, pages, slot, ready=False))
        return slot

    def _prefill_tokens(self, req: Request, budget: int) -> int:
        """How many of the request's pending tokens fit the budget and the free pages (0: none).

        Prompt chunks never preempt: only decodes do, so a row already planned is never dropped.
        """
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if req.num_computed_tokens < req.snapshot_at < req.num_computed_tokens + n:
            n = req.snapshot_at - req.num_computed_tokens  # end the chunk on the snapshot boundary
        page = self.limits.page_tokens
        self._evict_until(-(-(req.num_computed_tokens + n) // page) - len(req.pages))
        have = (len(req.pages) + self.pages.num_free) * page - req.num_computed_tokens
        n = min(n, have)
        if n <= 0:
            return 0
        self._take_pages(req, req.num_computed_tokens + n)
        return n

    def _row(self, req: Request, n: int, drafts: tuple[int, ...] = ()) -> ScheduledRow:
        assert req.slot is not None, "only a running request (which holds a sequence slot) is scheduled"
        start = req.num_computed_tokens
        restore, req.restore_slot = req.restore_slot, None
        trim, req.trim_pages = req.trim_pages, None
        new_pages, req.pages_sent = tuple(req.pages[req.pages_sent :]), len(req.pages)
        return ScheduledRow(
            req.request_id,
            tuple(req.token_ids(start, start + n)) + drafts,
            start,
            sample=start + n == req.num_tokens,
            slot=req.slot,
            new_pages=new_pages,
            restore_slot=restore,
            snapshot_slot=self._plan_snapshot(req, start + n),
            num_draft_tokens=len(drafts),
            num_pages=trim,
        )

    def _drafts(self, req: Request) -> tuple[int, ...]:
        """The drafts a decode row verifies: those the runner proposed, as many as the request may still
        produce (one token always comes without a draft) and pages are free for (no preemption, no eviction)."""
        drafts, req.draft_token_ids = req.draft_token_ids, ()
        room = self.limits.max_model_len - req.num_tokens - 1
        if req.sampling.max_tokens is not None:
            room = min(room, req.sampling.max_tokens - len(req.output) - 1)
        n = max(min(len(drafts), room, self.limits.speculative_tokens), 0)
        if n:
            page = self.limits.page_tokens  # free pages only: cached prefixes are worth more than a guess
            n = min(n, (len(req.pages) + self.pages.num_free) * page - req.num_tokens)
            self._take_pages(req, req.num_tokens + n)
        return drafts[:n]

    def _reserve_or_preempt(self, req: Request, n_tokens: int) -> bool:
        """Reserve pages so `req` holds `n_tokens`, preempting newer requests if the pool is full.

        Decodes are planned oldest first, so a victim (always newer) has no row in this step yet.
        """
        need = -(-n_tokens // self.limits.page_tokens) - len(req.pages)
        self._evict_until(need)
        while need > self.pages.num_free:
            victim = max((r for r in self.running if r is not req), key=lambda r: r.arrival, default=None)
            if victim is None or victim.arrival < req.arrival:
                return False
            self._preempt(victim)
        self._take_pages(req, n_tokens)
        return True

    def _take_pages(self, req: Request, n_tokens: int) -> None:
        need = -(-n_tokens // self.limits.page_tokens) - len(req.pages)
        if need > 0:
            req.pages += self.pages.take(need)

    def _preempt(self, req: Request) -> None:
        self._preempted_now = True
        self._release(req)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        self.pages.release(req.pages)
        req.pages, req.pages_sent = [], 0
        if req.slot is not None:
            self.seq_slots.release([req.slot])
            req.slot = None
        req.draft_token_ids, req.trim_pages = (), None
        if req in self.running:
            self.running.remove(req)
            self._to_drop.append(req.request_id)

    # ------------------------------------------------------------------ results
    def reset(self, plan: StepPlan) -> list[RequestOutput]:
        """After a failed step: its requests recompute from scratch, its planned snapshots are void.
        Returns the outputs of the requests that ended while the step was planned."""
        for row in plan.rows:
            req = self.requests.get(row.request_id)
            if req is not None and req.status is Status.RUNNING:
                self._preempt(req)
            if row.snapshot_slot is not None:
                key = next(k for k, e in self.prefix.entries.items() if e.slot == row.snapshot_slot)
                self._free_entry(self.prefix.entries.pop(key))
        return [self._output(self.requests[rid]) for rid in plan.finished_now if rid in self.requests]

    def complete(self, plan: StepPlan, out: StepOutput) -> list[RequestOutput]:
        """Advance after a step: the only writer of a Request. Returns the outputs to send: every request
        that produced a token or finished (in this step, or while it was planned)."""
        touched = [self.requests[rid] for rid in plan.finished_now if rid in self.requests]
        for row in plan.rows:
            if row.snapshot_slot is not None:
                self.prefix.mark_ready(row.snapshot_slot)
            req = self.requests.get(row.request_id)
            if req is None or req.status is not Status.RUNNING:
                continue
            for position, token in out.prompt_logprobs.get(row.request_id, ()):
                if req.prompt_logprobs is not None:
                    req.prompt_logprobs[position] = token
            more = out.more.get(row.request_id, ())
            req.num_computed_tokens += len(row.token_ids) - row.num_draft_tokens + len(more)
            if row.num_draft_tokens:
                self.spec_drafts_total += 1
                self.spec_draft_tokens_total += row.num_draft_tokens
                self.spec_accepted_tokens_total += len(more)
            if row.sample and row.request_id in out.sampled:
                self._append(req, (out.sampled[row.request_id], *more))
                if req.status is Status.RUNNING:
                    req.draft_token_ids = out.drafts.get(row.request_id, ())
                    self._give_back_draft_pages(req)
                touched.append(req)
        return [self._output(req) for req in touched]

    def _append(self, req: Request, tokens: tuple[TokenOut, ...]) -> None:
        """A row's sampled tokens, each checked for a stop: the tokens after a stop are dropped."""
        for token in tokens:
            req.output.append(token)
            reason = self._stop_reason(req)
            if reason:
                self._finish(req, reason)
                return

    def _give_back_draft_pages(self, req: Request) -> None:
        """Pages taken for drafts that were rejected: back to the pool, and out of the runner's page table
        at the request's next row."""
        keep = -(-req.num_tokens // self.limits.page_tokens)  # the next token's position included
        if len(req.pages) > keep:
            self.pages.release(req.pages[keep:])
            req.pages = req.pages[:keep]
            req.pages_sent = min(req.pages_sent, keep)
            req.trim_pages = keep

    def _output(self, req: Request, error: str | None = None) -> RequestOutput:
        """The request's new tokens since its last output; a finished request is forgotten with it."""
        first = req.num_sent_tokens == 0
        new = req.output[req.num_sent_tokens :]
        req.num_sent_tokens = len(req.output)
        finished = req.status is Status.FINISHED
        if finished:
            self.requests.pop(req.request_id, None)
        return RequestOutput(
            req.request_id,
            list(new),
            len(req.prompt_token_ids),
            req.num_cached_tokens,
            req.finish_reason if finished else None,
            error,
            req.prompt_logprobs if first else None,
        )

    def _stop_reason(self, req: Request) -> str | None:
        s, token = req.sampling, req.output[-1].token_id
        if token in s.stop_token_ids or (token == self.limits.eos_token_id and not s.ignore_eos):
            return "stop"
        if (
            s.max_tokens is not None and len(req.output) >= s.max_tokens
        ) or req.num_tokens >= self.limits.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req.announced:
            self._to_forget.append(req.request_id)

    def spec_stats_fields(self) -> dict[str, int]:
        """The speculative-decoding counters, as ipc.messages.Stats names them (vLLM's meanings: a draft is one
        row's proposed tokens in one verify step; accepted tokens exclude the bonus token)."""
        return {
            "spec_decode_num_drafts_total": self.spec_drafts_total,
            "spec_decode_num_draft_tokens_total": self.spec_draft_tokens_total,
            "spec_decode_num_accepted_tokens_total": self.spec_accepted_tokens_total,
        }

    @property
    def kv_usage(self) -> float:
        """Share of the pool's pages held by requests (pages held only by cached prefixes are evictable,
        so they count as free)."""
        if not self.num_pages_total:
            return 0.0
        held = set()
        for req in self.running:
            held.update(req.pages)
        return len(held) / self.num_pages_total
