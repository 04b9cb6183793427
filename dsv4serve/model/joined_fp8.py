"""Two FP8 projections of one input in one GEMM launch (issue 16: launches a layer).

The attention's wq_a [q_lora, D] and wkv [head_dim, D] both read the attn_norm output. With the FP8 GEMM on
Triton each was its own launch; `JoinedFp8` holds their packed weights as one [q_lora + head_dim, D] e4m3
tensor (and one e8m0 scale tensor), each Linear's `weight_fp8` / `weight_fp8_scale` becoming a view of its
rows: no second copy, every other reader (the sharding, the memory plan, a Linear called alone) sees its own
weight as before. One launch then writes [N, q_lora + head_dim]; the callers read column views of it (the
token_ops kernels and the torch norms take any row stride).

Each output column is the same dot product over the same K blocks as in its own launch: the joined launch
differs only in how many N tiles it runs (and, on a card whose tuning file has no entry for the joined shape,
in the K split it takes: the largest its parts were tuned to, until bench/gpu_fp8_sweep.py measures it).

The joint holds while both Linears still read views of its tensors (`holds`): a module moved or reloaded
(new tensors) falls back to the two launches, as before.
"""

from __future__ import annotations

import torch

from dsv4_kernels.fp8_gemm_ref import FP8_BLOCK  # the weight scales' block along N (and K)
from dsv4serve.model.layers import Linear


class JoinedFp8:
    def __init__(self, first: Linear, second: Linear):
        """Stack the packed weights of `first` then `second` (same input width; `first`'s rows a whole number
        of scale blocks, so that the scales stack as rows too). Both must hold packed FP8 weights."""
        if not self.fits(first, second):
            raise ValueError(
                "joining needs both projections packed (pack_fp8 / load_fp8), one input width and device, "
                f"and the first's rows whole {FP8_BLOCK}-row scale blocks"
            )
        a, b = first.weight_fp8, second.weight_fp8
        sa, sb = first.weight_fp8_scale, second.weight_fp8_scale
        assert a is not None and b is not None and sa is not None and sb is not None  # fits
        self.first, self.second = first, second
        self.rows = a.shape[0]
        with torch.inference_mode(False), torch.no_grad():  # normal tensors: a later in-place load lands in them
            self.weight = torch.cat((a, b))
            self.scale = torch.cat((sa, sb))
        cut = self.rows // FP8_BLOCK
        first.weight_fp8, first.weight_fp8_scale = self.weight[: self.rows], self.scale[:cut]
        second.weight_fp8, second.weight_fp8_scale = self.weight[self.rows :], self.scale[cut:]

    @staticmethod
    def fits(first: Linear, second: Linear) -> bool:
        """Whether the two can be joined: both packed, one input width, `first` whole scale blocks."""
        a, b = first.weight_fp8, second.weight_fp8
        if a is None or b is None or first.weight_fp8_scale is None or second.weight_fp8_scale is None:
            return False
        return a.shape[1] == b.shape[1] and a.device == b.device and a.shape[0] % FP8_BLOCK == 0

    def holds(self) -> bool:
        """Both Linears still read views of the joined tensors (host-side pointer checks, no device work)."""
        cut = self.rows // FP8_BLOCK
        pairs = (
            (self.first.weight_fp8, self.weight),
            (self.second.weight_fp8, self.weight[self.rows :]),
            (self.first.weight_fp8_scale, self.scale),
            (self.second.weight_fp8_scale, self.scale[cut:]),
        )
        return all(view is not None and view.data_ptr() == whole.data_ptr() for view, whole in pairs)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] bf16 / fp32 raw (the kernel quantizes it) -> (first's [N, rows], second's) bf16 column
        views of one launch's output."""
        from dsv4_kernels.fp8_gemm import fp8_linear  # lazy: kernel modules build their kernels on import

        parts = (self.rows, self.weight.shape[0] - self.rows)
        out = fp8_linear(x, self.weight, self.scale, parts=parts)
        return out[:, : self.rows], out[:, self.rows :]
