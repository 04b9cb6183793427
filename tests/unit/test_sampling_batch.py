"""The batched sampler one row at a time (issue #16): on random mixed batches every row picks the token a
one-row reference, written from the sampler's stage definitions, picks with the same noise."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.worker.sampling import SamplingRow, forced_token, make_generator, sample

# ------------------------------------------------------------------------------ one row at a time (issue #16)


def _reference_row(
    logits: torch.Tensor, row: SamplingRow, bits: torch.Tensor | None, noise: torch.Tensor | None
) -> int:
    """One row through the module doc's stages, written from their definitions on a [V] fp32 row: the
    batched sampler (parameters packed on the host, one copy to the device) must pick the same token."""
    p, vocab_size = row.params, logits.shape[0]
    x = logits.clone()
    seen_out = torch.bincount(torch.tensor(row.output_token_ids, dtype=torch.long), minlength=vocab_size).float()
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        seen[list(row.prompt_token_ids) + list(row.output_token_ids)] = True
        x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    if p.frequency_penalty or p.presence_penalty:
        x = x - (p.frequency_penalty * seen_out + p.presence_penalty * (seen_out > 0))
    below_min = len(row.output_token_ids) < p.min_tokens
    for t in (list(p.stop_token_ids) if below_min else []) + ([0] if below_min or p.ignore_eos else []):
        x[t] = float("-inf")  # EOS is token 0 in these rows
    if p.allowed_token_ids is not None:
        keep = torch.zeros(vocab_size, dtype=torch.bool)
        keep[[t for t in p.allowed_token_ids if t < vocab_size]] = True
        x[~keep] = float("-inf")
    for t, b in p.logit_bias:
        x[t] += b
    if bits is not None:  # token t is bit t % 32 of word t // 32
        x[[t for t in range(vocab_size) if not (int(bits[t // 32]) >> (t % 32)) & 1]] = float("-inf")
    forced = forced_token(p, row.output_token_ids)
    if forced is not None:
        kept = float(x[forced]) if torch.isfinite(x[forced]) else 0.0
        x.fill_(float("-inf"))
        x[forced] = kept
    if p.is_greedy:
        return int(x.argmax())
    x = x / p.temperature
    if 0 < p.top_k < vocab_size:
        x[x < x.topk(p.top_k).values[-1]] = float("-inf")
    if p.top_p < 1.0:
        ascending, order = x.sort()
        drop = ascending.softmax(-1).cumsum(-1) <= 1.0 - p.top_p
        drop[-1] = False
        x[order[drop]] = float("-inf")
    if p.min_p > 0.0:
        probs = x.softmax(-1)
        x[probs < p.min_p * probs.max()] = float("-inf")
    assert noise is not None
    return int((x.softmax(-1) / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax())


def _random_row(rng: random.Random, vocab_size: int) -> SamplingRow:
    kw: dict = {"temperature": rng.choice([0.0, 0.5, 1.0, 1.4]), "logprobs": rng.choice([None, 0, 3])}
    kw["top_k"], kw["top_p"], kw["min_p"] = rng.choice([0, 3, 40]), rng.choice([1.0, 0.9, 0.5]), rng.choice([0.0, 0.1])
    kw["repetition_penalty"], kw["frequency_penalty"] = rng.choice([1.0, 1.5]), rng.choice([0.0, 0.4])
    kw["presence_penalty"] = rng.choice([0.0, -0.7])
    if rng.random() < 0.3:
        kw["logit_bias"] = ((rng.randrange(vocab_size), 3.0), (rng.randrange(vocab_size), -2.0))
    if rng.random() < 0.2:
        kw["allowed_token_ids"] = tuple(rng.sample(range(vocab_size), 5))
    if rng.random() < 0.3:
        kw["min_tokens"], kw["stop_token_ids"], kw["ignore_eos"] = 4, (rng.randrange(1, vocab_size),), True
    if rng.random() < 0.2:
        kw["forced_tokens"] = (rng.randrange(vocab_size), rng.randrange(vocab_size))
    seed = rng.randrange(100) if rng.random() < 0.4 else None
    outputs = tuple(rng.randrange(vocab_size) for _ in range(rng.randrange(4)))
    generator = make_generator(seed, "cpu") if seed is not None else None
    return SamplingRow(SamplingParams(seed=seed, **kw), (1, 2, 3), outputs, 0, generator)


@pytest.mark.parametrize("seed", range(40))
def test_a_mixed_batch_picks_what_each_row_alone_picks(seed: int) -> None:
    """Tokens unchanged by batching and packing: each row equals the one-row reference above, which takes its
    noise as the sampler's contract says (a seeded row from its own generator; the other rows from one
    [S, V] draw of the shared generator, in row order). (The batched sampler before issue #16 gave these
    same tokens, logprobs and alternatives on 600 random batches.)"""
    rng = random.Random(seed)
    vocab_size = rng.choice([9, 70, 300])
    rows = [_random_row(rng, vocab_size) for _ in range(rng.randrange(1, 7))]
    logits = torch.randn(len(rows), vocab_size, generator=torch.Generator().manual_seed(seed)) * 3
    constrained = [i for i in range(len(rows)) if rng.random() < 0.3]
    mask = _Bits(constrained, len(rows), vocab_size, rng) if constrained else None
    seeds = [r.params.seed for r in rows]
    out = sample(logits, rows, make_generator(1000 + seed, "cpu"), token_mask=mask)
    shared = [i for i, r in enumerate(rows) if r.generator is None]
    shared_noise = torch.empty(len(shared), vocab_size).exponential_(generator=make_generator(1000 + seed, "cpu"))
    for i, row in enumerate(rows):
        own = make_generator(seeds[i], "cpu") if seeds[i] is not None else None  # a fresh copy of its generator
        noise = shared_noise[shared.index(i)] if own is None else torch.empty(vocab_size).exponential_(generator=own)
        bits = mask.bitmask[i] if mask is not None and i in constrained else None
        assert int(out.token_ids[i]) == _reference_row(logits[i], row, bits, noise), (seed, i, row.params)
    host = out.to_host()  # the runner's one read gives the same as the tensors
    assert host.token_ids == out.token_ids.tolist()
    assert host.top == [out.row_top(i) for i in range(len(rows))]


class _Bits:
    """A random grammar bitmask for some rows (every row keeps at least token 1 allowed)."""

    def __init__(self, rows: list[int], num_rows: int, vocab_size: int, rng: random.Random):
        self.rows = rows
        words = [[rng.getrandbits(32) | 0b10 for _ in range(-(-vocab_size // 32))] for _ in range(num_rows)]
        self.bitmask = torch.tensor(words, dtype=torch.int64).to(torch.int32)  # wraps to int32 bit patterns
