"""The per-token chains around the GEMMs, one Triton launch each (dsv4-model.md §2.2-2.5, §2.10).
References: `token_ops_ref` (the model's torch code, op for op). One kernel, `token_rows_kernel`, runs a
chain on rows of D channels (a token's heads, or a token): [optional] RMSNorm -> [optional] RoPE on the
trailing channels -> [optional] FP8 on the leading (nope) channels, or Hadamard + FP4; the wrappers pick
the steps with constexprs:

  rms_norm           x [N, D] (any D), weight [D] or None (the per-head form)   RMSNorm
  q_head_norm_rope   q [N, H, d]                                              per-head RMS, RoPE
  kv_norm_rope_quant kv [N, d], weight [d]                                    RMSNorm, RoPE, FP8 nope (kv_fp8)
  rope               x [N, H, d] or [N, d] (out may be x: in place)           RoPE or its inverse
  indexer_q          q [N, H_I, d_I] (d_I a power of two)                     RoPE, Hadamard + FP4 (fp4)
  compressed_entry   pooled [W, d] fp32 -> the compute dtype                  RMSNorm, RoPE, mode's simulation

Inputs bf16 or fp32, output in the compute dtype (x's; the entry's `out_dtype`); arithmetic in fp32,
rounded to bf16 wherever the model rounds to its compute dtype (after the norm, the rotation, the
Hadamard), by bits (`_round_bf16`), so the interpreter's truncating casts never round anything.

Angles (`Angles`): the model computes cos / sin per layer in torch (fp32 angles, cos / sin in fp64 for
batch invariance; ~8 launches, plus the compressors' own at window positions). The kernels take either
those tables or positions + freqs and evaluate cos / sin of the same fp32 angles themselves, in fp32:
that folds rope_cos_sin into every consumer (q, kv, indexer q, inverse RoPE, compressor entries: no
launch of its own), and `Angles.at(positions, freqs, window=ratio)` rotates a compressor entry at its
window's first position straight from the token positions. Cost: fp32 cos / sin are within ~2 ulp of the
fp64-rounded tables (libdevice cosf / sinf with full range reduction on a GPU; numpy under the
interpreter), so a rotated value can differ from the model's by one ulp of the compute dtype; given the
tables, the rotation is the model's bit for bit.

What is exact: the quantizers (e4m3 / e2m1, ties to even, ue8m0 scales, amax floors, partial last
blocks), the Hadamard sums (the reference's butterfly order) and every rounding; the RMS statistics sum
in tile order, not torch's, and on a GPU the rotation's products fuse into FMAs, so a normed or rotated
value can differ by an ulp (and an FP8 / FP4 rounding downstream then by a step).
tests/kernels/test_token_ops.py states the tolerances.

Grid: (cdiv(N x H, BLOCK_R),); a program holds BLOCK_R whole rows (~4K fp32) of the N x H (token, head) rows in
order, a token's heads and, where they fit, the next tokens' rows: so decode (N = 1) and prefill run the same
program, and a prefill of narrow rows (one kv row of 512 a token) takes 8 tokens a program, not one (under the
Triton interpreter, where each program costs its ~100 ops' Python whatever its size, a whole-model test takes
minutes less). Every step works on one row, so a row's values do not depend on its neighbours. Shapes are static
per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4_kernels.outputs import output_buffer
from dsv4_kernels.token_ops_ref import FP4_BLOCK, KV_BLOCK, Angles
from dsv4_kernels.token_ops_tiles import _angles, _fp4_blocks, _fp8_blocks, _hadamard, _inv_rms, _rotate, _round_bf16

__all__ = ["Angles", "compressed_entry", "indexer_q", "kv_norm_rope_quant", "q_head_norm_rope", "rms_norm", "rope"]

NORM_NONE, NORM_WEIGHTED, NORM_PER_HEAD = 0, 1, 2
QUANT_NONE, QUANT_FP8, QUANT_HADAMARD_FP4 = 0, 1, 2
TILE_ELEMENTS = 4096  # fp32 values a program holds: 32 a thread at 4 warps


@triton.jit
def token_rows_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    freq_ptr,
    out_ptr,
    n_rows,
    n_heads,
    stride_xn,
    stride_xh,
    stride_on,
    stride_oh,
    stride_cs,
    window,
    eps,
    hadamard_scale,
    ring_ptr,
    ring_slot_ptr,
    ring_pos_ptr,
    stride_ring_slot,
    stride_ring_pos,
    ring_window,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    FROM_POSITIONS: tl.constexpr,
    INVERSE: tl.constexpr,
    QUANT: tl.constexpr,
    QUANT_DIM: tl.constexpr,
    FP8_BLOCK: tl.constexpr,
    HADAMARD_STAGES: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    ONE_TOKEN: tl.constexpr,
    RING: tl.constexpr = False,
):
    """out rows r0 .. r0 + BLOCK_R of the n_rows = N x n_heads rows (token r // n_heads, head r % n_heads), each
    of D channels, r0 = program_id(0) * BLOCK_R. Every step works on a row alone (the norm's sum along the row),
    so a row's values never depend on the rows that share its program. ONE_TOKEN: BLOCK_R divides n_heads, so a
    program's rows are one token's heads and its cos / sin are evaluated once (a [1, BLOCK_D / 2] tile). RING
    (one-head rows, one token a sequence: a decode step's keys): each row is also stored into its sequence's window
    ring, at ring[ring_slot[token], ring_pos[token] % ring_window]."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < n_rows
    r = tl.where(r_ok, r, 0)
    tok = r // n_heads
    head = r % n_heads
    chans = tl.arange(0, BLOCK_D)
    mask = r_ok[:, None] & (chans < D)[None, :]
    x_ptrs = x_ptr + (tok.to(tl.int64) * stride_xn + head * stride_xh)[:, None] + chans[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_D], zeros outside
    if ROUND_BF16:  # the compute dtype: a no-op on bf16 input, the compressor's fp32 pooled entry rounds
        x = _round_bf16(x)
    if NORM == 1:  # RMSNorm with weight: (w * (x * r)), one rounding
        w = tl.load(w_ptr + chans, mask=chans < D, other=0.0).to(tl.float32)
        x = w[None, :] * (x * _inv_rms(x, D, eps)[:, None])
    elif NORM == 2:  # the per-head form: r rounded to the compute dtype, then the product
        inv_rms = _inv_rms(x, D, eps)
        if ROUND_BF16:
            inv_rms = _round_bf16(inv_rms)
        x = x * inv_rms[:, None]
    if ROUND_BF16 and NORM != 0:
        x = _round_bf16(x)
    if ROPE_DIM > 0:  # one token's angles for the whole tile when its rows are that token's heads, else a row's own
        at = tok
        if ONE_TOKEN:
            at = tl.zeros((1,), tl.int32) + tl.program_id(0) * BLOCK_R // n_heads
        cos, sin, rotated = _angles(
            at, cos_ptr, sin_ptr, pos_ptr, freq_ptr, stride_cs, window, D, ROPE_DIM, BLOCK_D, FROM_POSITIONS, INVERSE
        )
        x = _rotate(x, cos, sin, rotated, BLOCK_R, BLOCK_D, ROUND_BF16)
    if QUANT == 1:  # dequantized e4m3 values are exact in bf16: no rounding after
        x = _fp8_blocks(x, QUANT_DIM, FP8_BLOCK, BLOCK_R, BLOCK_D)
    elif QUANT == 2:
        x = _hadamard(x, hadamard_scale, HADAMARD_STAGES, BLOCK_R, BLOCK_D)
        if ROUND_BF16:
            x = _round_bf16(x)
        x = _fp4_blocks(x, QUANT_DIM, BLOCK_R, BLOCK_D)
    out_ptrs = out_ptr + (tok.to(tl.int64) * stride_on + head * stride_oh)[:, None] + chans[None, :]
    tl.store(out_ptrs, x.to(out_ptr.dtype.element_ty), mask=mask)
    if RING:
        slot = tl.load(ring_slot_ptr + tok).to(tl.int64)
        at = tl.load(ring_pos_ptr + tok) % ring_window
        ring_ptrs = ring_ptr + (slot * stride_ring_slot + at * stride_ring_pos)[:, None] + chans[None, :]
        tl.store(ring_ptrs, x.to(ring_ptr.dtype.element_ty), mask=mask)


def _rows3(x: torch.Tensor) -> torch.Tensor:
    """[N, D] -> [N, 1, D] (a view); [N, H, D] as is; the channels contiguous."""
    if x.dim() not in (2, 3):
        raise ValueError(f"need [N, D] or [N, H, D], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"need bf16 or fp32 input, got {x.dtype}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x.unsqueeze(1) if x.dim() == 2 else x


def _tile(d: int, n_rows: int, quant: int, fp8_block: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D): whole rows (padded to a power of two, and to whole quantization blocks), as many of the
    call's n_rows (tokens x heads) as fit TILE_ELEMENTS."""
    block_d = max(triton.next_power_of_2(d), 2, fp8_block if quant == QUANT_FP8 else 1, FP4_BLOCK if quant else 1)
    return min(triton.next_power_of_2(n_rows), max(1, TILE_ELEMENTS // block_d)), block_d


def _angle_args(angles: Angles | None, dummy: torch.Tensor) -> tuple:
    """The kernel's (cos, sin, pos, freq) pointers, the tables' row stride and the window; `dummy` for the
    pointers it does not read."""
    if angles is None:
        return dummy, dummy, dummy, dummy, 0, 1
    if angles.from_positions:
        return dummy, dummy, angles.positions, angles.freqs, 0, angles.window
    cos, sin = angles.cos, angles.sin
    assert cos is not None and sin is not None
    if cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError(f"cos / sin need one layout with contiguous rows, got strides {cos.stride()}, {sin.stride()}")
    return cos, sin, dummy, dummy, cos.stride(0), 1


def _launch(
    x: torch.Tensor,
    out: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    weight: torch.Tensor | None = None,
    eps: float = 0.0,
    norm: int = NORM_NONE,
    angles: Angles | None = None,
    inverse: bool = False,
    quant: int = QUANT_NONE,
    quant_dim: int = 0,
    fp8_block: int = KV_BLOCK,
    ring: Ring | None = None,
) -> torch.Tensor:
    """Run one chain on x [N, D] or [N, H, D] into `out` (x's shape, out_dtype); see the module doc. `ring`: [N, D]
    rows also go into their window rings (`Ring`)."""
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the compute dtype must be bf16 or fp32, got {out_dtype}")
    x3 = _rows3(x)
    n_rows, n_heads, d = x3.shape
    out = output_buffer(out, tuple(x.shape), out_dtype, x.device)
    out3 = out.unsqueeze(1) if out.dim() == 2 else out
    rope_dim = angles.rope_dim if angles is not None else 0
    if angles is not None and (angles.num_rows != n_rows or rope_dim > d or d % 2):
        raise ValueError(f"angles for {angles.num_rows} rows of rope dim {rope_dim} do not fit {tuple(x.shape)}")
    if weight is not None and (weight.shape != (d,) or weight.stride(0) != 1):
        raise ValueError(f"weight must be a contiguous [{d}], got {tuple(weight.shape)}")
    stages = d.bit_length() - 1
    if quant == QUANT_HADAMARD_FP4 and d != 1 << stages:
        raise ValueError(f"the Hadamard transform needs a power-of-two dim, got {d}")
    ring_args = (x3, x3, x3, 0, 0, 1) if ring is None else ring.args(n_rows, n_heads, d, out_dtype)
    if n_rows == 0 or n_heads == 0:
        return out
    rows = n_rows * n_heads
    block_r, block_d = _tile(d, rows, quant, fp8_block)
    dummy = x3  # pointers a chain does not read
    cos, sin, pos, freqs, stride_cs, window = _angle_args(angles, dummy)
    token_rows_kernel[(triton.cdiv(rows, block_r),)](
        x3,
        weight if weight is not None else dummy,
        cos,
        sin,
        pos,
        freqs,
        out3,
        rows,
        n_heads,
        x3.stride(0),
        x3.stride(1),
        out3.stride(0),
        out3.stride(1),
        stride_cs,
        window,
        eps,
        d**-0.5,
        *ring_args,
        D=d,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        NORM=norm,
        ROPE_DIM=rope_dim,
        FROM_POSITIONS=angles is not None and angles.from_positions,
        INVERSE=inverse,
        QUANT=quant,
        QUANT_DIM=quant_dim,
        FP8_BLOCK=fp8_block,
        HADAMARD_STAGES=stages if quant == QUANT_HADAMARD_FP4 else 0,
        ROUND_BF16=out_dtype == torch.bfloat16,
        ONE_TOKEN=n_heads % block_r == 0,
        RING=ring is not None,
    )
    return out


@dataclass(frozen=True)
class Ring:
    """A decode step's window rings (model/attention_decode.store_window's layout): `swa` [slots, W, D] in the
    compute dtype, `slots` and `positions` [N] int32, one token a sequence: row n's key lands at
    swa[slots[n], positions[n] % W]. A row's key must reach its ring before the step's attention only when no
    key of the step is still to be read from where it lands: one token a row (the attention reads p - W + 1 ..
    p - 1 from the ring, p % W is none of them)."""

    swa: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor

    def args(self, n_rows: int, n_heads: int, d: int, dtype: torch.dtype) -> tuple:
        swa = self.swa
        if n_heads != 1 or swa.dim() != 3 or swa.shape[2] != d or swa.stride(2) != 1 or swa.dtype != dtype:
            raise ValueError(f"a ring [slots, W, {d}] {dtype} takes one-head rows, got {tuple(swa.shape)} {swa.dtype}")
        for t in (self.slots, self.positions):
            if t.dtype != torch.int32 or tuple(t.shape) != (n_rows,):
                raise ValueError(f"ring slots and positions must be int32 [{n_rows}], got {t.dtype} {tuple(t.shape)}")
        return swa, self.slots, self.positions, swa.stride(0), swa.stride(1), swa.shape[1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, D] -> RMSNorm over D in x's dtype (layers.RMSNorm); weight None: the per-head form
    x * rsqrt(mean(x^2) + eps).to(x.dtype) of Attention.forward, on [N, D] or [N, H, D]."""
    norm = NORM_PER_HEAD if weight is None else NORM_WEIGHTED
    if weight is not None and x.dim() != 2:
        raise ValueError(f"RMSNorm with a weight takes [N, D], got {tuple(x.shape)}")
    return _launch(x, out, x.dtype, weight=weight, eps=eps, norm=norm)


def q_head_norm_rope(q: torch.Tensor, angles: Angles, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, d] -> the per-head RMS (no weight), then RoPE on the trailing channels; q's dtype."""
    return _launch(q, out, q.dtype, eps=eps, norm=NORM_PER_HEAD, angles=angles)


def kv_norm_rope_quant(
    kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    angles: Angles,
    nope_dims: int,
    fp8_block: int = KV_BLOCK,
    kv_fp8: bool = True,
    out: torch.Tensor | None = None,
    ring: Ring | None = None,
) -> torch.Tensor:
    """kv [N, d] -> RMSNorm (weight), RoPE, then FP8 quantize-dequantize of the first nope_dims channels
    per fp8_block (a power of two) when kv_fp8; kv's dtype."""
    if fp8_block & (fp8_block - 1) or not 0 <= nope_dims <= kv.shape[-1]:
        raise ValueError(f"fp8_block must be a power of two and nope_dims within d, got {fp8_block}, {nope_dims}")
    quant = QUANT_FP8 if kv_fp8 and nope_dims else QUANT_NONE
    return _launch(
        kv, out, kv.dtype, weight=weight, eps=eps, norm=NORM_WEIGHTED, angles=angles, quant=quant,
        quant_dim=nope_dims, fp8_block=fp8_block, ring=ring,
    )  # fmt: skip


def rope(x: torch.Tensor, angles: Angles, inverse: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, H, d] or [N, d] rotated on its trailing channels (inverse: the conjugate rotation); x's dtype.
    `out=x` rotates in place (each program reads its rows before it writes them)."""
    return _launch(x, out, x.dtype, angles=angles, inverse=inverse)


def indexer_q(q: torch.Tensor, angles: Angles, fp4: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H_I, d_I] -> RoPE, then (fp4) the orthonormal Hadamard transform and FP4 per 32; q's dtype."""
    quant = QUANT_HADAMARD_FP4 if fp4 else QUANT_NONE
    return _launch(q, out, q.dtype, angles=angles, quant=quant, quant_dim=q.shape[-1])


def compressed_entry(
    pooled: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    angles: Angles,
    mode: str,
    out_dtype: torch.dtype = torch.bfloat16,
    nope_dims: int = 0,
    fp8_block: int = KV_BLOCK,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """pooled [W, d] fp32 -> out_dtype (the compute dtype), RMSNorm, RoPE (angles at each window's first
    position), then by mode: "kv" FP8 on the first nope_dims channels, "index" Hadamard + FP4, "plain"
    nothing (the simulations switched off)."""
    quant = {"kv": QUANT_FP8, "index": QUANT_HADAMARD_FP4, "plain": QUANT_NONE}.get(mode)
    if quant is None:
        raise ValueError(f"mode must be 'kv', 'index' or 'plain', got {mode!r}")
    quant_dim = nope_dims if mode == "kv" else pooled.shape[-1]
    if quant == QUANT_FP8 and not nope_dims:
        quant = QUANT_NONE
    return _launch(
        pooled, out, out_dtype, weight=weight, eps=eps, norm=NORM_WEIGHTED, angles=angles, quant=quant,
        quant_dim=quant_dim, fp8_block=fp8_block,
    )  # fmt: skip


def _config(
    name: str, x: str, d: int, heads: int, norm: int, rope_dim: int, quant: int, window: int = 1, tokens: int = 64,
    ring: bool = False, **extra,
):  # fmt: skip
    """(name, signature, constexprs) of the build `_launch` makes for a chain on [tokens, heads, d] `x` rows (bf16
    out, fp32 norm weight, angles from int32 positions; 64 tokens: the largest tile of every chain); an int
    argument equal to 1 is a constexpr, as the launcher specializes it."""
    block_r, block_d = _tile(d, tokens * heads, quant, KV_BLOCK)
    ints = {"n_rows": tokens * heads, "n_heads": heads, "window": window, "ring_window": 128 if ring else 1}
    signature = {
        "x_ptr": f"*{x}", "w_ptr": "*fp32" if norm == NORM_WEIGHTED else f"*{x}", "cos_ptr": f"*{x}",
        "sin_ptr": f"*{x}", "pos_ptr": "*i32" if rope_dim else f"*{x}", "freq_ptr": "*fp32" if rope_dim else f"*{x}",
        "out_ptr": "*bf16",
        **{k: "constexpr" if v == 1 else "i32" for k, v in ints.items()},
        "stride_xn": "i32", "stride_xh": "i32", "stride_on": "i32", "stride_oh": "i32", "stride_cs": "i32",
        "eps": "fp32", "hadamard_scale": "fp32",
        "ring_ptr": "*bf16" if ring else f"*{x}", "ring_slot_ptr": "*i32" if ring else f"*{x}",
        "ring_pos_ptr": "*i32" if ring else f"*{x}", "stride_ring_slot": "i32", "stride_ring_pos": "i32",
    }  # fmt: skip
    constexprs = {
        "D": d, "BLOCK_R": block_r, "BLOCK_D": block_d,
        "NORM": norm, "ROPE_DIM": rope_dim, "FROM_POSITIONS": rope_dim > 0, "INVERSE": False, "QUANT": quant,
        "QUANT_DIM": {QUANT_FP8: d - rope_dim, QUANT_HADAMARD_FP4: d}.get(quant, 0), "FP8_BLOCK": KV_BLOCK,
        "HADAMARD_STAGES": d.bit_length() - 1 if quant == QUANT_HADAMARD_FP4 else 0, "ROUND_BF16": True,
        "ONE_TOKEN": heads % block_r == 0, "RING": ring,
        **{k: 1 for k, v in ints.items() if v == 1}, **extra,
    }  # fmt: skip
    signature.update({k: "constexpr" for k in constexprs})
    return name, signature, constexprs


# multiples of 16 at DeepSeek-V4-Flash's dims (registry.py): the row strides (4096, 1024, 512 * 64, 512,
# 128 * 64, 128) and the head strides; stride_cs is 32 (tables) or 0 (positions)
ALIGNED_INTS = ("stride_xn", "stride_xh", "stride_on", "stride_oh", "stride_cs")

# the CPU compile checks (tests/kernels/test_compile.py), at DeepSeek-V4-Flash's dims: 4096 hidden, q_lora
# 1024, 64 heads x 512 (rope 64, nope 448), 64 index heads x 128; the compressor entries as the decode path
# runs them, from the token positions rotated at their window's start (window = ratio 4)
COMPILE_CONFIGS = (
    _config("rms_norm_4096", "bf16", 4096, 1, NORM_WEIGHTED, 0, QUANT_NONE),
    _config("rms_norm_1024", "bf16", 1024, 1, NORM_WEIGHTED, 0, QUANT_NONE),
    _config("q_head_norm_rope", "bf16", 512, 64, NORM_PER_HEAD, 64, QUANT_NONE),
    _config("kv_norm_rope_fp8", "bf16", 512, 1, NORM_WEIGHTED, 64, QUANT_FP8),
    # a decode step's keys, also stored into their window rings (window 128)
    _config("kv_norm_rope_fp8_ring", "bf16", 512, 1, NORM_WEIGHTED, 64, QUANT_FP8, ring=True),
    _config("rope_inverse", "bf16", 512, 64, NORM_NONE, 64, QUANT_NONE, INVERSE=True),
    _config("indexer_q_fp4", "bf16", 128, 64, NORM_NONE, 64, QUANT_HADAMARD_FP4),
    _config("entry_kv_fp8", "fp32", 512, 1, NORM_WEIGHTED, 64, QUANT_FP8, window=4),
    _config("entry_index_fp4", "fp32", 128, 1, NORM_WEIGHTED, 64, QUANT_HADAMARD_FP4, window=4),
)
