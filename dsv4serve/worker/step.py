"""The contract between the scheduler and the runner: one typed step plan in, one typed output back.

    plan = scheduler.schedule(chunk_tokens)      # StepPlan: everything the runner needs, tensor-free
    out = runner.execute(plan)                   # StepOutput: what the step produced
    for message in scheduler.complete(plan, out): send(message)

The runner never reads the scheduler's requests: a request's prompt and sampling parameters reach it
once, in the plan of the step that first schedules it (`new_requests`); the sequences it must drop
(preempted, finished or aborted) and the requests it must forget (finished or aborted) come in the plan
too. `Scheduler.complete` is the only writer of a scheduler `Request`. (vLLM v1's SchedulerOutput /
ModelRunnerOutput follow the same split.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv4serve.ipc.messages import TokenOut
from dsv4serve.ipc.sampling import SamplingParams


@dataclass(frozen=True)
class ScheduledRow:
    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    sample: bool  # the row reaches the end of its known tokens: sample the next one
    slot: int  # the request's sequence slot
    new_pages: tuple[int, ...] = ()  # pages appended to the request's page table from this row on
    restore_slot: int | None = None  # before the row, copy this prefix snapshot slot into `slot`
    snapshot_slot: int | None = None  # after the row, copy `slot` into this prefix snapshot slot
    num_draft_tokens: int = 0  # the last n of token_ids are drafts to verify (speculative decoding)
    num_pages: int | None = None  # first cut the page table to this many pages (rejected drafts' pages went back)


@dataclass(frozen=True)
class NewRequest:
    """What the runner keeps for a request's whole life, sent with its first scheduled row."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams


@dataclass(frozen=True)
class StepPlan:
    rows: tuple[ScheduledRow, ...]
    new_requests: tuple[NewRequest, ...] = ()  # requests scheduled for the first time in this step
    dropped: tuple[str, ...] = ()  # drop these sequences: preempted (recomputed later), finished or aborted
    finished: tuple[str, ...] = ()  # forget these requests entirely (finished, aborted)
    finished_now: tuple[str, ...] = ()  # of `finished`: those that ended while this step was planned

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    @property
    def max_prefill_tokens(self) -> int:
        return max((len(r.token_ids) for r in self.rows), default=0)


PromptLogprobs = list[tuple[int, TokenOut]]  # (prompt position, that prompt token's logprob)


@dataclass(frozen=True)
class StepOutput:
    sampled: dict[str, TokenOut] = field(default_factory=dict)  # request id -> its next token
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # rows whose request asked
    # speculative decoding: the tokens a verify row produced after `sampled` (one per accepted draft), and
    # the drafts proposed for each speculating request's next step
    more: dict[str, tuple[TokenOut, ...]] = field(default_factory=dict)
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)


EMPTY_OUTPUT = StepOutput()
