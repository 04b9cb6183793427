"""Batched token sampling: one call turns a step's last-position logits into one token per row.

Order of operations: penalties -> EOS/stop masking (min_tokens, ignore_eos) -> logit_bias and
allowed_token_ids -> the grammar bitmask of structured output (worker/grammar.py) -> forced tokens (a row
with one due keeps only it) -> greedy argmax for
greedy rows; for the others temperature -> top-k -> top-p -> min-p -> draw. Every stage is a tensor
op over the whole [B, V] batch on the logits' device; Python loops only over rows, to build the small
per-row parameter tensors.

Where this differs from vLLM V1, on purpose: min-p runs after top-k/top-p (vLLM V0's order; V1
applies min-p first, which changes the result only when min-p and top-p are combined), and
ignore_eos masks EOS rather than letting the model emit it and carry on, so a fixed-length run
never contains an EOS token. Masking before or after penalties is the same (-inf stays -inf).

Logprobs are vLLM V1's default ("raw_logprobs"): log_softmax of the model's logits as they came in,
before penalties, masking, temperature and truncation, so they describe the model, not the sampler.

Draws use the exponential race (argmax of p / E, E ~ Exp(1), as vLLM does): a seeded row takes its
noise only from its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dsv4serve.ipc.sampling import SamplingParams

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one request at this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]  # repetition_penalty looks at prompt + output
    output_token_ids: Sequence[int]  # presence/frequency penalties and min_tokens count these only
    eos_token_id: int | None
    generator: torch.Generator | None = None  # required when params.seed is set; on the logits' device

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass(frozen=True)
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] fp32, raw logprob of the chosen token
    top_token_ids: torch.Tensor | None  # [B, N] int64, best first; N = most alternatives any row asked for
    top_logprobs: torch.Tensor | None  # [B, N] fp32; None (both) when no row asked
    num_top_logprobs: tuple[int | None, ...]  # per row: alternatives asked for, None = not asked

    def row_top(self, row: int) -> list[tuple[int, float]] | None:
        """The (token id, logprob) alternatives row `row` asked for, best first."""
        n = self.num_top_logprobs[row]
        if n is None or self.top_token_ids is None or self.top_logprobs is None:
            return None
        ids = self.top_token_ids[row, :n].tolist()
        return list(zip(ids, self.top_logprobs[row, :n].tolist()))


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request generator for a seeded request; keep it for the request's whole life."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class TokenMask(Protocol):
    """A step's grammar bitmask (worker/grammar.TokenMask): masks the constrained rows in place."""

    def apply(self, logits: torch.Tensor) -> None: ...


@torch.no_grad()
def sample(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    generator: torch.Generator | None = None,
    token_mask: TokenMask | None = None,
) -> SampleOutput:
    """logits [B, V] (fp32; other float types are upcast) -> one token per row.

    `generator` drives the rows without a seed (None: torch's default generator); `token_mask` is the
    structured-output bitmask of the step's constrained rows.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [B, V] with B = {len(rows)} rows, got {tuple(logits.shape)}")
    for row in rows:
        if row.params.seed is not None and row.generator is None:
            raise ValueError("a row with a seed needs its own generator (make_generator)")
        if row.generator is not None and row.generator.device.type != logits.device.type:
            raise ValueError(f"a row's generator is on {row.generator.device}, the logits on {logits.device}")
    raw = logits.float()  # [B, V] fp32, never modified: logprobs come from it
    is_greedy = [row.params.is_greedy for row in rows]
    if all(is_greedy) and token_mask is None and not any(_changes_logits(row) for row in rows):
        token_ids = raw.argmax(dim=-1)  # the common decode case: one pass, no copy
    else:
        work = raw.clone()  # [B, V] fp32, modified in place stage by stage
        apply_penalties(work, rows)
        mask_stop_tokens(work, rows)
        apply_token_limits(work, rows)
        if token_mask is not None:
            token_mask.apply(work)
        apply_forced_tokens(work, rows)
        token_ids = work.argmax(dim=-1)  # [B] the greedy choice, also for rows sampled below
        if not all(is_greedy):
            apply_temperature(work, rows)
            apply_top_k(work, rows)
            apply_top_p(work, rows)
            apply_min_p(work, rows)
            drawn = draw(work, rows, generator)
            token_ids = torch.where(torch.tensor(is_greedy, device=raw.device), token_ids, drawn)
    chosen, top_ids, top_values = logprobs_of(raw, token_ids, rows)
    return SampleOutput(token_ids, chosen, top_ids, top_values, tuple(row.params.logprobs for row in rows))


def _changes_logits(row: SamplingRow) -> bool:
    """Whether a greedy row's logits need penalties, stop masking or forcing before the argmax."""
    return (
        row.params.has_penalties
        or bool(row.params.logit_bias)
        or row.params.allowed_token_ids is not None
        or bool(stop_tokens_to_mask(row))
        or forced_token(row.params, row.output_token_ids) is not None
    )


def forced_token(params: SamplingParams, output_token_ids: Sequence[int]) -> int | None:
    """The token this row must produce next (SamplingParams.forced_tokens), or None."""
    if not params.forced_tokens:
        return None
    start = 0
    if params.forced_after is not None:
        try:
            start = list(output_token_ids).index(params.forced_after) + 1
        except ValueError:
            return None  # the trigger has not come yet
    done = len(output_token_ids) - start
    return params.forced_tokens[done] if done < len(params.forced_tokens) else None


def apply_forced_tokens(work: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Rows with a forced token due keep only that token (every sampling stage then picks it)."""
    for i, row in enumerate(rows):
        token = forced_token(row.params, row.output_token_ids)
        if token is not None:
            keep = work[i, token].clone()
            work[i].fill_(_NEG_INF)
            work[i, token] = keep if torch.isfinite(keep) else 0.0


def apply_token_limits(work: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """allowed_token_ids (every other token -> -inf), then logit_bias (added to the logits, as OpenAI
    and vLLM do: before temperature)."""
    device, vocab_size = work.device, work.shape[1]
    for i, row in enumerate(rows):
        allowed = row.params.allowed_token_ids
        if allowed is not None:
            keep = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            keep[torch.tensor([t for t in allowed if t < vocab_size], dtype=torch.long, device=device)] = True
            work[i].masked_fill_(~keep, _NEG_INF)
    pairs = [(i, t, b) for i, row in enumerate(rows) for t, b in row.params.logit_bias if t < vocab_size]
    if pairs:
        row_index = torch.tensor([p[0] for p in pairs], device=device)
        token_index = torch.tensor([p[1] for p in pairs], device=device)
        work.index_put_((row_index, token_index), _row_tensor([p[2] for p in pairs], work), accumulate=True)


def _row_tensor(values: list, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def token_counts(sequences: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each sequence: [N, V] fp32."""
    max_len = max((len(s) for s in sequences), default=0)
    # pad with an extra bin (vocab_size) that is cut off afterwards, as vLLM does
    ids = torch.full((len(sequences), max_len), vocab_size, dtype=torch.long)
    for i, seq in enumerate(sequences):
        if len(seq):
            ids[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    counts = torch.zeros(len(sequences), vocab_size + 1, device=device)
    counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, device=device))
    return counts[:, :vocab_size]


def apply_penalties(work: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """vLLM's penalties, in place on [B, V]: repetition (prompt + output), then frequency, presence."""
    picked = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not picked:
        return
    vocab_size, device = work.shape[1], work.device
    params = [rows[i].params for i in picked]
    index = torch.tensor(picked, device=device)
    sub = work.index_select(0, index)  # [P, V]
    outputs = token_counts([rows[i].output_token_ids for i in picked], vocab_size, device)  # [P, V]
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = token_counts(
            [rows[i].prompt_token_ids if p.repetition_penalty != 1.0 else () for i, p in zip(picked, params)],
            vocab_size,
            device,
        )  # [P, V]
        repetition = _row_tensor([p.repetition_penalty for p in params], work)[:, None]
        scale = torch.where((prompts > 0) | (outputs > 0), repetition, 1.0)
        sub = torch.where(sub > 0, sub / scale, sub * scale)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        frequency = _row_tensor([p.frequency_penalty for p in params], work)[:, None]
        presence = _row_tensor([p.presence_penalty for p in params], work)[:, None]
        sub -= frequency * outputs + presence * (outputs > 0)
    work.index_copy_(0, index, sub)


def stop_tokens_to_mask(row: SamplingRow) -> list[int]:
    """EOS while ignore_eos or below min_tokens; stop_token_ids below min_tokens."""
    below_min = row.num_output_tokens < row.params.min_tokens
    banned = list(row.params.stop_token_ids) if below_min else []
    if row.eos_token_id is not None and (below_min or row.params.ignore_eos):
        banned.append(row.eos_token_id)
    return banned


def mask_stop_tokens(work: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    vocab_size = work.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        # a token id the model cannot emit needs no mask
        banned = [t for t in stop_tokens_to_mask(row) if 0 <= t < vocab_size]
        row_index += [i] * len(banned)
        token_index += banned
    if row_index:
        index = (torch.tensor(row_index, device=work.device), torch.tensor(token_index, device=work.device))
        work.index_put_(index, torch.tensor(_NEG_INF, device=work.device))


def apply_temperature(work: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    # greedy rows divide by 1: their token is the argmax taken before this stage
    temperatures = [1.0 if r.params.is_greedy else r.params.temperature for r in rows]
    work.div_(_row_tensor(temperatures, work)[:, None])


def apply_top_k(work: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Keep the k largest logits per row (ties with the k-th are kept, as in vLLM)."""
    vocab_size = work.shape[1]
    ks = [r.params.top_k if 0 < r.params.top_k < vocab_size else 0 for r in rows]
    k_max = max(ks)
    if k_max == 0:
        return
    best = work.topk(k_max, dim=-1).values  # [B, k_max] descending
    kth_index = torch.tensor([max(k, 1) - 1 for k in ks], device=work.device)[:, None]
    threshold = best.gather(1, kth_index)  # [B, 1]
    enabled = torch.tensor(ks, device=work.device)[:, None] > 0
    work.masked_fill_(enabled & (work < threshold), _NEG_INF)


def apply_top_p(work: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (vLLM's numerics:
    ascending sort, cumulative sum from the least likely, drop while the sum <= 1 - p)."""
    ps = [r.params.top_p for r in rows]
    if all(p >= 1.0 for p in ps):
        return
    top_p = _row_tensor(ps, work)[:, None]
    sorted_logits, order = work.sort(dim=-1, descending=False)  # [B, V] ascending
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = (cumulative <= 1.0 - top_p) & (top_p < 1.0)
    drop_sorted[:, -1] = False  # the most likely token always stays
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    work.masked_fill_(drop, _NEG_INF)


def apply_min_p(work: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Drop tokens whose probability is below min_p times the row's largest probability."""
    min_ps = [r.params.min_p for r in rows]
    if not any(p > 0.0 for p in min_ps):
        return
    probs = work.softmax(dim=-1)
    floor = _row_tensor(min_ps, work)[:, None] * probs.amax(dim=-1, keepdim=True)
    work.masked_fill_(probs < floor, _NEG_INF)


def draw(work: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from softmax(work): argmax(p / E) with E ~ Exp(1). -> [B] int64"""
    probs = work.softmax(dim=-1)  # [B, V]
    noise = torch.empty_like(probs)
    shared = [i for i, r in enumerate(rows) if r.generator is None]
    if shared:
        index = torch.tensor(shared, device=work.device)
        fresh = torch.empty((len(shared), work.shape[1]), device=work.device)
        noise.index_copy_(0, index, fresh.exponential_(generator=generator))
    for i, row in enumerate(rows):
        if row.generator is None:
            continue
        if row.params.is_greedy:  # its token is the argmax; leave its generator where it is
            noise[i].fill_(1.0)
        else:
            noise[i].exponential_(generator=row.generator)
    # a zero draw would make 0/0 = NaN for a masked token, and argmax favours NaN
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)


def logprobs_of(
    raw: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Raw logprob of each chosen token ([B] fp32; NaN for rows that did not ask for logprobs) and the
    N most likely alternatives ([B, N] int64 ids, [B, N] fp32 logprobs, best first; None when no row
    asked). Only the rows that asked pay for the full-vocabulary log-normalizer."""
    chosen = torch.full((raw.shape[0],), float("nan"), device=raw.device)
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not asked:
        return chosen, None, None
    index = torch.tensor(asked, device=raw.device)
    sub = raw.index_select(0, index)
    log_norm = torch.logsumexp(sub, dim=-1)  # [A]
    chosen[index] = sub.gather(1, token_ids.index_select(0, index)[:, None]).squeeze(1) - log_norm
    n = min(max(rows[i].params.logprobs for i in asked), raw.shape[1])
    values, ids = sub.topk(n, dim=-1)  # sorted, best first
    top_ids = torch.zeros((raw.shape[0], n), dtype=torch.long, device=raw.device)
    top_values = torch.full((raw.shape[0], n), float("nan"), device=raw.device)
    top_ids[index], top_values[index] = ids, values - log_norm[:, None]
    return chosen, top_ids, top_values
