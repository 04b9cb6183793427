"""Speculative decoding with the checkpoint's MTP block (issue 19, `--speculative-tokens N`): the runner's
drafting and acceptance glue.

After a step's forward, every row of a speculating request runs the MTP block over the positions the step
kept (the block's own KV then covers the whole sequence: its attention needs it) with the tokens that follow
them; the last position's draft logits give draft d_1, and for N > 1 the block runs again on its own output
streams and d_1 (d_2), and so on. The chain's positions are speculative: their MTP state is rolled back
(model/rollback.py) once the drafts are read, so the next step's catch-up starts from the kept positions.
Each draft (greedy argmax, or the draw from q) feeds the next application on the device, and the drafts come
back to the host in one read after the chain, on a chain bucket's static buffers where there is one
(worker/spec_graphs.py: a CUDA graph per batch bucket); only rows whose processing looks at their output so far
(penalties, min_tokens, forced tokens) read each draft back before the next, so that it sees them.

The next step runs the request as one row [last token, d_1 .. d_n]; position k's logits are sampled as if
d_1 .. d_k had been produced (penalties and forced tokens see them), and drafts are accepted while each
equals the token sampled before it; the first mismatch, or the last position, gives the bonus token. The
rejected positions' state is rolled back, so the output is the one without speculation, token for token.

Sampled (temperature > 0) requests draft from the MTP block's processed distribution q and are verified by
speculative rejection sampling (worker/spec_sampling.py: the output distribution is the target's alone).

Who speculates: requests without structured output (the grammar's state cannot step back over a rejected
draft), and of the sampled ones those that ask for no logprobs (the rejection sampler does not give them).
The MTP state is a drafting aid only: a wrong or stale draft costs acceptance, never correctness.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.model import rollback
from dsv4serve.model.batch import HostStaging, build_layout
from dsv4serve.model.kv_pool import KvPool, SequenceState
from dsv4serve.model.numerics import Numerics
from dsv4serve.model.transformer import Transformer
from dsv4serve.worker.sampler_inputs import HostReader, SamplingRow, pack_inputs
from dsv4serve.worker.spec_graphs import SpecGraphs
from dsv4serve.worker.spec_sampling import SpecOutput, draft_tokens, history_dependent, verify


def speculates(params: SamplingParams) -> bool:
    """Whether a request's tokens can be verified against drafts exactly (module doc)."""
    return params.structured is None and (params.is_greedy or params.logprobs is None)


def accepted_drafts(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """Greedy verification: how many leading drafts equal the token sampled at the position before them
    (sampled [n + 1]: the token chosen after the last kept token, after d_1, .., after d_n)."""
    j = 0
    while j < len(drafts) and drafts[j] == sampled[j]:
        j += 1
    return j


@dataclass(frozen=True)
class DraftRow:
    """One row of a speculating request, after the step kept `kept` of its tokens."""

    request_id: str | None  # None: the row does not sample (a prefill chunk): its drafts are not needed
    state: SequenceState  # mtp_num_tokens is the row's first position
    hidden: torch.Tensor  # [kept, hc, D] the main model's streams of the kept positions
    next_tokens: tuple[int, ...]  # [kept] the token after each kept position
    sampling: SamplingRow | None = None  # the request's sampler row, its output so far (rows that sample)


@dataclass
class Drafts:
    tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)  # request id -> d_1 .. d_N
    probs: dict[str, torch.Tensor] = field(default_factory=dict)  # sampled rows: [N, V] fp32 q_1 .. q_N


class Drafter:
    """Runs the MTP block for the runner: catch-up over the kept positions, then the draft chain."""

    def __init__(
        self,
        model: Transformer,
        pool: KvPool,
        numerics: Numerics,
        num_tokens: int,
        graphs: SpecGraphs | None = None,
        reader: HostReader | None = None,
    ):
        if not len(model.mtp):
            raise ValueError("speculative decoding needs the MTP block loaded")
        self.model, self.pool, self.numerics, self.num_tokens = model, pool, numerics, num_tokens
        self.graphs = graphs  # the chain's MTP application on static buffers (worker/spec_graphs.py), or None
        self.reader = reader or HostReader(model.embed.weight.device)  # the drafts' one read back
        self.staging = HostStaging(model.embed.weight.device)  # the chain's sampler parameters, one copy
        layer = model.args.n_layers  # MTP block 0's KV layer
        self.mtp_layers = range(layer, layer + 1)
        self.paged = bool(model.args.compress_ratios[layer])  # its writes need pages (a compressor)
        self.host_chains = 0  # chains that read each draft back before the next (history-dependent rows)

    def draft(self, rows: Sequence[DraftRow], device: torch.device) -> Drafts:
        """Advance every row's MTP state over its kept positions; the drafts of the rows that sample."""
        if not rows:
            return Drafts()
        states = [r.state for r in rows]
        layout = build_layout(
            [r.next_tokens for r in rows],
            [st.mtp_num_tokens for st in states],
            [st.slot for st in states],
            [st.pages for st in states],
            device,
        )
        out = self.model.run_mtp(layout, self.pool, torch.cat([r.hidden for r in rows]), self.numerics)
        for st, r in zip(states, rows):
            st.mtp_num_tokens += len(r.next_tokens)
        picked = [(i, r.request_id, r.sampling) for i, r in enumerate(rows) if r.request_id and r.sampling]
        if not picked:
            return Drafts()
        assert out.last_logits is not None and out.hidden is not None
        picks = [i for i, _, _ in picked]
        sampling = [row for _, _, row in picked if row is not None]
        logits = out.last_logits
        if len(picks) < len(rows):  # (an index from the host travels without blocking it)
            logits = logits.index_select(0, torch.tensor(picks).to(logits.device, non_blocking=True))
        streams = torch.stack([out.hidden[i][-1] for i in picks])  # [P, hc, D] the block's last output
        chosen = [states[i] for i in picks]
        if any(history_dependent(row) for row in sampling):
            self.host_chains += 1
            ids, probs = self._host_chain(chosen, sampling, draft_tokens(logits, sampling), streams, device)
        else:
            ids, probs = self._chain(chosen, sampling, logits, streams, device)
        drafts = Drafts()
        for n, (_, rid, row) in enumerate(picked):
            assert rid is not None and row is not None
            drafts.tokens[rid] = tuple(ids[n])
            if not row.params.is_greedy:
                drafts.probs[rid] = probs[n]
        return drafts

    def _chain_steps(self, states: list[SequenceState]) -> int:
        steps = self.num_tokens - 1
        if self.paged:  # a compressing MTP layer writes entries: only where the request holds pages
            page = self.pool.page_tokens
            steps = min([steps] + [len(st.pages) * page - st.mtp_num_tokens for st in states])
        return steps

    def _chain(
        self,
        states: list[SequenceState],
        sampling: list[SamplingRow],
        logits: torch.Tensor,
        streams: torch.Tensor,
        device: torch.device,
    ) -> tuple[list[list[int]], torch.Tensor]:
        """d_1 .. d_N with no host read between them: the rows' processing does not look at their history, so
        their sampler parameters are packed once and every draft (argmax, or the draw from q) feeds the next
        application on the device; d_2 .. d_N come from the block applied recurrently on its own output streams
        at speculative positions (their MTP state rolled back afterwards), on a chain bucket's static buffers
        when there is one. The drafts come back in one read. Returns the drafts [P][n] and their q [P, n, V]."""
        inputs = pack_inputs(sampling, logits.shape[1], logits.device, staging=self.staging)
        tokens, q = draft_tokens(logits, sampling, inputs=inputs)
        ids, probs = [tokens], [q]
        steps = self._chain_steps(states)
        if steps > 0:
            saved = rollback.save(
                self.pool, self.mtp_layers, [rollback.SpecRow(st.slot, st.mtp_num_tokens, steps) for st in states]
            )
            apply = self._applier(states, device)
            for _ in range(steps):
                logits, streams = apply(tokens, streams)
                tokens, q = draft_tokens(logits, sampling, inputs=inputs)
                ids.append(tokens)
                probs.append(q)
            rollback.restore(saved, [0] * len(states))
        n = len(ids)
        flat = self.reader.read(torch.stack(ids, dim=1).flatten())  # [P * n]: the chain's one read
        return [flat[i * n : (i + 1) * n] for i in range(len(states))], torch.stack(probs, dim=1)

    def _applier(self, states: list[SequenceState], device: torch.device):
        """(tokens [P] int64, streams [P, hc, D]) -> (draft logits [P, V], output streams [P, hc, D]) per call,
        at the next position each time: a chain bucket's static buffers, else a layout per application whose
        token ids are the device tokens (its positions come from the host, which knows them)."""
        entries = [(st.mtp_num_tokens, st.slot, st.pages) for st in states]
        if self.graphs is not None and self.graphs.chain_bucket(len(states)) is not None:
            return self.graphs.chain_start(entries).apply
        applied = [0]

        def apply(tokens: torch.Tensor, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k = applied[0]
            applied[0] += 1
            layout = build_layout([[0]] * len(states), [p + k for p, _, _ in entries], [e[1] for e in entries],
                                  [e[2] for e in entries], device)  # fmt: skip
            layout = dataclasses.replace(layout, token_ids=tokens)
            out = self.model.run_mtp(layout, self.pool, streams, self.numerics)
            assert out.last_logits is not None and out.hidden is not None
            return out.last_logits, torch.cat(out.hidden)  # [P, hc, D] one token a row

        return apply

    def _host_chain(
        self,
        states: list[SequenceState],
        sampling: list[SamplingRow],
        first: tuple[torch.Tensor, torch.Tensor],
        streams: torch.Tensor,
        device: torch.device,
    ) -> tuple[list[list[int]], torch.Tensor]:
        """The chain for rows whose processing looks at their output so far (penalties, min_tokens, forced
        tokens): each draft is read back so that the next one's processing sees it, as a decode step would."""
        tokens, q = first
        drafts, probs = [[t] for t in tokens.tolist()], [q]
        steps = self._chain_steps(states)
        if steps <= 0:
            return drafts, torch.stack(probs, dim=1)
        saved = rollback.save(
            self.pool, self.mtp_layers, [rollback.SpecRow(st.slot, st.mtp_num_tokens, steps) for st in states]
        )
        for k in range(steps):
            layout = build_layout(
                [[d[-1]] for d in drafts],
                [st.mtp_num_tokens + k for st in states],
                [st.slot for st in states],
                [st.pages for st in states],
                device,
            )
            out = self.model.run_mtp(layout, self.pool, streams, self.numerics)
            assert out.last_logits is not None and out.hidden is not None
            history = [
                dataclasses.replace(r, output_token_ids=[*r.output_token_ids, *d]) for r, d in zip(sampling, drafts)
            ]
            tokens, q = draft_tokens(out.last_logits, history)
            probs.append(q)
            streams = torch.cat(out.hidden)  # [P, hc, D] one token a row
            for d, t in zip(drafts, tokens.tolist()):
                d.append(t)
        rollback.restore(saved, [0] * len(states))
        return drafts, torch.stack(probs, dim=1)


def verify_sampled(
    logits: torch.Tensor,
    drafts: Sequence[tuple[int, ...]],
    probs: Sequence[torch.Tensor],
    rows: Sequence[SamplingRow],
    reader: HostReader,
    staging: HostStaging | None = None,
) -> list[list[int]]:
    """Speculative rejection sampling (worker/spec_sampling.verify) for sampled verify rows with n drafts each:
    logits [R, n + 1, V] the target at the last token and the drafts, probs [n, V] per row (the q the drafts were
    drawn from) -> per row the tokens produced: the accepted drafts, then the replacement or bonus token."""
    n = len(drafts[0])
    assert all(len(d) == n for d in drafts)
    draft_ids = torch.tensor([list(d) for d in drafts], dtype=torch.long).to(logits.device, non_blocking=True)
    q = torch.stack([p[:n] for p in probs])  # [R, n, V]
    out = verify(logits, q, draft_ids, rows, drafts, staging=staging)
    return SpecOutput.tokens_from_host(reader.read(out.packed()), len(rows))
