"""The output buffer every kernel wrapper takes or makes (one rule for all of them), and the cast back from
what the interpreter stores to what a GPU stores."""

from __future__ import annotations

import torch


def output_buffer(
    out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`out` when it is what the kernel stores into (`shape`, `dtype`, unit last stride; other strides
    free: tests pass a NaN-poisoned view of a larger buffer), else a new buffer; ValueError otherwise."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {list(shape)} {dtype} with unit last stride, got {tuple(out.shape)} "
            f"{out.dtype} strides {out.stride()}"
        )
    return out


def as_gpu_stored(out: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A kernel's output in the dtype a GPU run stores it in. Under the interpreter some kernels store fp32
    where a GPU stores bf16 (their `store_dtype()`: toolchain.md's bf16 rules); this is the cast back, a no-op
    on a GPU, so the step census (bench/census/counter.py) does not count it as a launch."""
    return out if out.dtype == dtype else out.to(dtype)
