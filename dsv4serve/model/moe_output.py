"""The MoE layer's output with its combine left to the launch that reads it (issue 16: launches a layer).

On the MXFP4 kernel a layer's output is the sum of its k per-route outputs and what the layer adds (the shared
expert's output; under hybrid the CPU experts' part first), cast to the compute dtype: dsv4_kernels.moe_combine,
one launch. The next thing every block does with it is the mHC post, one launch more; with the mHC kernel on
Triton that launch forms the sum itself (dsv4_kernels.hc_post_combine, the same bits) and the [N, D] output is
never stored. `Combined` carries the parts to it; any other reader takes `value()`, the moe_combine launch's
output, made once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Combined:
    pairs: torch.Tensor  # [N, k, D] the per-route outputs
    addends: tuple[torch.Tensor, ...]  # [N, D] each, added in order after the routes
    dtype: torch.dtype  # the output's: the compute dtype
    _value: torch.Tensor | None = None

    def value(self) -> torch.Tensor:
        """[N, D] in `dtype`: the combine as its own launch."""
        if self._value is None:
            from dsv4_kernels.moe_combine import moe_combine  # lazy: kernel modules build their kernels on import

            self._value = moe_combine(self.pairs, self.addends, self.dtype)
        return self._value
