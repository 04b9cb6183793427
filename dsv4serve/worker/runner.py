"""The one place that builds tensors for a step: the model forward and the sampler.

The runner owns the paged KV pool and each running request's handle on it (`SequenceState`: slot,
page table, length), follows the scheduler's step plan (pages, prefix snapshots saved and restored)
in one batched forward, and samples the rows that reached the end of their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4serve.ipc.messages import TokenLogprob, TokenOut
from dsv4serve.model.kv_pool import KvPool
from dsv4serve.model.numerics import Numerics
from dsv4serve.model.state import SequenceState
from dsv4serve.model.transformer import BatchRow, Transformer
from dsv4serve.worker.request import Request
from dsv4serve.worker.sampling import SamplingRow, make_generator, sample
from dsv4serve.worker.scheduler import ScheduledRow, StepPlan

PromptLogprobs = dict[str, list[tuple[int, TokenOut]]]  # request id -> (prompt position, its logprob)


@dataclass(frozen=True)
class FaultInjection:
    """TESTING ONLY: raise a real torch.OutOfMemoryError when a step's prefill activations would pass
    `oom_above_bytes` (estimated as tokens x `activation_bytes_per_token`)."""

    oom_above_bytes: int | None = None
    activation_bytes_per_token: int = 1


class Runner:
    def __init__(
        self,
        model: Transformer,
        pool: KvPool,
        numerics: Numerics,
        eos_token_id: int,
        device: torch.device,
        fault: FaultInjection = FaultInjection(),
    ):
        self.model, self.pool, self.numerics, self.device, self.fault = model, pool, numerics, device, fault
        self.eos_token_id = eos_token_id
        self.states: dict[str, SequenceState] = {}
        # a seeded request's generator lives as long as the request (not its state): a request that is
        # preempted and recomputed continues the same random sequence
        self.generators: dict[str, torch.Generator] = {}

    def drop(self, request_ids: tuple[str, ...] | list[str]) -> None:
        """Forget the sequences of these requests (preempted, finished or aborted); the scheduler
        took their slots and pages back."""
        for rid in request_ids:
            self.states.pop(rid, None)

    def forget(self, request_id: str) -> None:
        """The request is over: free everything the runner kept for it."""
        self.states.pop(request_id, None)
        self.generators.pop(request_id, None)

    def _sequence(self, r: ScheduledRow) -> SequenceState:
        """The row's sequence: a new one (from a copy of a prefix snapshot when the plan says so), with
        the pages the scheduler added since the last row."""
        state = self.states.get(r.request_id)
        if state is None:
            state = self.states[r.request_id] = SequenceState(self.pool, r.slot)
            if r.restore_slot is not None:
                self.pool.copy_slot(r.restore_slot, r.slot)
                state.num_tokens = r.start_position
        if state.slot != r.slot or state.num_tokens != r.start_position:
            raise RuntimeError(
                f"{r.request_id}: sequence at slot {state.slot} position {state.num_tokens}, "
                f"plan at slot {r.slot} position {r.start_position}"
            )
        state.pages.extend(r.new_pages)
        return state

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[TokenOut]:
        rows = []
        for req in reqs:
            gen = None
            if req.sampling.seed is not None:
                gen = self.generators.get(req.request_id)
                if gen is None:
                    gen = self.generators[req.request_id] = make_generator(req.sampling.seed, logits.device)
            rows.append(SamplingRow(req.sampling, req.prompt_token_ids, req.output_token_ids, self.eos_token_id, gen))
        out = sample(logits, rows)
        tokens = []
        for i, req in enumerate(reqs):
            top = out.row_top(i)
            tokens.append(
                TokenOut(
                    int(out.token_ids[i]),
                    float(out.logprobs[i]) if req.sampling.logprobs is not None else None,
                    [TokenLogprob(t, lp) for t, lp in top] if top else None,
                )
            )
        return tokens

    def _check_fault(self, plan: StepPlan) -> None:
        budget = self.fault.oom_above_bytes
        if budget is not None and plan.num_tokens * self.fault.activation_bytes_per_token > budget:
            raise torch.OutOfMemoryError(
                f"injected for testing: {plan.num_tokens} tokens x {self.fault.activation_bytes_per_token} "
                f"activation bytes > budget {budget} bytes"
            )

    def execute(self, plan: StepPlan, requests: dict[str, Request]) -> tuple[dict[str, TokenOut], PromptLogprobs]:
        """Run one step: the sampled token of every row that asked for one, and the prompt logprobs
        (position -> TokenOut) of the rows whose request asked for them."""
        self.drop(plan.dropped)
        if not plan.rows:
            return {}, {}
        self._check_fault(plan)
        rows = [
            BatchRow(torch.tensor(r.token_ids, dtype=torch.long, device=self.device), self._sequence(r))
            for r in plan.rows
        ]
        wants = [
            i
            for i, r in enumerate(plan.rows)
            if requests[r.request_id].prompt_logprobs is not None
            and r.start_position < len(requests[r.request_id].prompt_token_ids) - 1
        ]
        out = self.model.forward(rows, self.numerics, all_logits=bool(wants))
        prompt_lps = {
            plan.rows[i].request_id: self._prompt_logprobs(
                plan.rows[i], requests[plan.rows[i].request_id], out.logits[i]
            )
            for i in wants
        }
        for r in plan.rows:
            if r.snapshot_slot is not None:
                self.pool.copy_slot(r.slot, r.snapshot_slot)
        picks = [i for i, r in enumerate(plan.rows) if r.sample]
        if not picks:
            return {}, prompt_lps
        logits = self._picked_logits(out, picks, len(plan.rows))  # [B, vocab] fp32
        reqs = [requests[plan.rows[i].request_id] for i in picks]
        tokens = self._sample(logits, reqs)
        return {plan.rows[i].request_id: tok for i, tok in zip(picks, tokens)}, prompt_lps

    @staticmethod
    def _picked_logits(out, picks: list[int], n_rows: int) -> torch.Tensor:
        """The sampled rows' last-position logits, without copying the [rows, vocab] block when every
        row samples (the common decode step: a copy costs ~30 ms at 64 rows on a CPU)."""
        if out.last_logits is None:  # all positions were asked for (prompt logprobs)
            return torch.stack([out.logits[i][-1] for i in picks]).float()
        if len(picks) == n_rows:
            return out.last_logits.float()
        return out.last_logits.index_select(0, torch.tensor(picks, device=out.last_logits.device)).float()

    @staticmethod
    def _prompt_logprobs(row, req: Request, logits: torch.Tensor) -> list[tuple[int, TokenOut]]:
        """logits [T, vocab] of the row's positions -> (prompt position, logprob of that prompt token)."""
        prompt = req.prompt_token_ids
        n = min(len(row.token_ids), len(prompt) - 1 - row.start_position)  # positions with a next prompt token
        logp = torch.log_softmax(logits[:n].float(), dim=-1)  # [n, vocab]
        targets = prompt[row.start_position + 1 : row.start_position + 1 + n]
        index = torch.tensor(targets, device=logp.device).unsqueeze(1)  # gather wants it beside logp
        chosen = logp.gather(1, index).squeeze(1).tolist()
        k = req.sampling.prompt_logprobs or 0
        top_v, top_i = logp.topk(k, dim=-1) if k else (None, None)
        top_vs, top_is = (top_v.tolist(), top_i.tolist()) if k else ([], [])  # one host sync each, not one a row
        out = []
        for j in range(n):
            top = [TokenLogprob(int(t), float(v)) for t, v in zip(top_is[j], top_vs[j])] if k else None
            out.append((row.start_position + 1 + j, TokenOut(int(targets[j]), float(chosen[j]), top)))
        return out
