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
from dsv4serve.model import rollback
from dsv4serve.model.batch import HostStaging, build_layout
from dsv4serve.model.kv_pool import KvPool, SequenceState
from dsv4serve.model.numerics import Numerics
from dsv4serve.model.transformer import ForwardOutput, Transformer
from dsv4serve.parallel.step_link import StepLink
from dsv4serve.worker.grammar import GrammarBook, RequestGrammar
from dsv4serve.worker.graphs import DecodeGraphs
from dsv4serve.worker.sampler_inputs import HostReader
from dsv4serve.worker.sampling import SamplingRow, make_generator, sample
from dsv4serve.worker.speculative import Drafter, DraftRow, accepted_drafts, speculates, verify_sampled
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
    speculative: bool = False  # drafts with the MTP block and verifies them (worker/speculative.py)


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
        drafter: Drafter | None = None,
        link: StepLink | None = None,
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
        # speculative decoding (--speculative-tokens N > 0): the MTP drafter; its static buffers (worker/spec_graphs.py)
        # run the verify steps whose rows all carry n drafts, the other steps that draft run eager
        self.drafter = drafter
        self.spec_graphs = drafter.graphs if drafter is not None else None
        self.eager_drafting_steps = 0  # steps of speculating requests that ran eager (mixed rows, prefill, no bucket)
        self.draft_probs: dict[str, torch.Tensor] = {}  # sampled requests' q [N, V] of their pending drafts
        # structured output: compiled grammars (built on first use; the bundled tokenizer unless given)
        self.grammars = grammars or GrammarBook("", model.args.vocab_size, eos_token_id)
        # tensor parallel (parallel/step_link.py): every rank runs the plan's forward; rank 0 alone samples and
        # hands the tokens to the others, which take them instead of sampling. None: one rank
        self.link = link
        self.samples = link is None or link.root
        self.fault_injected = False  # the last step failed on the testing fault, before any forward

    def drop(self, request_ids: tuple[str, ...] | list[str]) -> None:
        """Forget the sequences of these requests (preempted, finished or aborted); the scheduler
        took their slots and pages back."""
        for rid in request_ids:
            self.states.pop(rid, None)
            self.draft_probs.pop(rid, None)

    def _admit(self, new: tuple[NewRequest, ...]) -> None:
        for n in new:
            gen = make_generator(n.sampling.seed, self.device) if n.sampling.seed is not None else None
            grammar = self.grammars.start(n.sampling, n.request_id)
            spec = self.drafter is not None and speculates(n.sampling)
            self.requests[n.request_id] = RunnerRequest(
                n.prompt_token_ids, n.sampling, generator=gen, grammar=grammar, speculative=spec
            )

    def _forget(self, request_ids: tuple[str, ...]) -> None:
        """The requests are over: free everything the runner kept for them."""
        for rid in request_ids:
            self.states.pop(rid, None)
            self.requests.pop(rid, None)
            self.draft_probs.pop(rid, None)

    def _sequence(self, r: ScheduledRow) -> SequenceState:
        """The row's sequence: a new one (from a copy of a prefix snapshot when the plan says so), with
        the pages the scheduler added since the last row."""
        state = self.states.get(r.request_id)
        if state is None:
            state = self.states[r.request_id] = SequenceState(self.pool, r.slot)
            if r.restore_slot is not None:
                self.pool.copy_slot(r.restore_slot, r.slot)
                state.num_tokens = state.mtp_num_tokens = r.start_position
        if state.slot != r.slot or state.num_tokens != r.start_position:
            raise RuntimeError(
                f"{r.request_id}: sequence at slot {state.slot} position {state.num_tokens}, "
                f"plan at slot {r.slot} position {r.start_position}"
            )
        if r.num_pages is not None:  # rejected drafts' pages went back to the scheduler
            del state.pages[r.num_pages :]
        state.pages.extend(r.new_pages)
        return state

    def _sample(self, logits: torch.Tensor, entries: list[tuple[str | None, tuple[int, ...]]]) -> list[TokenOut | None]:
        """logits [M, V] fp32 -> the token of each entry (request id, the drafts before this position) with a
        request id (None: a row that does not sample, given a greedy placeholder so that the logits need no
        gather). A verify row's position k samples as if its first k drafts had been produced. The rows'
        parameters go to the device in one copy from pinned memory; the results come back in one copy."""
        reqs = [self.requests[rid] if rid is not None else None for rid, _ in entries]
        if all(r is None for r in reqs):  # (every sampling row is verified by rejection sampling)
            return [None] * len(reqs)
        rows = [
            SamplingRow(r.sampling, r.prompt_token_ids, r.output_token_ids + list(d), self.eos_token_id, r.generator)
            if r is not None
            else _PLACEHOLDER
            for r, (_, d) in zip(reqs, entries)
        ]
        mask = self.grammars.step_mask([r.grammar if r is not None else None for r in reqs])
        out = sample(logits, rows, token_mask=mask, staging=self.sampler_staging).to_host(self.reader)
        tokens: list[TokenOut | None] = []
        for i, req in enumerate(reqs):
            top = out.top[i]
            tokens.append(
                None
                if req is None
                else TokenOut(
                    out.token_ids[i],
                    out.logprobs[i] if req.sampling.logprobs is not None else None,
                    [TokenLogprob(t, lp) for t, lp in top] if top else None,
                )
            )
        return tokens

    def _commit(self, request_id: str, tokens: tuple[TokenOut, ...]) -> None:
        req = self.requests[request_id]
        for tok in tokens:
            req.output_token_ids.append(tok.token_id)
            if req.grammar is not None:
                req.grammar.advance(tok.token_id)

    def _step_tokens(self, plan: StepPlan, out: ForwardOutput) -> dict[str, tuple[TokenOut, ...]]:
        """The step's tokens: sampled here (one rank, or rank 0), or rank 0's, taken from the link."""
        if self.link is None:
            return self._sample_step(plan, out)
        if not any(r.sample for r in plan.rows):  # every rank knows from the plan: nothing is shared
            return {}
        if self.samples:
            return self.link.share_tokens(self._sample_step(plan, out))
        tokens = self.link.share_tokens()
        for rid, toks in tokens.items():
            self._commit(rid, toks)
        return tokens

    def _sample_step(self, plan: StepPlan, out: ForwardOutput) -> dict[str, tuple[TokenOut, ...]]:
        """Every sampling row's tokens: one, or for a verify row the accepted drafts' tokens and the bonus (greedy:
        accepted while equal to the sampled token; sampled rows: speculative rejection sampling)."""
        if not any(r.sample for r in plan.rows):
            return {}
        logits = self._row_logits(out, plan)  # [M, V]
        randoms = [r.num_draft_tokens > 0 and not self.requests[r.request_id].sampling.is_greedy for r in plan.rows]
        entries: list[tuple[str | None, tuple[int, ...]]] = []
        for r, rejection in zip(plan.rows, randoms):
            drafts = r.token_ids[len(r.token_ids) - r.num_draft_tokens :]
            rid = r.request_id if r.sample and not rejection else None
            entries += [(rid, drafts[:k]) for k in range(len(drafts) + 1)]
        sampled = self._sample(logits, entries)
        verified = self._verify_sampled(plan, logits, randoms)
        result, at = {}, 0
        for r in plan.rows:
            row = sampled[at : at + r.num_draft_tokens + 1]
            at += len(row)
            if r.request_id in verified:
                chosen = verified[r.request_id]
            elif r.sample:
                drafts = r.token_ids[len(r.token_ids) - r.num_draft_tokens :]
                chosen = tuple(t for t in row if t is not None)
                chosen = chosen[: accepted_drafts(drafts, [t.token_id for t in chosen]) + 1]
            else:
                continue
            self._commit(r.request_id, chosen)
            result[r.request_id] = chosen
        return result

    def _verify_sampled(
        self, plan: StepPlan, logits: torch.Tensor, randoms: list[bool]
    ) -> dict[str, tuple[TokenOut, ...]]:
        """The sampled (temperature > 0) verify rows, by rejection sampling against the drafts' q; rows with the
        same number of drafts go together (worker/speculative.verify_sampled)."""
        offsets, at = [], 0
        for r in plan.rows:
            offsets.append(at)
            at += r.num_draft_tokens + 1
        groups: dict[int, list[int]] = {}
        for i, (r, rejection) in enumerate(zip(plan.rows, randoms)):
            if rejection:
                groups.setdefault(r.num_draft_tokens, []).append(i)
        result = {}
        for n, rows in groups.items():
            reqs = [self.requests[plan.rows[i].request_id] for i in rows]
            tokens = verify_sampled(
                torch.stack([logits[offsets[i] : offsets[i] + n + 1] for i in rows]),
                [plan.rows[i].token_ids[-n:] for i in rows],
                [self.draft_probs[plan.rows[i].request_id] for i in rows],
                [self._sampling_row(req) for req in reqs],
                self.reader,
                self.sampler_staging,
            )
            for i, toks in zip(rows, tokens):
                result[plan.rows[i].request_id] = tuple(TokenOut(t) for t in toks)
        return result

    def _sampling_row(self, req: RunnerRequest) -> SamplingRow:
        return SamplingRow(
            req.sampling, req.prompt_token_ids, list(req.output_token_ids), self.eos_token_id, req.generator
        )

    def _check_fault(self, plan: StepPlan) -> None:
        budget = self.oom_above_bytes
        self.fault_injected = budget is not None and plan.num_tokens * self.activation_bytes_per_token > budget
        if self.fault_injected:
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
        """Run one step: the sampled token(s) of every row that asked, the prompt logprobs of the rows whose
        request asked for them, and (speculative decoding) the next drafts."""
        self._admit(plan.new_requests)  # first: a failed step must not lose what the plan announced
        if self.model.tp is not None:
            self.model.tp.reset()  # a split model counts its collectives: the last step's are kept
        self.drop(plan.dropped)
        self._forget(plan.finished)
        if not plan.rows:
            return EMPTY_OUTPUT
        self._check_fault(plan)
        states = [self._sequence(r) for r in plan.rows]
        starts = [st.num_tokens for st in states]
        wants = [i for i, r in enumerate(plan.rows) if self._wants_prompt_logprobs(r)]
        drafting = self.drafter is not None and any(self.requests[r.request_id].speculative for r in plan.rows)
        saved = None
        if self._replays(plan, wants) and not drafting:
            assert self.graphs is not None
            entries = [(r.token_ids[0], st.num_tokens, st.slot, st.pages) for r, st in zip(plan.rows, states)]
            out = ForwardOutput([], last_logits=self.graphs.run(entries))
        elif drafting and self._verify_replays(plan, wants):
            out, saved = self._verify_static(plan, states)
        else:
            self.eager_drafting_steps += drafting
            out, saved = self._forward(plan, states, wants, drafting)
        for st, r in zip(states, plan.rows):
            st.num_tokens += len(r.token_ids)
        prompt_lps = (
            {plan.rows[i].request_id: self._prompt_logprobs(plan.rows[i], out.logits[i]) for i in wants}
            if self.samples
            else {}
        )
        tokens = self._step_tokens(plan, out)
        # positions kept: a verify row keeps its first token and the accepted drafts (one fewer than its tokens)
        kept = [len(tokens[r.request_id]) if r.num_draft_tokens else len(r.token_ids) for r in plan.rows]
        if saved is not None:  # the rejected drafts' state, as if never written (model/rollback.py)
            rollback.restore(saved, [k for k, r in zip(kept, plan.rows) if r.num_draft_tokens])
        for st, start, k in zip(states, starts, kept):
            st.num_tokens = start + k
        drafts = self._draft(plan, states, out, kept, tokens) if drafting else {}
        for r in plan.rows:  # after the MTP block's catch-up: a snapshot holds its state too
            if r.snapshot_slot is not None:
                self.pool.copy_slot(r.slot, r.snapshot_slot)
        first = {rid: t[0] for rid, t in tokens.items()}
        more = {rid: t[1:] for rid, t in tokens.items() if len(t) > 1}
        return StepOutput(first, prompt_lps, more, drafts)

    def _verify_replays(self, plan: StepPlan, wants: list[int]) -> bool:
        """A verify step whose rows all carry the same n > 0 drafts (no prompt logprobs) that a verify bucket
        holds runs on its static buffers (worker/spec_graphs.py); steps with rows of other lengths run eager."""
        n = plan.rows[0].num_draft_tokens
        return (
            self.spec_graphs is not None
            and not wants
            and n > 0
            and all(r.num_draft_tokens == n and len(r.token_ids) == n + 1 for r in plan.rows)
            and self.spec_graphs.verify_bucket(len(plan.rows), n) is not None
        )

    def _verify_static(self, plan: StepPlan, states: list[SequenceState]) -> tuple[ForwardOutput, rollback.SpecSave]:
        """The verify step on static buffers: what the drafts will overwrite is saved first, for the real rows
        only (padding rows write the padding slot and page alone: nothing to save or restore)."""
        assert self.spec_graphs is not None
        rows = [rollback.SpecRow(st.slot, st.num_tokens, len(r.token_ids)) for r, st in zip(plan.rows, states)]
        saved = rollback.save(self.pool, range(self.model.args.n_layers), rows)
        entries = [(r.token_ids, st.num_tokens, st.slot, st.pages) for r, st in zip(plan.rows, states)]
        logits, hidden = self.spec_graphs.run_verify(entries)
        return ForwardOutput([], hidden, logits), saved

    def _forward(
        self, plan: StepPlan, states: list[SequenceState], wants: list[int], drafting: bool
    ) -> tuple[ForwardOutput, rollback.SpecSave | None]:
        """The eager forward; for verify rows, what their drafts will overwrite is saved first and the logits
        of every row's last 1 + num_draft_tokens positions are computed (`picks`)."""
        layout = build_layout(
            [r.token_ids for r in plan.rows],
            [st.num_tokens for st in states],
            [st.slot for st in states],
            [st.pages for st in states],
            self.device,
            staging=self.staging,
        )
        verify = [(r, st) for r, st in zip(plan.rows, states) if r.num_draft_tokens]
        saved, picks = None, None
        if verify:
            rows = [rollback.SpecRow(st.slot, st.num_tokens, len(r.token_ids)) for r, st in verify]
            saved = rollback.save(self.pool, range(self.model.args.n_layers), rows)
            if not wants:
                at = [j for r, s in zip(plan.rows, layout.spans) for j in range(s.end - 1 - r.num_draft_tokens, s.end)]
                picks = torch.tensor(at, dtype=torch.long).to(self.device, non_blocking=True)
        out = self.model.run(layout, self.pool, self.numerics, bool(wants), drafting, picks)
        return out, saved

    def _row_logits(self, out: ForwardOutput, plan: StepPlan) -> torch.Tensor:
        """[M, vocab] fp32: each row's last 1 + num_draft_tokens positions, rows in order."""
        if out.last_logits is not None:  # the common step, or the verify picks
            return out.last_logits.float()
        # all positions were asked for (prompt logprobs)
        return torch.cat([out.logits[i][-1 - r.num_draft_tokens :] for i, r in enumerate(plan.rows)]).float()

    def _draft(
        self,
        plan: StepPlan,
        states: list[SequenceState],
        out: ForwardOutput,
        kept: list[int],
        tokens: dict[str, tuple[TokenOut, ...]],
    ) -> dict[str, tuple[int, ...]]:
        """The MTP block over the kept positions of every speculating request's row; drafts for those that
        sampled (worker/speculative.py)."""
        assert self.drafter is not None and out.hidden is not None
        rows = []
        for i, (r, st, k) in enumerate(zip(plan.rows, states, kept)):
            req = self.requests[r.request_id]
            if not req.speculative or st.mtp_num_tokens != st.num_tokens - k:
                continue  # (a state restored where the MTP block had not run: no drafts for it)
            if r.sample:
                following = tokens[r.request_id][-1].token_id
            else:  # a prompt chunk (or a recomputed output): the token after the chunk
                following = (list(req.prompt_token_ids) + req.output_token_ids)[st.num_tokens]
            rid = r.request_id if r.sample else None
            sampling = self._sampling_row(req) if r.sample else None
            rows.append(DraftRow(rid, st, out.hidden[i][:k], tuple(r.token_ids[1:k]) + (following,), sampling))
        drafts = self.drafter.draft(rows, self.device)
        self.draft_probs.update(drafts.probs)
        return drafts.tokens

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
