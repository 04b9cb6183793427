"""flashinfer's sort-free sampling kernels for the draw of a CUDA step (issue 16: "use flashinfer where it
serves on the GPU"); torch everywhere else (worker/sampling.py).

The torch draw sorts every sampled row's full vocabulary for top-p ([B, 129,280] per step) and makes an
exponential-race noise tensor of the same size; flashinfer's `top_k_top_p_sampling_from_logits` samples by
rejection without a sort, in one fused kernel (https://flashinfer.ai/2025/03/10/sampling.html). Same
distribution, other random numbers: a row's token may differ from the torch draw's for the same state of
the generator, which matters only for seeded rows, so those keep the torch path.

When flashinfer draws (`fast_path`, decided on the host from what the rows ask, no device read):
- the logits are on CUDA and flashinfer imports (`DSV4SERVE_FLASHINFER_SAMPLING=0` turns it off: env.py);
- no row is seeded (one generator, the step's shared one, drives every row: flashinfer takes one);
- no row asks for min-p (our order is top-k -> top-p -> min-p, which its fused kernel does not do).
The stages before the draw (penalties, masks, bias, grammar, forced tokens) and the temperature are the
torch path's, on the same tensor; top-k 0 (off) becomes k = V and no top-p becomes p = 1, flashinfer's
"no filter" values. Greedy rows in a mixed batch keep their argmax (sampling.sample does that).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from types import ModuleType

import torch

from dsv4serve.env import read_environment
from dsv4serve.worker.sampler_inputs import SamplerInputs, SamplingRow


@functools.cache
def _import_flashinfer_sampling() -> ModuleType | None:
    try:
        return importlib.import_module("flashinfer.sampling")
    except Exception:  # not installed, or built for another torch / CUDA: the torch draw serves
        return None


@functools.cache
def _enabled() -> bool:
    return read_environment().flashinfer_sampling  # read once per process: this runs every step


def flashinfer_sampling(device: torch.device) -> ModuleType | None:
    """flashinfer.sampling when it can serve a step on `device`, else None."""
    if device.type != "cuda" or not _enabled():
        return None
    return _import_flashinfer_sampling()


def fast_path(x: SamplerInputs, rows: Sequence[SamplingRow]) -> bool:
    """Whether flashinfer's fused kernel draws these rows exactly as the torch stages would (module doc)."""
    return not x.all_greedy and x.min_p is None and x.num_shared == len(rows)


def draw_flashinfer(
    sampling: ModuleType, work: torch.Tensor, x: SamplerInputs, generator: torch.Generator | None
) -> torch.Tensor:
    """work [B, V] fp32 after the masking stages (modified: divided by the temperature) -> [B] int64."""
    vocab = work.shape[1]
    if x.temperature is not None:
        work.div_(x.temperature[:, None])
    top_k: torch.Tensor | int = vocab
    if x.top_k is not None:
        top_k = torch.where(x.top_k > 0, x.top_k, vocab).to(torch.int32)
    top_p: torch.Tensor | float = 1.0 if x.top_p is None else x.top_p
    ids = sampling.top_k_top_p_sampling_from_logits(
        work, top_k, top_p, filter_apply_order="top_k_first", deterministic=True, generator=generator
    )
    return ids.long()
