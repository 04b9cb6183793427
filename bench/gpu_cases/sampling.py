"""GPU cases for the sampler's draw at DeepSeek-V4-Flash's vocabulary (129,280): flashinfer's sort-free
kernel (worker/sampling_flashinfer.py) against the torch draw (full sort for top-p, exponential race), as
`worker.sampling.sample` runs them: the baseline column is the torch draw, timed on the same inputs.

Two checks, since a draw is random:
- "sampling filters b=64": 64 decode rows of different logits with top-k 50 and top-p 0.9 at temperature
  0.8; `run` returns, per row, whether the drawn token lies in the row's top-k/top-p set computed by torch
  (all ones expected), so a filter applied wrongly fails.
- "sampling distribution b=8192": 8,192 rows of one distribution; `run` returns the drawn frequency of the
  8 most likely tokens, `reference` their exact probability after the filters; atol 0.02 is over 4 standard
  errors (p(1 - p) / 8192 <= 0.0055^2 per bin), so a wrong temperature or order fails.
Without flashinfer the `run` column is the torch draw too (the case's name says so).
"""

from __future__ import annotations

import torch

from bench.gpu_cases import GpuCase, real_config_dir
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.model.args import read_model_args
from dsv4serve.worker import sampling as sampler
from dsv4serve.worker.sampling import SamplingRow, sample

PARAMS = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
TOP = 8


def _allowed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[B, V] bool: the tokens the top-k / top-p filters keep (vLLM's rule, as worker/sampling.py applies it)."""
    scaled = logits.float() / params.temperature
    kth = scaled.topk(params.top_k, dim=-1).values[:, -1:]
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    desc, order = probs.sort(dim=-1, descending=True)
    keep_sorted = (desc.cumsum(-1) - desc) < params.top_p
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    probs = (logits.float() / params.temperature).softmax(-1) * _allowed(logits, params)
    return probs / probs.sum(-1, keepdim=True)


def _draw(logits: torch.Tensor, use_flashinfer: bool) -> torch.Tensor:
    rows = [SamplingRow(PARAMS, (), (), None)] * logits.shape[0]
    if use_flashinfer:
        return sample(logits, rows).token_ids
    saved = sampler.flashinfer_sampling
    sampler.flashinfer_sampling = lambda device: None  # the torch draw, for the baseline column
    try:
        return sample(logits, rows).token_ids
    finally:
        sampler.flashinfer_sampling = saved


def build(device: torch.device, vocab: int, rows: int, dist_rows: int) -> list[GpuCase]:
    gen = torch.Generator(device=device).manual_seed(0)
    logits = 3.0 * torch.randn(rows, vocab, generator=gen, device=device)
    allowed = _allowed(logits, PARAMS)
    one = 3.0 * torch.randn(1, vocab, generator=gen, device=device)
    same = one.expand(dist_rows, vocab).contiguous()
    exact = _filtered_probs(one, PARAMS)[0]
    top = exact.topk(TOP).indices
    engine = "flashinfer" if sampler.flashinfer_sampling(device) is not None else "torch (flashinfer not installed)"

    def in_set() -> torch.Tensor:
        tokens = _draw(logits, True)
        return allowed.gather(1, tokens[:, None]).float().squeeze(1)

    def frequencies() -> torch.Tensor:
        tokens = _draw(same, True)
        return torch.bincount(tokens, minlength=vocab)[top].float() / dist_rows

    bytes_filters = 4 * rows * vocab  # the logits read once
    return [
        GpuCase(
            f"sampling filters b={rows} [{engine}]",
            in_set,
            lambda: torch.ones(rows, device=device),
            0.0,
            0.0,
            bytes_filters,
            baseline=lambda: _draw(logits, False),
            baseline_name="torch draw",
        ),
        GpuCase(
            f"sampling distribution b={dist_rows} [{engine}]",
            frequencies,
            lambda: exact[top],
            0.02,
            0.0,
            4 * dist_rows * vocab,
            baseline=lambda: _draw(same, False),
            baseline_name="torch draw",
        ),
    ]


def cases(device: torch.device) -> list[GpuCase]:
    args = read_model_args(real_config_dir())
    return build(device, args.vocab_size, 64, 8192)


def smoke_cases(device: torch.device) -> list[GpuCase]:
    """Tiny shapes on the CPU (the torch draw on both columns: flashinfer needs CUDA)."""
    return build(device, 300, 4, 4096)
