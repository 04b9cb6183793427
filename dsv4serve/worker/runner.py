"""The one place that builds tensors for a step: the model forward and the sampler.

The runner owns the paged KV pool and each running request's handle on it (`SequenceState`: slot,
page table, length), follows the scheduler's step plan (pages, prefix snapshots saved and restored)
in one batched forward, and samples the rows that reached the end of their tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4serve.ipc.messages import TokenLogprob, TokenOut
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.model.batch import HostStaging, build_layout
from dsv4serve.model.kv_pool import KvPool, SequenceState
from dsv4serve.model.numerics import Numerics
from dsv4serve.model.transformer import ForwardOutput, Transformer
from dsv4serve.worker.grammar import GrammarBook, RequestGrammar
from dsv4serve.worker.graphs import DecodeGraphs
from dsv4serve.worker.sampler_inputs import HostReader
from dsv4serve.worker.sampling import SamplingRow, make_generator, sample
from dsv4serve.worker.step import EMPTY_OUTPUT, NewRequest, PromptLogprobs, ScheduledRow, StepOutput, StepPlan

# the sampler row of a batch row that samples nothing this step (a prefill chunk that is not the prompt's last)
_PLACEHOLDER = SamplingRow(SamplingParams(temperature=0.0), (), (), None)


@dataclass
class RunnerRequest:
    """What the runner keeps of a request for its whole life (the scheduler's Request is not read)."""

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)  # what this runner sampled (penalties)
    # a seeded request's generator lives as long as the request (not its sequence): a request that is
    # preempted and recomputed continues the same random sequence
    generator: torch.Generator | None = None
    grammar: RequestGrammar | None = None  # structured output: this request's matcher (worker/grammar.py)


class Runner:
    def __init__(
        self,
        model: Transformer,
        pool: KvPool,
        numerics: Numerics,
        eos_token_id: int,
        device: torch.device,
        oom_above_bytes: int | None = None,
        activation_bytes_per_token: int = 1,
        grammars: GrammarBook | None = None,
        graphs: DecodeGraphs | None = None,
    ):
        self.model, self.pool, self.numerics, self.device = model, pool, numerics, device
        self.eos_token_id = eos_token_id
        self.states: dict[str, SequenceState] = {}
        self.requests: dict[str, RunnerRequest] = {}
        # TESTING ONLY (env.Environment.testing_oom_above_bytes): raise a real torch.OutOfMemoryError when
        # a step's activations would pass this many bytes (tokens x activation_bytes_per_token)
        self.oom_above_bytes, self.activation_bytes_per_token = oom_above_bytes, activation_bytes_per_token
        self.staging = HostStaging(device)  # the step's metadata: one copy to the device, from pinned memory
        self.sampler_staging = HostStaging(device)  # the sampler's parameters: one more, also from pinned memory
        self.reader = HostReader(device)  # the sampled tokens (and logprobs): one copy back, the step's one wait
        self.graphs = graphs  # decode steps on static buffers (CUDA graphs), or None: every step eager
        # structured output: compiled grammars (built on first use; the bundled tokenizer unless given)
        self.grammars = grammars or GrammarBook("", model.args.vocab_size, eos_token_id)

    def drop(self, request_ids: tuple[str, ...] | list[str]) -> None:
        """Forget the sequences of these requests (preempted, finished or aborted); the scheduler
        took their slots and pages back."""
        for rid in request_ids:
            self.states.pop(rid, None)

    def _admit(self, new: tuple[NewRequest, ...]) -> None:
        for n in new:
            gen = make_generator(n.sampling.seed, self.device) if n.sampling.seed is not None else None
            grammar = self.grammars.start(n.sampling, n.request_id)
            self.requests[n.request_id] = RunnerRequest(n.prompt_token_ids, n.sampling, generator=gen, grammar=grammar)

    def _forget(self, request_ids: tuple[str, ...]) -> None:
        """The requests are over: free everything the runner kept for them."""
        for rid in request_ids:
            self.states.pop(rid, None)
            self.requests.pop(rid, None)

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

    def _sample(self, logits: torch.Tensor, request_ids: list[str | None]) -> list[TokenOut]:
        """logits [B, V] fp32 -> the next token of each row with a request id (None: a row that does not
        sample, given a greedy placeholder so that the logits need no gather). The rows' parameters go to
        the device in one copy from pinned memory; the results come back in one copy, the step's only wait."""
        reqs = [self.requests[rid] if rid is not None else None for rid in request_ids]
        rows = [
            SamplingRow(r.sampling, r.prompt_token_ids, r.output_token_ids, self.eos_token_id, r.generator)
            if r is not None
            else _PLACEHOLDER
            for r in reqs
        ]
        mask = self.grammars.step_mask([r.grammar if r is not None else None for r in reqs])
        out = sample(logits, rows, token_mask=mask, staging=self.sampler_staging).to_host(self.reader)
        tokens = []
        for i, req in enumerate(reqs):
            if req is None:
                continue
            top = out.top[i]
            tok = TokenOut(
                out.token_ids[i],
                out.logprobs[i] if req.sampling.logprobs is not None else None,
                [TokenLogprob(t, lp) for t, lp in top] if top else None,
            )
            req.output_token_ids.append(tok.token_id)
            if req.grammar is not None:
                req.grammar.advance(tok.token_id)
            tokens.append(tok)
        return tokens

    def _check_fault(self, plan: StepPlan) -> None:
        budget = self.oom_above_bytes
        if budget is not None and plan.num_tokens * self.activation_bytes_per_token > budget:
            raise torch.OutOfMemoryError(
                f"injected for testing: {plan.num_tokens} tokens x {self.activation_bytes_per_token} "
                f"activation bytes > budget {budget} bytes"
            )

    def _wants_prompt_logprobs(self, row: ScheduledRow) -> bool:
        req = self.requests[row.request_id]
        return req.sampling.prompt_logprobs is not None and row.start_position < len(req.prompt_token_ids) - 1

    def _replays(self, plan: StepPlan, wants: list[int]) -> bool:
        """A pure decode step (every row one token, no prompt logprobs) that a decode bucket holds runs on
        the static buffers (worker/graphs.py): a CUDA graph's replay on CUDA."""
        return (
            self.graphs is not None
            and not wants
            and len(plan.rows) <= self.graphs.max_rows
            and all(len(r.token_ids) == 1 for r in plan.rows)
        )

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one step: the sampled token of every row that asked for one, and the prompt logprobs of
        the rows whose request asked for them."""
        self._admit(plan.new_requests)  # first: a failed step must not lose what the plan announced
        self.drop(plan.dropped)
        self._forget(plan.finished)
        if not plan.rows:
            return EMPTY_OUTPUT
        self._check_fault(plan)
        states = [self._sequence(r) for r in plan.rows]
        wants = [i for i, r in enumerate(plan.rows) if self._wants_prompt_logprobs(r)]
        if self._replays(plan, wants):
            assert self.graphs is not None
            entries = [(r.token_ids[0], st.num_tokens, st.slot, st.pages) for r, st in zip(plan.rows, states)]
            out = ForwardOutput([], last_logits=self.graphs.run(entries))
        else:
            layout = build_layout(
                [r.token_ids for r in plan.rows],
                [st.num_tokens for st in states],
                [st.slot for st in states],
                [st.pages for st in states],
                self.device,
                staging=self.staging,
            )
            out = self.model.run(layout, self.pool, self.numerics, all_logits=bool(wants))
        for st, r in zip(states, plan.rows):
            st.num_tokens += len(r.token_ids)
        prompt_lps = {plan.rows[i].request_id: self._prompt_logprobs(plan.rows[i], out.logits[i]) for i in wants}
        for r in plan.rows:
            if r.snapshot_slot is not None:
                self.pool.copy_slot(r.slot, r.snapshot_slot)
        picks = [i for i, r in enumerate(plan.rows) if r.sample]
        if not picks:
            return StepOutput({}, prompt_lps)
        logits = self._last_logits(out, len(plan.rows))  # [rows, vocab] fp32
        ids = [r.request_id if r.sample else None for r in plan.rows]
        return StepOutput(dict(zip([plan.rows[i].request_id for i in picks], self._sample(logits, ids))), prompt_lps)

    @staticmethod
    def _last_logits(out: ForwardOutput, n_rows: int) -> torch.Tensor:
        """Every row's last-position logits [n_rows, vocab] fp32, without a copy when the forward gave them
        (the common step); the rows that do not sample get a placeholder row in the sampler rather than a
        gather (whose index would be one more host-to-device copy)."""
        if out.last_logits is None:  # all positions were asked for (prompt logprobs)
            return torch.stack([out.logits[i][-1] for i in range(n_rows)]).float()
        return out.last_logits.float()

    def _prompt_logprobs(self, row: ScheduledRow, logits: torch.Tensor) -> PromptLogprobs:
        """logits [T, vocab] of the row's positions -> (prompt position, logprob of that prompt token)."""
        req = self.requests[row.request_id]
        prompt = req.prompt_token_ids
        n = min(len(row.token_ids), len(prompt) - 1 - row.start_position)  # positions with a next prompt token
        logp = torch.log_softmax(logits[:n].float(), dim=-1)  # [n, vocab]
        targets = prompt[row.start_position + 1 : row.start_position + 1 + n]
        # the targets travel without blocking the host; everything comes back in one read
        index = torch.tensor(targets, dtype=torch.long).to(logp.device, non_blocking=True)
        chosen = logp.gather(1, index[:, None])  # [n, 1]
        k = req.sampling.prompt_logprobs or 0
        parts = [chosen.double()]
        if k:
            top_v, top_i = logp.topk(k, dim=-1)  # [n, k] each, best first
            parts += [top_v.double(), top_i.double()]  # token ids are exact in fp64
        values = self.reader.read(torch.cat(parts, dim=1).flatten())  # [n * (1 + 2k)]
        out = []
        for j in range(n):
            row_values = values[j * (1 + 2 * k) : (j + 1) * (1 + 2 * k)]
            top = [TokenLogprob(int(t), v) for v, t in zip(row_values[1 : 1 + k], row_values[1 + k :])] if k else None
            out.append((row.start_position + 1 + j, TokenOut(int(targets[j]), row_values[0], top)))
        return out
