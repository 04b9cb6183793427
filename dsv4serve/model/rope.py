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


def pair_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The half tables cos / sin [N, R/2] -> the per-channel tables [N, R] that `rotate` reads: cos twice per
    pair, and (-sin, sin): channel 2i takes -sin * x[2i+1], channel 2i+1 takes sin * x[2i]."""
    return torch.stack((cos, cos), dim=-1).flatten(-2), torch.stack((-sin, sin), dim=-1).flatten(-2)


def rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing cos2.shape[-1] channels of x [N, ..., D] in pairs with the per-channel tables of
    `pair_tables` ([N, R], broadcast over the middle dims); `inverse` applies the conjugate.

    x * cos2 + swap(x) * sin2, in fp32: per channel the same two products and one sum as
    (even c - odd s, even s + odd c) (a - b = a + (-b) and a + b = b + a hold exactly in IEEE arithmetic), bit
    for bit, in about half the torch ops (a decode step rotates ~5 tensors a layer)."""
    rd = cos2.shape[-1]
    shape = (cos2.shape[0],) + (1,) * (x.dim() - 2) + (rd,)
    c, s = cos2.view(shape), sin2.view(shape)
    head = x[..., -rd:].float()
    swapped = head.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x[2i+1], x[2i]) per pair
    rotated = head * c
    rotated = rotated.sub_(swapped * s) if inverse else rotated.add_(swapped * s)
    out = x.clone(memory_format=torch.contiguous_format)  # contiguous, as the torch.cat it replaced
    out[..., -rd:] = rotated  # rounded to x's dtype as .to() rounds
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*len(cos) channels of x [N, ..., D] in pairs (x[2i], x[2i+1]).

    cos / sin are [N, R/2] and broadcast over the middle dims. `inverse` applies the conjugate.
    """
    return rotate(x, *pair_tables(cos, sin), inverse=inverse)


@dataclass(frozen=True)
class Rotation:
    """The RoPE of a batch's tokens, computed once per layer: the torch path's per-channel tables
    (`pair_tables`: made once for the layer's ~5 rotations), or, with the token_ops kernels on Triton, their
    `Angles` (positions + freqs: the kernels evaluate cos / sin themselves, so the tables cost no launch)."""

    pairs: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos2, sin2) [N, rope_head_dim]
    angles: Any = None  # dsv4_kernels.token_ops.Angles

    @classmethod
    def of(cls, freqs: torch.Tensor, positions: torch.Tensor, kernels: bool) -> Rotation:
        if kernels:
            from dsv4_kernels.token_ops import Angles

            return cls(angles=Angles.at(positions, freqs))
        return cls.from_tables(*rope_cos_sin(freqs, positions))

    @classmethod
    def from_tables(cls, cos: torch.Tensor, sin: torch.Tensor) -> Rotation:
        """The torch path's rotation from the half tables cos / sin [N, rope_head_dim / 2] (`rope_cos_sin`)."""
        return cls(pairs=pair_tables(cos, sin))

    def apply(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """`apply_rope` with these angles (the token_ops `rope` kernel when they are kernel angles)."""
        if self.angles is not None:
            from dsv4_kernels.token_ops import rope

            return rope(x, self.angles, inverse=inverse)
        assert self.pairs is not None
        return rotate(x, *self.pairs, inverse=inverse)
