"""Speculative sampling: drafting from the MTP block's distribution and verifying the drafts against the
target's, so that the output distribution is the target's alone (Leviathan et al. 2023, Chen et al. 2023).

    d_i, q_i = draft_tokens(mtp_logits_i, rows)          # the drafter, per draft: [R] int64, [R, V] fp32
    out = verify(verify_logits, q, d, rows, drafts_host)  # [R, N + 1, V] logits, [R, N, V], [R, N] -> SpecOutput
    per_row = SpecOutput.tokens_from_host(reader.read(out.packed()), R)  # count + 1 tokens per row

The rule, per row: draft token d_i (drawn from q_i) is accepted with probability min(1, p_{i-1}(d_i) / q_i(d_i)),
in order; at the first rejection, at position k, the row's last token is drawn from norm(max(0, p_k - q_k)); when
all N are accepted, a bonus token is drawn from p_N. Summed over the accept / reject branches the first token's
distribution is exactly p_0, and by induction every later token's is the target's given the tokens before it.
Greedy rows (temperature 0) take no randomness: d_i is accepted while it equals argmax p_{i-1}, and the last
token is the target's argmax at the first mismatch (or at N): token for token what N = 0 decodes.

p_j is the distribution `sampling.sample` would draw position j from: the same stages (penalties, stop masks,
bias, allowed tokens, grammar, forced tokens, then temperature, top-k, top-p, min-p) on the same tensors, so a
verified position sees exactly what a decode step at that position would. Stages that look at the output so far
(penalties, min_tokens, forced tokens) need each position's history: position j of a row has the row's output
plus d_1..d_j (`position_rows` builds those rows from the drafts on the host, which the step's one read already
brought back with the sampled tokens). A greedy row's p is one-hot at the argmax of its processed logits, the
tensor `sample` takes its argmax of, so ties resolve as in a decode step.

The drafter's q may be any distribution as long as each d_i is drawn from exactly the q_i handed to `verify`:
the output stays the target's; a q close to p only raises the acceptance. `draft_tokens` processes the MTP
logits with the request's own stages (history as of the step's start is fine: the rule needs no more).

Randomness: a row takes N uniforms (acceptance) and one [V] exponential noise vector (the last token, drawn as
argmax(r / E), the exponential race `sampling.draw` uses) per verify step, whatever it accepts, so a seeded row's
generator advances by the same amount every step and its tokens do not depend on the other rows. Nothing here
reads a device value: the results come back in the caller's one read (`SpecOutput.packed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsv4serve.model.batch import HostStaging
from dsv4serve.worker.sampler_inputs import SamplerInputs, SamplingRow, TokenMask, pack_inputs
from dsv4serve.worker.sampling import _truncate, apply_inputs

__all__ = ["SpecDecodeStats", "SpecOutput", "SpecRandomness", "draft_tokens", "draw_randomness", "history_dependent"]
__all__ += ["position_rows", "processed_probs", "rejection_sample", "verify"]


@dataclass(frozen=True)
class SpecRandomness:
    uniform: torch.Tensor  # [R, N] fp32 in [0, 1): acceptance tests
    noise: torch.Tensor  # [R, V] fp32 > 0, Exp(1): the last token's exponential race


@dataclass(frozen=True)
class SpecOutput:
    num_accepted: torch.Tensor  # [R] int64, accepted drafts per row (0..N)
    token_ids: torch.Tensor  # [R, N + 1] int64: the accepted drafts, then the row's last token; -1 after it

    def packed(self) -> torch.Tensor:
        """[R * (N + 2)] int64: per row its count then its N + 1 tokens; one tensor for the step's one read."""
        return torch.cat([self.num_accepted[:, None], self.token_ids], dim=1).flatten()

    @staticmethod
    def tokens_from_host(values: Sequence[int], num_rows: int) -> list[list[int]]:
        """`packed()` read back to the host -> per row the tokens it produced this step (count + 1 of them)."""
        width = len(values) // num_rows
        rows = [values[r * width : (r + 1) * width] for r in range(num_rows)]
        return [[int(t) for t in row[1 : int(row[0]) + 2]] for row in rows]


def history_dependent(row: SamplingRow) -> bool:
    """Whether the row's processing looks at its output so far (so each verified position needs its own)."""
    p = row.params
    return p.has_penalties or p.min_tokens > 0 or bool(p.forced_tokens)


def position_rows(rows: Sequence[SamplingRow], draft_token_ids: Sequence[Sequence[int]] | None, num_drafts: int):
    """The sampler rows of a verify step, row-major [R * (N + 1)]: position j of row r sees row r's output
    followed by its first j drafts. `draft_token_ids` (on the host, [R][N]) may be None only when no row's
    processing depends on its history (`history_dependent`)."""
    out: list[SamplingRow] = []
    for r, row in enumerate(rows):
        if draft_token_ids is None:
            if history_dependent(row):
                raise ValueError("a row with penalties, min_tokens or forced tokens needs its drafts on the host")
            out += [row] * (num_drafts + 1)
            continue
        drafts = list(draft_token_ids[r])
        if len(drafts) != num_drafts:
            raise ValueError(f"row {r} has {len(drafts)} drafts, the step verifies {num_drafts}")
        history = list(row.output_token_ids)
        out += [
            SamplingRow(row.params, row.prompt_token_ids, history + drafts[:j], row.eos_token_id, row.generator)
            for j in range(num_drafts + 1)
        ]
    return out


@torch.no_grad()
def processed_probs(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    token_mask: TokenMask | None = None,
    staging: HostStaging | None = None,
) -> torch.Tensor:
    """logits [M, V] -> the distribution `sampling.sample` draws each row from, [M, V] fp32: greedy rows
    one-hot at the argmax of their processed logits, the others softmax after temperature and truncation."""
    return _processed(logits, rows, token_mask, staging)[0]


def _processed(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    token_mask: TokenMask | None,
    staging: HostStaging | None,
    inputs: SamplerInputs | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(probs [M, V] fp32, greedy [M] bool or None when no row is greedy); the greedy flags come from the
    sampler parameters' one copy, not a copy of their own. `inputs`: the rows' parameters already packed."""
    work = logits.float().clone()  # [M, V] fp32, modified in place stage by stage
    if inputs is None:
        inputs = pack_inputs(rows, work.shape[1], work.device, token_mask, staging)
    apply_inputs(work, inputs)
    one_hot = torch.zeros_like(work).scatter_(1, work.argmax(dim=-1, keepdim=True), 1.0)
    if inputs.all_greedy:
        return one_hot, torch.ones(work.shape[0], dtype=torch.bool, device=work.device)
    _truncate(work, inputs)  # greedy rows divide by temperature 1 and take no top-k / top-p / min-p
    probs = work.softmax(dim=-1)
    if inputs.greedy is None:
        return probs, None
    greedy = inputs.greedy != 0
    return torch.where(greedy[:, None], one_hot, probs), greedy


def _race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / E) per row: a draw from probs (unnormalized is fine) with E ~ Exp(1)."""
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def _fill_rows(out: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator | None, kind: str) -> None:
    """Fill out [R, K] with uniforms or Exp(1) draws: every row from `generator` in one call, then the seeded rows
    again from their own generators (greedy seeded rows take none: their generator stays where it is, as in
    `sampling.draw`). Overwriting rather than indexing the shared rows needs no index on the device."""

    def fill(t: torch.Tensor, g: torch.Generator | None) -> torch.Tensor:
        return t.uniform_(generator=g) if kind == "uniform" else t.exponential_(generator=g)

    if any(row.generator is None for row in rows):
        fill(out, generator)
    for i, row in enumerate(rows):
        if row.generator is not None and not row.params.is_greedy:
            fill(out[i], row.generator)


def draw_randomness(
    rows: Sequence[SamplingRow], num_drafts: int, vocab_size: int, device: torch.device, generator=None
) -> SpecRandomness:
    """One verify step's random numbers (module doc): [R, N] uniforms, then [R, V] exponentials."""
    if all(row.params.is_greedy for row in rows):  # greedy rows read neither: leave every generator alone
        zeros = torch.zeros((len(rows), num_drafts), device=device)
        return SpecRandomness(zeros, torch.ones((len(rows), vocab_size), device=device))
    uniform = torch.empty((len(rows), num_drafts), device=device)
    noise = torch.empty((len(rows), vocab_size), device=device)
    _fill_rows(uniform, rows, generator, "uniform")
    _fill_rows(noise, rows, generator, "exponential")
    return SpecRandomness(uniform, noise)


@torch.no_grad()
def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    randomness: SpecRandomness,
    greedy: torch.Tensor | None = None,
) -> SpecOutput:
    """target_probs [R, N + 1, V] (p_0..p_N), draft_probs [R, N, V] (q_1..q_N), draft_ids [R, N] int64
    (d_i ~ q_i), greedy [R] bool (None: no greedy row) -> the verified tokens (module doc)."""
    num_rows, num_drafts, vocab = draft_probs.shape
    if num_drafts < 1:
        raise ValueError("a verify step needs at least one draft per row (N = 0 is a plain decode step: sample)")
    if target_probs.shape != (num_rows, num_drafts + 1, vocab) or draft_ids.shape != (num_rows, num_drafts):
        raise ValueError(
            f"shapes: p {tuple(target_probs.shape)}, q {tuple(draft_probs.shape)}, d {tuple(draft_ids.shape)}"
        )
    p, q = target_probs.float(), draft_probs.float()
    d = draft_ids[:, :, None]  # [R, N, 1]
    p_d = p[:, :num_drafts].gather(2, d).squeeze(2)  # [R, N] p_{i-1}(d_i)
    q_d = q.gather(2, d).squeeze(2)  # [R, N] q_i(d_i)
    accept = randomness.uniform * q_d < p_d  # u < p / q, without dividing by a zero q
    if greedy is not None:
        target_argmax = p[:, :num_drafts].argmax(dim=-1)  # [R, N]
        accept = torch.where(greedy[:, None], draft_ids == target_argmax, accept)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [R]: the run of acceptances from the first draft
    k = num_accepted[:, None, None]  # [R, 1, 1] the position of the last token
    p_k = p.gather(1, k.expand(-1, 1, vocab)).squeeze(1)  # [R, V]
    q_k = q.gather(1, k.clamp(max=num_drafts - 1).expand(-1, 1, vocab)).squeeze(1)  # [R, V]
    rejected = (num_accepted < num_drafts)[:, None]  # [R, 1]: the last token replaces a rejected draft
    residual = torch.where(rejected, (p_k - q_k).clamp_min(0.0), p_k)
    # a residual of zero mass happens only when p_k <= q_k everywhere, i.e. p_k = q_k, where a rejection has
    # probability 0: round-off can still get here, and p_k is then the right distribution
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_k)
    last = _race(residual, randomness.noise)  # [R]
    if greedy is not None:
        last = torch.where(greedy, p_k.argmax(dim=-1), last)
    positions = torch.arange(num_drafts + 1, device=p.device)[None, :]  # [1, N + 1]
    padded = torch.cat([draft_ids, torch.full_like(draft_ids[:, :1], -1)], dim=1)  # [R, N + 1]
    tokens = torch.where(positions == num_accepted[:, None], last[:, None], padded)
    tokens = torch.where(positions > num_accepted[:, None], torch.full_like(tokens, -1), tokens)
    return SpecOutput(num_accepted, tokens)


@torch.no_grad()
def verify(
    verify_logits: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    rows: Sequence[SamplingRow],
    draft_token_ids_host: Sequence[Sequence[int]] | None = None,
    generator: torch.Generator | None = None,
    token_mask: TokenMask | None = None,
    staging: HostStaging | None = None,
) -> SpecOutput:
    """A verify step's sampling: verify_logits [R, N + 1, V] (the target at the row's last token and its N
    drafts), draft_probs [R, N, V] and draft_ids [R, N] from `draft_tokens`; `token_mask` (structured output)
    covers the R * (N + 1) position rows."""
    num_rows, width, vocab = verify_logits.shape
    flat_rows = position_rows(rows, draft_token_ids_host, width - 1)
    p, greedy = _processed(verify_logits.reshape(num_rows * width, vocab), flat_rows, token_mask, staging)
    randomness = draw_randomness(rows, width - 1, vocab, verify_logits.device, generator)
    row_greedy = None if greedy is None else greedy.view(num_rows, width)[:, 0]  # a row's positions share params
    return rejection_sample(p.view(num_rows, width, vocab), draft_probs, draft_ids, randomness, row_greedy)


@torch.no_grad()
def draft_tokens(
    draft_logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    generator: torch.Generator | None = None,
    staging: HostStaging | None = None,
    inputs: SamplerInputs | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's draw: draft_logits [R, V] (the MTP block's, one position per row) -> (d [R] int64, q [R, V]
    fp32), q processed as the target is (so that q is close to p), d ~ q with each seeded row's own generator.
    Greedy rows draft the argmax and take no randomness. Rows with history-dependent processing should pass the
    history up to this draft (`position_rows`). `inputs`: the rows' sampler parameters packed once
    (`pack_inputs`), reused by a draft chain whose rows' processing does not depend on their history: no host
    work and no copy between its drafts."""
    q, greedy = _processed(draft_logits, rows, None, staging, inputs)
    if greedy is not None and all(row.params.is_greedy for row in rows):
        return q.argmax(dim=-1), q
    noise = torch.empty_like(q)
    _fill_rows(noise, rows, generator, "exponential")
    ids = _race(q, noise)
    return (ids if greedy is None else torch.where(greedy, q.argmax(dim=-1), ids)), q


@dataclass
class SpecDecodeStats:
    """The worker's speculative-decoding counters (vLLM's meanings), for ipc.messages.Stats.

    A draft is one row's N proposed tokens in one verify step; accepted tokens count drafts kept, not the bonus
    or replacement token each verify adds. Acceptance rate = accepted / draft tokens; tokens per verify step =
    1 + accepted / drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_drafts: int, draft_tokens: int, accepted: int) -> None:
        """One verify step: `num_drafts` rows carried drafts, `draft_tokens` in all, `accepted` of them kept."""
        if not 0 <= accepted <= draft_tokens or num_drafts < 0:
            raise ValueError(f"drafts {num_drafts}, draft tokens {draft_tokens}, accepted {accepted}")
        self.num_drafts += num_drafts
        self.num_draft_tokens += draft_tokens
        self.num_accepted_tokens += accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def stats_fields(self) -> dict[str, int]:
        """The fields of ipc.messages.Stats these counters fill."""
        return {
            "spec_decode_num_drafts_total": self.num_drafts,
            "spec_decode_num_draft_tokens_total": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens_total": self.num_accepted_tokens,
        }
