"""Speculative decoding on the GPU (issue 19): the verify step's sampler at the real vocabulary, and, when the real
checkpoint is on the machine, the engine with --speculative-tokens 1 and 2 against 0.

Sampler cases (always): `spec_sampling.verify` on [B, N + 1, 129280] logits, timed against the decode step's
sampler (`sampling.sample` on [B, 129280], the baseline column: the extra cost of sampling a verify step).
  greedy: the drafts are the target's argmax, so every one is accepted and the tokens are the argmax of each
          position (the reference: torch argmax);
  chat:   temperature 0.6, top-p 0.95, drafts drawn from q = the target's own processed distribution, so
          p(d) / q(d) = 1 and every draft is accepted: the reference is N accepted and the drafts kept.
Real-model cases (only with DSV4_REAL_CHECKPOINT_DIR holding the checkpoint; DSV4_SPEC_SERVE_ARGS adds server
flags, e.g. an expert-slot cache): a server per N in (0, 1, 2) generates 4 greedy prompts x 128 tokens at batch 1;
the check is that a second run gives the same text (greedy is deterministic); the notes give tokens/s, the
acceptance rate and mean tokens per verify step (from /metrics), and the speed-up over N = 0. Without the
checkpoint there are no such rows, only a note that says so.
"""

from __future__ import annotations

import os

import torch

from bench.gpu_cases import GpuCase
from bench.gpu_cases._spec_server import COUNTERS, MAX_TOKENS, PROMPTS, SpecServers, checkpoint_dir

REAL_VOCAB = 129_280
SPEC_NS = (0, 1, 2)


def _rows(params, batch: int):
    from dsv4serve.worker.sampling import SamplingRow

    return [SamplingRow(params, (), (), None)] * batch


def sampler_case(device: torch.device, batch: int, drafts: int, vocab: int, greedy: bool) -> GpuCase:
    from dsv4serve.ipc.sampling import SamplingParams
    from dsv4serve.worker.sampling import sample
    from dsv4serve.worker.spec_sampling import processed_probs, verify

    params = SamplingParams(temperature=0.0) if greedy else SamplingParams(temperature=0.6, top_p=0.95)
    rows = _rows(params, batch)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = 4 * torch.randn(batch, drafts + 1, vocab, device=device, generator=gen)  # [B, N + 1, V] fp32
    if greedy:
        d = logits[:, :drafts].argmax(-1)  # [B, N]
        q = torch.nn.functional.one_hot(d, vocab).float()
        expected = logits.argmax(-1).float()  # [B, N + 1]
    else:
        q = processed_probs(logits[:, :drafts].reshape(-1, vocab), _rows(params, batch * drafts)).view(
            batch, drafts, vocab
        )
        d = torch.multinomial(q.flatten(0, 1), 1, generator=gen).view(batch, drafts)
        expected = torch.cat([torch.full((batch, 1), float(drafts), device=device), d.float()], dim=1)

    def run() -> torch.Tensor:
        out = verify(logits, q, d, rows)
        if greedy:
            return out.token_ids.float()
        return torch.cat([out.num_accepted[:, None].float(), out.token_ids[:, :drafts].float()], dim=1)

    decode_logits = logits[:, 0].contiguous()
    kind = "greedy" if greedy else "chat"
    return GpuCase(
        f"spec verify sampler {kind} B={batch} N={drafts} V={vocab}",
        run,
        lambda: expected,
        atol=0.0,
        rtol=0.0,
        bytes_moved=4 * batch * vocab * (2 * drafts + 1),  # p and q read once each
        baseline=lambda: sample(decode_logits, rows).token_ids,
        baseline_name="decode sampler",
    )


class RealCase:
    """One server's run as a GpuCase-like object: `run` generates, `reference` is the first run's text."""

    def __init__(self, servers: SpecServers, n: int, results: dict):
        self.servers, self.n, self.results = servers, n, results
        self.name = f"spec_decode real N={n} greedy, {len(PROMPTS)} x {MAX_TOKENS} tokens, B=1"
        self.atol, self.rtol, self.bytes_moved, self.flops = 0.0, 0.0, 0, 0
        self.baseline, self.baseline_name, self.bound = None, "", "memory"
        self.max_warmup, self.max_repeats = 0, 1
        self._first: torch.Tensor | None = None

    def run(self) -> torch.Tensor:
        before = self.servers.counters(self.n)
        text, tokens, seconds = self.servers.generate(self.n)
        after = self.servers.counters(self.n)
        self.results[self.n] = {
            "tok_s": tokens / seconds,
            **{k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS},
        }
        encoded = torch.tensor(list(text.encode()), dtype=torch.float32)
        if self._first is None:
            self._first = encoded
        if self.n == SPEC_NS[-1]:
            self.servers.close()
        return encoded

    def reference(self) -> torch.Tensor:
        assert self._first is not None
        return self._first

    def notes(self) -> list[str]:
        r, base = self.results.get(self.n), self.results.get(0)
        if r is None:
            return []
        line = f"spec_decode real N={self.n}: {r['tok_s']:.1f} tok/s"
        if base and self.n:
            line += f" ({r['tok_s'] / base['tok_s']:.2f}x N=0)"
        drafted, drafts = r["spec_decode_num_draft_tokens_total"], r["spec_decode_num_drafts_total"]
        if drafted:
            accepted = r["spec_decode_num_accepted_tokens_total"]
            line += f", acceptance {accepted / drafted:.2f}, {1 + accepted / drafts:.2f} tokens per verify step"
        return [line]


def cases(device: torch.device) -> list:
    out: list = [sampler_case(device, b, 2, REAL_VOCAB, greedy) for b in (1, 8) for greedy in (True, False)]
    checkpoint = checkpoint_dir()
    if checkpoint is not None and device.type == "cuda":
        servers = SpecServers(checkpoint, os.environ.get("DSV4_SPEC_SERVE_ARGS", ""))
        results: dict[int, dict[str, float]] = {}
        out += [RealCase(servers, n, results) for n in SPEC_NS]
    return out


def smoke_cases(device: torch.device) -> list[GpuCase]:
    return [sampler_case(device, b, 2, 512, greedy) for b, greedy in ((1, True), (4, False))]


def notes(times_ms: dict[str, float], ceilings: dict[str, float]) -> list[str]:
    if checkpoint_dir() is None:
        return ["spec_decode: no real-model rows (DSV4_REAL_CHECKPOINT_DIR does not name a checkpoint folder)"]
    return []
