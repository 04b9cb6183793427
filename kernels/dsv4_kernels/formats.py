"""The checkpoint's number formats: FP8 e4m3 with ue8m0 block scales, MXFP4 (e2m1 + e8m0 per 32).

Facts (DeepSeek `inference/convert.py`, `kernel.py`; OCP MX spec), written down in dsv4-model.md §3.3-3.4:
- e8m0 / ue8m0: one byte, value 2**(byte - 127); byte 255 is NaN; there is no sign and no zero.
- FP8 weights: e4m3fn values, one scale per 128 x 128 block, scale shape [ceil(out/128), ceil(in/128)].
- FP4 weights: e2m1 codes packed two per byte along K (low nibble = even K index), stored as int8
  [out, in/2], with one e8m0 scale per 32 consecutive K elements, scale shape [out, in/32].

Dequantization is exact: every e2m1 and e4m3 value times a power of two is representable in fp32.
The quantizers here (used to build `dsv4-tiny`) use only exact operations (frexp, power-of-two
division, correctly rounded casts) so the bytes they produce are the same on every machine.
"""

from __future__ import annotations

import functools

import torch

E8M0_BIAS = 127
FP8_MAX = 448.0  # largest finite e4m3fn value
FP4_MAX = 6.0  # largest e2m1 value
FP4_BLOCK_K = 32

# code -> value, for the 16 e2m1 codes (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode e8m0 bytes (dtype float8_e8m0fnu or uint8) to fp32 powers of two; 255 becomes NaN."""
    raw = scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale
    if raw.dtype != torch.uint8:
        raise TypeError(f"e8m0 scales must be float8_e8m0fnu or uint8, got {scale.dtype}")
    exponent = raw.to(torch.int32) - E8M0_BIAS
    out = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
    return torch.where(raw == 255, torch.full_like(out, float("nan")), out)


def float_to_e8m0(pow2: torch.Tensor) -> torch.Tensor:
    """Encode exact powers of two (fp32) as e8m0 bytes (dtype float8_e8m0fnu)."""
    mantissa, exponent = torch.frexp(pow2.float())
    if not bool(torch.all(mantissa == 0.5)):
        raise ValueError("e8m0 can only hold powers of two")
    biased = exponent.to(torch.int32) - 1 + E8M0_BIAS
    if bool(torch.any((biased < 0) | (biased > 254))):
        raise ValueError("scale exponent outside the e8m0 range")
    return biased.to(torch.uint8).view(torch.float8_e8m0fnu)


def _expand_blocks(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    """[ceil(rows/br), ceil(cols/bc)] -> [rows, cols], cropping the partial blocks at the edges."""
    return scale.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)[:rows, :cols]


def dequant_fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128), dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """FP8 e4m3 [out, in] with e8m0 scales [ceil(out/bo), ceil(in/bi)] -> dense [out, in]."""
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    out_dim, in_dim = weight.shape
    bo, bi = block
    expected = (-(-out_dim // bo), -(-in_dim // bi))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"FP8 scale shape {tuple(scale.shape)} does not fit weight {tuple(weight.shape)} "
            f"with {bo}x{bi} blocks (expected {expected})"
        )
    s = _expand_blocks(e8m0_to_float(scale), out_dim, in_dim, bo, bi)
    return (weight.float() * s).to(dtype)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [..., K/2] -> e2m1 codes uint8 [..., K]; the low nibble is the even K index."""
    raw = packed.view(torch.uint8)
    low, high = raw & 0x0F, raw >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes uint8 [..., K] (K even) -> int8 [..., K/2], low nibble = even K index."""
    if codes.shape[-1] % 2:
        raise ValueError("FP4 packing needs an even K")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)


@functools.cache
def _e2m1_table(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The first n e2m1 values, made once per (dtype, device): on a GPU each torch.tensor(...) from host
    data is a blocking copy, and these run per layer."""
    with torch.inference_mode(False), torch.no_grad():
        return torch.tensor(E2M1_VALUES[:n], dtype=dtype, device=device)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 int8 [out, in/2] with e8m0 scales [out, in/32] -> dense [out, in]."""
    out_dim, half_k = packed.shape
    k = 2 * half_k
    if tuple(scale.shape) != (out_dim, -(-k // FP4_BLOCK_K)):
        raise ValueError(
            f"FP4 scale shape {tuple(scale.shape)} does not fit weight [{out_dim}, {k}] "
            f"(expected [{out_dim}, {-(-k // FP4_BLOCK_K)}])"
        )
    values = _e2m1_table(16, torch.float32, packed.device)[unpack_fp4(packed).long()]
    s = e8m0_to_float(scale).repeat_interleave(FP4_BLOCK_K, 1)[:, :k]
    return (values * s).to(dtype)


def pow2_ceil(ratio: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= ratio (ratio > 0), computed exactly (the ue8m0 scale rule)."""
    mantissa, exponent = torch.frexp(ratio)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # exact powers of two stay
    return torch.ldexp(torch.ones_like(ratio), exponent)


def _pow2_scale(amax: torch.Tensor, max_code: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= max_code (amax floored at 1e-4 as the reference does)."""
    return pow2_ceil(torch.clamp(amax.float(), min=1e-4) / max_code)


def round_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, sign in bit 3) of the e2m1 values nearest to v (|v| <= 6); a tie goes to the even
    code, as a hardware cast rounds."""
    mags = _e2m1_table(8, torch.float32, v.device)
    dist = (v.float().abs().unsqueeze(-1) - mags).abs()  # [..., 8]
    ties = dist == dist.min(dim=-1, keepdim=True).values
    codes = torch.arange(8, device=v.device)
    rank = torch.where(ties, (codes % 2) * 16 + codes, torch.full_like(codes, 1 << 10))
    code = rank.argmin(dim=-1).to(torch.uint8)
    return torch.where(torch.signbit(v) & (code != 0), code | 0x8, code)


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """v rounded to the nearest e2m1 value (ties to the even code), in v's dtype, sign kept."""
    mags = _e2m1_table(8, v.dtype, v.device)
    return torch.copysign(mags[(round_e2m1_codes(v) & 0x7).long()], v)


def quant_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [out, in] -> (float8_e4m3fn [out, in], e8m0 scales [ceil(out/bo), ceil(in/bi)])."""
    out_dim, in_dim = weight.shape
    bo, bi = block
    nbo, nbi = -(-out_dim // bo), -(-in_dim // bi)
    padded = torch.zeros(nbo * bo, nbi * bi, dtype=torch.float32, device=weight.device)
    padded[:out_dim, :in_dim] = weight.float()
    amax = padded.view(nbo, bo, nbi, bi).abs().amax(dim=(1, 3))
    scale = _pow2_scale(amax, FP8_MAX)
    q = (weight.float() / _expand_blocks(scale, out_dim, in_dim, bo, bi)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), float_to_e8m0(scale)


def quant_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [out, in] (in divisible by 32) -> (int8 packed [out, in/2], e8m0 scales [out, in/32]).

    Each value is rounded to the nearest e2m1 value (a tie goes to the even code) after dividing by
    its block's power-of-two scale.
    """
    out_dim, in_dim = weight.shape
    if in_dim % FP4_BLOCK_K:
        raise ValueError(f"FP4 quantization needs K divisible by {FP4_BLOCK_K}, got {in_dim}")
    blocks = weight.float().view(out_dim, in_dim // FP4_BLOCK_K, FP4_BLOCK_K)
    scale = _pow2_scale(blocks.abs().amax(dim=-1), FP4_MAX)
    x = (blocks / scale.unsqueeze(-1)).flatten(1).clamp(-FP4_MAX, FP4_MAX)
    return pack_fp4(round_e2m1_codes(x)), float_to_e8m0(scale)
