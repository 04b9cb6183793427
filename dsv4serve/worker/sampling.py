"""Batched token sampling: one call turns a step's last-position logits into one token per row.

Order of operations: penalties -> EOS/stop masking (min_tokens, ignore_eos) -> logit_bias and
allowed_token_ids -> the grammar bitmask of structured output (worker/grammar.py) -> forced tokens (a row
with one due keeps only it) -> greedy argmax for
greedy rows; for the others temperature -> top-k -> top-p -> min-p -> draw. Every stage is a tensor
op over the whole [B, V] batch on the logits' device. The rows' parameters are packed on the host and
reach the device in one copy (worker/sampler_inputs.py); which stages run is decided on the host from
what the rows ask for, so no stage reads a device value and the host never waits inside `sample`: it
waits once, for the packed results (`SampleOutput.to_host`).

Where this differs from vLLM V1, on purpose: min-p runs after top-k/top-p (vLLM V0's order; V1
applies min-p first, which changes the result only when min-p and top-p are combined), and
ignore_eos masks EOS rather than letting the model emit it and carry on, so a fixed-length run
never contains an EOS token. Masking before or after penalties is the same (-inf stays -inf).

Logprobs are vLLM V1's default ("raw_logprobs"): log_softmax of the model's logits as they came in,
before penalties, masking, temperature and truncation, so they describe the model, not the sampler.

Draws use the exponential race (argmax of p / E, E ~ Exp(1), as vLLM does): a seeded row takes its
noise only from its own generator, so its tokens do not depend on what else is in the batch. On CUDA
with flashinfer installed, unseeded rows without min-p are drawn by its sort-free top-k / top-p kernel
instead (worker/sampling_flashinfer.py: same distribution, other random numbers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dsv4serve.model.batch import HostStaging
from dsv4serve.worker.row_argmax import argmax_without, row_argmax
from dsv4serve.worker.sampler_inputs import (
    HostReader,
    SamplerInputs,
    SamplingRow,
    TokenMask,
    forced_token,
    masks_stops_only,
    pack_inputs,
    stop_tokens_to_mask,
)
from dsv4serve.worker.sampling_flashinfer import draw_flashinfer, fast_path, flashinfer_sampling

__all__ = ["HostSample", "SampleOutput", "SamplingRow", "TokenMask", "forced_token", "make_generator", "sample"]
__all__ += ["stop_tokens_to_mask"]

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class HostSample:
    """A step's results on the host, from one device-to-host copy."""

    token_ids: list[int]  # [B]
    logprobs: list[float | None]  # [B] raw logprob of the chosen token; None where not asked
    top: list[list[tuple[int, float]] | None]  # per row: the alternatives asked for, best first; None: not asked


@dataclass(frozen=True)
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] fp32, raw logprob of the chosen token
    top_token_ids: torch.Tensor | None  # [B, N] int64, best first; N = most alternatives any row asked for
    top_logprobs: torch.Tensor | None  # [B, N] fp32; None (both) when no row asked
    num_top_logprobs: tuple[int | None, ...]  # per row: alternatives asked for, None = not asked

    def row_top(self, row: int) -> list[tuple[int, float]] | None:
        """The (token id, logprob) alternatives row `row` asked for, best first (reads the device: for
        tests; a step reads everything at once with `to_host`)."""
        n = self.num_top_logprobs[row]
        if n is None or self.top_token_ids is None or self.top_logprobs is None:
            return None
        ids = self.top_token_ids[row, :n].tolist()
        return list(zip(ids, self.top_logprobs[row, :n].tolist()))

    def packed(self) -> torch.Tensor:
        """[B] int64 token ids; with logprobs asked, [B + B + 2 B N] fp64: ids, chosen logprobs, top ids, top
        logprobs (token ids < 2^53 and fp32 values are exact in fp64): one tensor, one copy to the host."""
        if all(n is None for n in self.num_top_logprobs):
            return self.token_ids
        parts = [self.token_ids, self.logprobs]
        if self.top_token_ids is not None and self.top_logprobs is not None:
            parts += [self.top_token_ids.flatten(), self.top_logprobs.flatten()]
        return torch.cat([x.to(torch.float64) for x in parts])

    def to_host(self, reader: HostReader | None = None) -> HostSample:
        """Everything the rows asked for, in one device-to-host copy (the only one of a step)."""
        values = (reader or HostReader(self.token_ids.device)).read(self.packed())
        rows = len(self.num_top_logprobs)
        ids = [int(x) for x in values[:rows]]
        if len(values) == rows:  # no row asked for logprobs
            return HostSample(ids, [None] * rows, [None] * rows)
        chosen, n = values[rows : 2 * rows], (len(values) - 2 * rows) // (2 * rows)
        top_ids, top_lps = values[2 * rows : 2 * rows + rows * n], values[2 * rows + rows * n :]
        logprobs: list[float | None] = []
        top: list[list[tuple[int, float]] | None] = []
        for b, asked in enumerate(self.num_top_logprobs):
            logprobs.append(None if asked is None else chosen[b])
            pairs = [(int(top_ids[b * n + j]), top_lps[b * n + j]) for j in range(min(asked or 0, n))]
            top.append(None if asked is None else pairs)
        return HostSample(ids, logprobs, top)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request generator for a seeded request; keep it for the request's whole life."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _check(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [B, V] with B = {len(rows)} rows, got {tuple(logits.shape)}")
    for row in rows:
        if row.params.seed is not None and row.generator is None:
            raise ValueError("a row with a seed needs its own generator (make_generator)")
        if row.generator is not None and row.generator.device.type != logits.device.type:
            raise ValueError(f"a row's generator is on {row.generator.device}, the logits on {logits.device}")


@torch.no_grad()
def sample(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    generator: torch.Generator | None = None,
    token_mask: TokenMask | None = None,
    staging: HostStaging | None = None,
) -> SampleOutput:
    """logits [B, V] (fp32; other float types are upcast) -> one token per row.

    `generator` drives the rows without a seed (None: torch's default generator); `token_mask` is the
    structured-output bitmask of the step's constrained rows; `staging` the pinned buffers the rows'
    parameters go through to the device (a GPU worker's; None: a plain copy).
    """
    _check(logits, rows)
    raw = logits.float()  # [B, V] fp32, holds its values on return: logprobs come from it
    inputs = pack_inputs(rows, raw.shape[1], raw.device, token_mask, staging)
    if inputs.all_greedy and token_mask is None and masks_stops_only(inputs) and raw.is_contiguous():
        # the common greedy decode case (ignore_eos or min_tokens at most mask a few stop tokens): no copy
        token_ids = argmax_without(raw, inputs.stop_flat)
    else:
        work = raw.clone()  # [B, V] fp32, modified in place stage by stage
        apply_inputs(work, inputs)
        token_ids = row_argmax(work)  # [B] the greedy choice, also for rows sampled below
        if not inputs.all_greedy:
            fi = flashinfer_sampling(work.device)  # CUDA: flashinfer's sort-free kernel, where it draws the same
            if fi is not None and fast_path(inputs, rows):
                drawn = draw_flashinfer(fi, work, inputs, generator)
            else:
                _truncate(work, inputs)
                drawn = draw(work, inputs, rows, generator)
            token_ids = drawn if inputs.greedy is None else torch.where(inputs.greedy != 0, token_ids, drawn)
    chosen, top_ids, top_values = logprobs_of(raw, token_ids, inputs)
    return SampleOutput(token_ids, chosen, top_ids, top_values, tuple(row.params.logprobs for row in rows))


def apply_inputs(work: torch.Tensor, x: SamplerInputs) -> None:
    """The stages before the greedy argmax, in place on work [B, V] fp32 (module doc's order)."""
    _penalize(work, x)
    flat = work.view(-1)  # [B * V]: the (row, token) positions come as row * V + token
    if x.stop_flat is not None:
        flat.index_fill_(0, x.stop_flat, _NEG_INF)
    if x.restricted_rows is not None and x.allowed_flat is not None:
        kept = flat.index_select(0, x.allowed_flat)
        work.index_fill_(0, x.restricted_rows, _NEG_INF)
        flat.index_copy_(0, x.allowed_flat, kept)
    if x.bias_flat is not None and x.bias is not None:
        flat.index_add_(0, x.bias_flat, x.bias)  # added before temperature, as OpenAI and vLLM do
    _apply_bitmask(work, x)
    if x.forced_rows is not None and x.forced_tokens is not None:
        # a forced token keeps its logit (0 when it was masked), every other token of its row goes
        kept = work[x.forced_rows, x.forced_tokens]
        kept = torch.where(kept.isfinite(), kept, 0.0)
        work.index_fill_(0, x.forced_rows, _NEG_INF)
        work.index_put_((x.forced_rows, x.forced_tokens), kept)


def _apply_bitmask(work: torch.Tensor, x: SamplerInputs) -> None:
    """Tokens a constrained row's grammar refuses -> -inf, with xgrammar's kernel (Triton on a GPU, C++ on
    the CPU) on the bitmask that came with the step's parameters. The GPU kernel takes the rows as a device
    tensor (a list would be one more blocking copy); the CPU kernel reads a list (a tensor: a `tolist`)."""
    if x.bitmask is None or x.constrained_rows is None:
        return
    # imported here, at the first constrained row: the sampler itself needs no grammar library (the GPU
    # checks run it on machines without one)
    import xgrammar as xgr

    if work.device.type != "cuda":
        xgr.apply_token_bitmask_inplace(work, x.bitmask, vocab_size=work.shape[1], indices=list(x.constrained))
        return
    # annotated as a list, but handed as is to the Triton backend, whose annotation takes a tensor too
    rows: Any = x.constrained_rows
    xgr.apply_token_bitmask_inplace(work, x.bitmask, vocab_size=work.shape[1], indices=rows)


def _token_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """ids [P, L] int64 (padded with vocab_size) -> how often each token occurs per row, [P, V] fp32."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, device=ids.device))  # the pad bin is cut off, as vLLM does
    return counts[:, :vocab_size]


def _penalize(work: torch.Tensor, x: SamplerInputs) -> None:
    """vLLM's penalties, in place on [B, V]: repetition (prompt + output), then frequency, presence."""
    if x.penalty_rows is None or x.output_ids is None:
        return
    vocab_size = work.shape[1]
    sub = work.index_select(0, x.penalty_rows)  # [P, V]
    outputs = _token_counts(x.output_ids, vocab_size)  # [P, V]
    if x.prompt_ids is not None and x.repetition is not None:
        prompts = _token_counts(x.prompt_ids, vocab_size)
        scale = torch.where((prompts > 0) | (outputs > 0), x.repetition[:, None], 1.0)
        sub = torch.where(sub > 0, sub / scale, sub * scale)
    if x.frequency is not None and x.presence is not None:
        sub -= x.frequency[:, None] * outputs + x.presence[:, None] * (outputs > 0)
    work.index_copy_(0, x.penalty_rows, sub)


def apply_penalties(work: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """The penalties stage alone, in place on work [B, V] (for tests)."""
    _penalize(work, pack_inputs(rows, work.shape[1], work.device))


def _truncate(work: torch.Tensor, x: SamplerInputs) -> None:
    """Temperature, then top-k, top-p and min-p, in place (the sampled rows' distribution)."""
    if x.temperature is not None:
        work.div_(x.temperature[:, None])
    if x.top_k is not None and x.top_k_index is not None:
        # keep the k largest logits per row (ties with the k-th are kept, as in vLLM)
        best = work.topk(x.top_k_max, dim=-1).values  # [B, k_max] descending
        threshold = best.gather(1, x.top_k_index[:, None])  # [B, 1]
        work.masked_fill_((x.top_k[:, None] > 0) & (work < threshold), _NEG_INF)
    if x.top_p is not None:
        # the smallest set of most likely tokens whose mass reaches top_p (vLLM's numerics: ascending
        # sort, cumulative sum from the least likely, drop while the sum <= 1 - p)
        top_p = x.top_p[:, None]
        sorted_logits, order = work.sort(dim=-1, descending=False)  # [B, V] ascending
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = (cumulative <= 1.0 - top_p) & (top_p < 1.0)
        drop_sorted[:, -1] = False  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        work.masked_fill_(drop, _NEG_INF)
    if x.min_p is not None:
        # drop tokens whose probability is below min_p times the row's largest probability
        probs = work.softmax(dim=-1)
        floor = x.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        work.masked_fill_(probs < floor, _NEG_INF)


def draw(
    work: torch.Tensor, x: SamplerInputs, rows: Sequence[SamplingRow], generator: torch.Generator | None
) -> torch.Tensor:
    """One token per row from softmax(work): argmax(p / E) with E ~ Exp(1). -> [B] int64"""
    probs = work.softmax(dim=-1)  # [B, V]
    if x.num_shared == len(rows):  # no seeded row: one draw for the batch, as the shared rows' block below
        noise = torch.empty_like(probs).exponential_(generator=generator)
    else:
        noise = torch.empty_like(probs)
        if x.shared_rows is not None:
            fresh = torch.empty((x.num_shared, work.shape[1]), device=work.device)
            noise.index_copy_(0, x.shared_rows, fresh.exponential_(generator=generator))
        for i, row in enumerate(rows):
            if row.generator is None:
                continue
            if row.params.is_greedy:  # its token is the argmax; leave its generator where it is
                noise[i].fill_(1.0)
            else:
                noise[i].exponential_(generator=row.generator)
    # a zero draw would make 0/0 = NaN for a masked token, and argmax favours NaN
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return row_argmax(probs.div_(noise))


def logprobs_of(
    raw: torch.Tensor, token_ids: torch.Tensor, x: SamplerInputs
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Raw logprob of each chosen token ([B] fp32; NaN for rows that did not ask for logprobs) and the
    N most likely alternatives ([B, N] int64 ids, [B, N] fp32 logprobs, best first; None when no row
    asked). Only the rows that asked pay for the full-vocabulary log-normalizer."""
    chosen = torch.full((raw.shape[0],), float("nan"), device=raw.device)
    if x.asked_rows is None:
        return chosen, None, None
    index = x.asked_rows
    sub = raw.index_select(0, index)
    log_norm = torch.logsumexp(sub, dim=-1)  # [A]
    chosen[index] = sub.gather(1, token_ids.index_select(0, index)[:, None]).squeeze(1) - log_norm
    values, ids = sub.topk(x.num_top, dim=-1)  # sorted, best first
    top_ids = torch.zeros((raw.shape[0], x.num_top), dtype=torch.long, device=raw.device)
    top_values = torch.full((raw.shape[0], x.num_top), float("nan"), device=raw.device)
    top_ids[index], top_values[index] = ids, values - log_norm[:, None]
    return chosen, top_ids, top_values
