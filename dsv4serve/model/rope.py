"""Interleaved rotary embeddings on the trailing `rope_head_dim` channels (dsv4-model.md §2.2).

Window-only layers use `rope_theta` without scaling; compressed layers (CSA / HCA, including their
compressors and the indexer) use `compress_rope_theta` with YaRN frequency blending and no
magnitude correction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dsv4serve.model.args import ModelArgs
from dsv4serve.model.numerics import in_fp64


def _correction_dim(n_rotations: float, dim: int, base: float, seq_len: int) -> float:
    return dim * math.log(seq_len / (n_rotations * 2 * math.pi)) / (2 * math.log(base))


def inv_freq(args: ModelArgs, compressed_layer: bool) -> torch.Tensor:
    """[rope_head_dim / 2] fp32 angular frequencies for a layer kind."""
    dim = args.rope_head_dim
    base = args.compress_rope_theta if compressed_layer else args.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if not compressed_layer or args.original_seq_len <= 0:
        return freqs
    low = max(math.floor(_correction_dim(args.beta_fast, dim, base, args.original_seq_len)), 0)
    high: float = min(math.ceil(_correction_dim(args.beta_slow, dim, base, args.original_seq_len)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: keep the frequency, 0: divide it by the factor
    return freqs / args.rope_factor * (1 - keep) + freqs * keep


def rope_cos_sin(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] int -> cos, sin [N, rope_head_dim / 2] fp32 (fp32 angles, as the reference;
    cos / sin in fp64 for batch invariance, see numerics.in_fp64)."""
    angles = positions.to(torch.float32)[:, None] * freqs
    return in_fp64(torch.cos, angles), in_fp64(torch.sin, angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*len(cos) channels of x [N, ..., D] in pairs (x[2i], x[2i+1]).

    cos / sin are [N, R/2] and broadcast over the middle dims. `inverse` applies the conjugate.
    """
    rd = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    if inverse:
        s = -s
    pairs = x[..., -rd:].float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd], rotated.to(x.dtype)), dim=-1)


@dataclass(frozen=True)
class Rotation:
    """The RoPE of a batch's tokens, computed once per layer: the torch tables (cos, sin), or, with the
    token_ops kernels on Triton, their `Angles` (positions + freqs: the kernels evaluate cos / sin
    themselves, so the tables cost no launch)."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    angles: Any = None  # dsv4_kernels.token_ops.Angles

    @classmethod
    def of(cls, freqs: torch.Tensor, positions: torch.Tensor, kernels: bool) -> Rotation:
        if kernels:
            from dsv4_kernels.token_ops import Angles

            return cls(angles=Angles.at(positions, freqs))
        cos, sin = rope_cos_sin(freqs, positions)
        return cls(cos, sin)

    def apply(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """`apply_rope` with these angles (the token_ops `rope` kernel when they are kernel angles)."""
        if self.angles is not None:
            from dsv4_kernels.token_ops import rope

            return rope(x, self.angles, inverse=inverse)
        assert self.cos is not None and self.sin is not None
        return apply_rope(x, self.cos, self.sin, inverse=inverse)
