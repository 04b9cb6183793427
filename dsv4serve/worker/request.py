"""A request as the scheduler sees it: token ids and counters, never a tensor. Only the scheduler
writes it (worker/step.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from dsv4serve.ipc.messages import TokenOut
from dsv4serve.ipc.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival: int  # admission order
    output: list[TokenOut] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose state the runner holds (prompt + outputs)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    pages: list[int] = field(default_factory=list)  # KV page ids this request holds a reference on
    pages_sent: int = 0  # pages already handed to the runner (its sequence's page table)
    slot: int | None = None  # sequence slot (window ring + compressor carry) while running
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_sent_tokens: int = 0  # outputs already sent to the API process
    prefix_checked: bool = False  # counted in the prefix-cache stats once
    restore_slot: int | None = None  # the next row starts from a copy of this prefix snapshot slot
    snapshot_at: int = 0  # save the state after this many tokens (the last whole page), 0 = not
    snapshot_key: bytes | None = None
    prompt_logprobs: list[TokenOut | None] | None = None  # by prompt position, when asked for
    announced: bool = False  # the runner received the request (StepPlan.new_requests)
    draft_token_ids: tuple[int, ...] = ()  # speculative decoding: drafts to verify in the next decode row
    trim_pages: int | None = None  # the runner's page table is cut to this many at the next row (drafts' pages)

    @property
    def output_token_ids(self) -> list[int]:
        return [t.token_id for t in self.output]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Prompt-then-output tokens in [start, stop)."""
        n_prompt = len(self.prompt_token_ids)
        head = self.prompt_token_ids[start : min(stop, n_prompt)]
        tail = [t.token_id for t in self.output[max(start - n_prompt, 0) : max(stop - n_prompt, 0)]]
        return head + tail
