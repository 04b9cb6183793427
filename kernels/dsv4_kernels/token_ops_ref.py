"""Torch references of the per-token chains around the GEMMs (kernels: `token_ops`; dsv4-model.md
§2.2-2.5, §2.10). Each mirrors the model's torch code op for op (dsv4serve/model: layers.RMSNorm,
rope.rope_cos_sin / apply_rope, numerics.fp8_quant_dequant / fp4_quant_dequant / hadamard, the q and
kv lines of attention.Attention.forward, indexer.Indexer.queries, compressor.Compressor's entry
finishing), including where it rounds to the compute dtype:

- RMSNorm: statistics and the weight product in fp32, one rounding at the end;
- the per-head q RMS (no weight): the factor rsqrt(mean(q^2) + eps) is rounded to q's dtype before
  the product (`q * r.to(q.dtype)`), so in bf16 both the factor and the product round;
- RoPE: interleaved pairs (x[2i], x[2i+1]) of the trailing channels, rotated in fp32, rounded once;
- FP8 (e4m3) per 64 channels / FP4 (e2m1) per 32 with ue8m0 scales 2^ceil(log2(max(amax, floor) / max)),
  the last partial block on its own; the Hadamard transform in fp32, rounded to the input's dtype.

`Angles` says where a rotation's angles come from: the model's cos / sin tables, or positions and
frequencies (the kernels then evaluate cos / sin themselves; the reference always uses the model's fp64
evaluation, `rope_cos_sin_ref`). Nothing here imports dsv4serve: tests check these against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsv4_kernels.formats import FP4_MAX, FP8_MAX, pow2_ceil, round_e2m1
from dsv4_kernels.fp8_gemm_ref import FP8_AMAX_FLOOR

FP4_AMAX_FLOOR = 6.0 * 2.0**-126  # dsv4serve.model.numerics.FP4_AMAX_FLOOR
KV_BLOCK = 64  # FP8 block of the KV nope dims
FP4_BLOCK = 32  # FP4 block of the indexer q / k


@dataclass(frozen=True)
class Angles:
    """The RoPE angles of N rows: the model's tables cos, sin [N, R/2] fp32 (`tables`), or positions [N]
    int with freqs [R/2] fp32 (`at`): row n rotates at (positions[n] // window) * window, so a compressor
    entry can name its token's position and the window size instead of its window's first position."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    freqs: torch.Tensor | None = None
    window: int = 1

    @staticmethod
    def tables(cos: torch.Tensor, sin: torch.Tensor) -> Angles:
        if cos.shape != sin.shape or cos.dim() != 2 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
            raise ValueError(f"cos / sin must be fp32 [N, R/2], got {cos.dtype} {tuple(cos.shape)}, {sin.dtype}")
        return Angles(cos=cos, sin=sin)

    @staticmethod
    def at(positions: torch.Tensor, freqs: torch.Tensor, window: int = 1) -> Angles:
        if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"positions must be int32 / int64 [N], got {positions.dtype} {tuple(positions.shape)}")
        if freqs.dim() != 1 or freqs.dtype != torch.float32 or window < 1:
            raise ValueError(f"freqs must be fp32 [R/2] and window >= 1, got {freqs.dtype} {tuple(freqs.shape)}")
        return Angles(positions=positions, freqs=freqs, window=window)

    @property
    def from_positions(self) -> bool:
        return self.positions is not None

    @property
    def rope_dim(self) -> int:
        half = self.freqs if self.from_positions else self.cos
        assert half is not None
        return 2 * half.shape[-1]

    @property
    def num_rows(self) -> int:
        rows = self.positions if self.from_positions else self.cos
        assert rows is not None
        return rows.shape[0]

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, R/2] fp32 tables: as given, or the model's evaluation at the (window-start) positions."""
        if not self.from_positions:
            assert self.cos is not None and self.sin is not None
            return self.cos, self.sin
        assert self.positions is not None and self.freqs is not None
        return rope_cos_sin_ref(self.freqs, (self.positions // self.window) * self.window)


def rope_cos_sin_ref(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] -> cos, sin [N, R/2] fp32: fp32 angles, cos / sin evaluated in fp64 and rounded."""
    angles = positions.to(torch.float32)[:, None] * freqs
    return torch.cos(angles.double()).float(), torch.sin(angles.double()).float()


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; weight None: the attention's per-head form (factor rounded first)."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is None:
        return x * inv_rms.to(x.dtype)
    return (weight.float() * (xf * inv_rms)).to(x.dtype)


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x [N, ..., D] in pairs; cos / sin [N, R/2]."""
    rd = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    s = -s if inverse else s
    pairs = x[..., -rd:].float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd], rotated.to(x.dtype)), dim=-1)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., K] fp32 -> [..., ceil(K / block), block], the last partial block zero-padded."""
    return F.pad(x, (0, (-x.shape[-1]) % block)).unflatten(-1, (-1, block))


def fp8_qdq_ref(x: torch.Tensor, block: int) -> torch.Tensor:
    """e4m3 quantize-dequantize with one ue8m0 scale per `block` channels; x's shape and dtype."""
    xb = _blocks(x.float(), block)
    scale = pow2_ceil(xb.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR) / FP8_MAX)
    q = (xb / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2)[..., : x.shape[-1]].to(x.dtype)


def fp4_qdq_ref(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """e2m1 quantize-dequantize (ties to even) with one ue8m0 scale per `block`; x's shape and dtype."""
    xb = _blocks(x.float(), block)
    scale = pow2_ceil(xb.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_AMAX_FLOOR) / FP4_MAX)
    q = round_e2m1((xb / scale).clamp(-FP4_MAX, FP4_MAX))
    return (q * scale).flatten(-2)[..., : x.shape[-1]].to(x.dtype)


def hadamard_ref(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim (a power of two): fp32 butterflies."""
    n = x.shape[-1]
    y = x.float()
    h = 1
    while h < n:  # stage h: pairs (i, i + h) inside blocks of 2h
        y = y.unflatten(-1, (-1, 2, h))
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2).flatten(-3)
        h *= 2
    return (y * n**-0.5).to(x.dtype)


def _fp8_nope(x: torch.Tensor, nope_dims: int, block: int) -> torch.Tensor:
    return torch.cat((fp8_qdq_ref(x[..., :nope_dims], block), x[..., nope_dims:]), dim=-1)


def q_head_norm_rope_ref(q: torch.Tensor, angles: Angles, eps: float) -> torch.Tensor:
    """q [N, H, d] -> per-head RMS (no weight), then RoPE (Attention.forward's q lines)."""
    return apply_rope_ref(rms_norm_ref(q, None, eps), *angles.cos_sin())


def kv_norm_rope_quant_ref(
    kv: torch.Tensor, weight: torch.Tensor, eps: float, angles: Angles, nope_dims: int, fp8_block: int, kv_fp8: bool
) -> torch.Tensor:
    """kv [N, d] -> RMSNorm, RoPE, FP8 on the nope dims when kv_fp8 (Attention.forward's kv lines)."""
    kv = apply_rope_ref(rms_norm_ref(kv, weight, eps), *angles.cos_sin())
    return _fp8_nope(kv, nope_dims, fp8_block) if kv_fp8 else kv


def rope_ref(x: torch.Tensor, angles: Angles, inverse: bool) -> torch.Tensor:
    """x [N, H, d] or [N, d] rotated on its trailing channels (the attention output's inverse RoPE)."""
    return apply_rope_ref(x, *angles.cos_sin(), inverse=inverse)


def indexer_q_ref(q: torch.Tensor, angles: Angles, fp4: bool) -> torch.Tensor:
    """q [N, H_I, d_I] -> RoPE, then Hadamard and FP4 when fp4 (Indexer.queries)."""
    q = apply_rope_ref(q, *angles.cos_sin())
    return fp4_qdq_ref(hadamard_ref(q), FP4_BLOCK) if fp4 else q


def compressed_entry_ref(
    pooled: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    angles: Angles,
    mode: str,
    out_dtype: torch.dtype,
    nope_dims: int = 0,
    fp8_block: int = KV_BLOCK,
) -> torch.Tensor:
    """pooled [W, d] fp32 -> the compute dtype, RMSNorm, RoPE at each window's first position, then by mode:
    "kv" FP8 on the nope dims, "index" Hadamard + FP4, "plain" nothing (Compressor.update / _simulate)."""
    entry = apply_rope_ref(rms_norm_ref(pooled.to(out_dtype), weight, eps), *angles.cos_sin())
    if mode == "kv":
        return _fp8_nope(entry, nope_dims, fp8_block)
    if mode == "index":
        return fp4_qdq_ref(hadamard_ref(entry), FP4_BLOCK)
    if mode != "plain":
        raise ValueError(f"mode must be 'kv', 'index' or 'plain', got {mode!r}")
    return entry
