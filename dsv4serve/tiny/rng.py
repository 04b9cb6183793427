"""A counter-based random generator whose output is bit-identical on every machine.

torch's samplers may change between versions and use vectorized transcendental functions whose last
bits differ by CPU; this uses only 32-bit integer hashing and exactly rounded float arithmetic.
Integer products are split into 16-bit halves so no int64 operation overflows.
"""

from __future__ import annotations

import zlib

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """(x * m) mod 2**32 for int64 x in [0, 2**32) without int64 overflow."""
    hi, lo = m >> 16, m & 0xFFFF
    return ((((x * hi) & 0xFFFF) << 16) + x * lo) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """The 'lowbias32' integer hash (C. Wellons) on int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_seed(seed: int, name: str) -> int:
    """A per-tensor stream id from the global seed and the tensor's name."""
    return (zlib.crc32(name.encode("utf-8")) ^ (seed * 0x9E3779B9)) & _MASK32


def random_bits(stream: int, numel: int) -> torch.Tensor:
    """`numel` pseudo-random 32-bit values (int64) for one stream."""
    idx = torch.arange(numel, dtype=torch.int64)
    return hash32(hash32((idx + stream) & _MASK32) ^ stream)


def uniform(stream: int, shape: tuple[int, ...], low: float, high: float) -> torch.Tensor:
    """fp32 values uniform in [low, high), exactly reproducible."""
    numel = 1
    for d in shape:
        numel *= d
    unit = random_bits(stream, numel).double() * (2.0**-32)  # exact: a 32-bit integer times 2**-32
    return (low + unit * (high - low)).float().reshape(shape)
