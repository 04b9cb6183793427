"""The compressor's decode update in one Triton launch (dsv4-model.md §2.4). Reference:
`compressor_decode_ref.compressor_decode_ref` (the semantics of `Compressor.update_decode`).

Contract (B decode rows, one token each; m = ratio, coff = 2 for the overlapping CSA form, else 1):
  kv, gate        [B, coff * d] fp32, the token's projections (unit channel stride)
  ape             [m, coff * d] fp32
  positions       [B] int32, slots [B] int32 (distinct: rows are separate sequences), block_table [B, W] int32
  pending_kv / pending_score  [num_slots, m, coff * d] fp32, the carry        (read and written)
  prev_kv / prev_score        [num_slots, m, d] fp32 or None (HCA)             (read and written)
  entries         [num_pages, per_page, d] bf16 / fp32                          (entry p // m written)
  norm_weight [d] fp32, eps, freqs [rope_dim / 2] fp32, mode "kv" / "index" / "plain" (compressed_entry's)
  For row b at position p, j = p % m, e = p // m: the token joins the carry at row j; window e is pooled
  from the carry as it stands (rows past j still hold an older window: a partial entry, never read before
  it closes), with the previous window's A halves in front for CSA (kv 0, score -inf for e = 0); the pooled
  row is finished as `token_ops.compressed_entry` finishes it (RMSNorm, RoPE at e * m, FP8 nope or
  Hadamard + FP4) and stored at entry e through the block table; when j = m - 1 the window's A halves
  become `prev`.

One program per row holds the row's whole pooled vector (BLOCK_D = d rounded up) so that the RMS statistics
and the Hadamard transform see it in registers: the window is read in [BLOCK_L, BLOCK_D] tiles of ~4K fp32,
twice (the channel max, then the exp sums: the same arithmetic as compressor_pool), so HCA's 128 x 512
window takes 16 tiles and CSA's one (plus the [m, d] previous half). The new token's values are put into
the tiles from registers rather than read back after their store (no read-after-write through memory);
`prev` is read before it is overwritten, with a barrier between (another thread may store what this one
still has to load).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_kernels.token_ops_ref import FP4_BLOCK, KV_BLOCK
from dsv4_kernels.token_ops_tiles import _angles, _fp4_blocks, _fp8_blocks, _hadamard, _inv_rms, _rotate, _round_bf16

QUANT_NONE, QUANT_FP8, QUANT_HADAMARD_FP4 = 0, 1, 2  # as token_ops
TILE_ELEMENTS = 4096  # fp32 values of one window tile: 32 a thread at 4 warps


def interpreting() -> bool:
    """True when @triton.jit builds interpreter functions (TRITON_INTERPRET=1 at import time)."""
    return not isinstance(compressor_decode_kernel, triton.runtime.JITFunction)


@triton.jit
def compressor_decode_kernel(
    kv_ptr,
    gate_ptr,
    ape_ptr,
    pos_ptr,
    slot_ptr,
    bt_ptr,
    pend_kv_ptr,
    pend_score_ptr,
    prev_kv_ptr,
    prev_score_ptr,
    entry_ptr,
    norm_ptr,
    freq_ptr,
    stride_kvb,
    stride_gb,
    stride_ape,
    stride_btb,
    stride_ps,
    stride_pl,
    stride_vs,
    stride_vl,
    stride_ep,
    stride_ee,
    eps,
    hadamard_scale,
    RATIO: tl.constexpr,
    PER_PAGE: tl.constexpr,
    D: tl.constexpr,
    OVERLAP: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    QUANT: tl.constexpr,
    QUANT_DIM: tl.constexpr,
    FP8_BLOCK: tl.constexpr,
    HADAMARD_STAGES: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Row b = program_id(0): carry, pooling, entry, and the previous half when its window closes."""
    b = tl.program_id(0)
    pos = tl.load(pos_ptr + b)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    j = pos % RATIO
    e = pos // RATIO
    chans = tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_L)
    ch_ok = chans < D
    half = D if OVERLAP else 0  # the pooled half's first channel: B for CSA, everything for HCA
    # the token: its pooled half, then (CSA) its A half for the next window
    kv_row = kv_ptr + b.to(tl.int64) * stride_kvb
    gate_row = gate_ptr + b.to(tl.int64) * stride_gb
    ape_row = ape_ptr + j * stride_ape
    new_kv = tl.load(kv_row + half + chans, mask=ch_ok, other=0.0)
    new_score = tl.load(gate_row + half + chans, mask=ch_ok, other=0.0) + tl.load(
        ape_row + half + chans, mask=ch_ok, other=0.0
    )
    pend_kv = pend_kv_ptr + slot * stride_ps
    pend_score = pend_score_ptr + slot * stride_ps
    tl.store(pend_kv + j * stride_pl + half + chans, new_kv, mask=ch_ok)
    tl.store(pend_score + j * stride_pl + half + chans, new_score, mask=ch_ok)
    if OVERLAP:
        new_kv_a = tl.load(kv_row + chans, mask=ch_ok, other=0.0)
        new_score_a = tl.load(gate_row + chans, mask=ch_ok, other=0.0) + tl.load(ape_row + chans, mask=ch_ok, other=0.0)
        tl.store(pend_kv + j * stride_pl + chans, new_kv_a, mask=ch_ok)
        tl.store(pend_score + j * stride_pl + chans, new_score_a, mask=ch_ok)
    # pass 1: each channel's largest score over the window
    top = tl.full((BLOCK_D,), float("-inf"), tl.float32)
    if OVERLAP:  # the previous window's A halves; none before the first window
        has_prev = (rows * 0 + e) > 0
        prev_mask = ((rows < RATIO) & has_prev)[:, None] & ch_ok[None, :]
        prev_offs = slot * stride_vs + rows[:, None] * stride_vl + chans[None, :]
        prev_s = tl.load(prev_score_ptr + prev_offs, mask=prev_mask, other=float("-inf"))
        prev_k = tl.load(prev_kv_ptr + prev_offs, mask=prev_mask, other=0.0)
        top = tl.maximum(top, tl.max(prev_s, axis=0))
    for l0 in range(0, RATIO, BLOCK_L):
        r = l0 + rows
        mask = (r < RATIO)[:, None] & ch_ok[None, :]
        s = tl.load(pend_score + r[:, None] * stride_pl + half + chans[None, :], mask=mask, other=float("-inf"))
        s = tl.where((r == j)[:, None] & mask, new_score[None, :], s)
        top = tl.maximum(top, tl.max(s, axis=0))
    top = tl.where(top == float("-inf"), 0.0, top)  # a channel of no slot: every weight exp(-inf) = 0
    # pass 2: the exp sums (compressor_pool's arithmetic)
    total = tl.zeros((BLOCK_D,), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    if OVERLAP:
        w = tl.exp(prev_s - top[None, :])
        total += tl.sum(w, axis=0)
        acc += tl.sum(w * prev_k, axis=0)
    for l0 in range(0, RATIO, BLOCK_L):
        r = l0 + rows
        mask = (r < RATIO)[:, None] & ch_ok[None, :]
        offs = r[:, None] * stride_pl + half + chans[None, :]
        s = tl.load(pend_score + offs, mask=mask, other=float("-inf"))
        k = tl.load(pend_kv + offs, mask=mask, other=0.0)
        is_new = (r == j)[:, None] & mask
        s = tl.where(is_new, new_score[None, :], s)
        k = tl.where(is_new, new_kv[None, :], k)
        w = tl.exp(s - top[None, :])
        total += tl.sum(w, axis=0)
        acc += tl.sum(w * k, axis=0)
    pooled = tl.where(total > 0.0, acc / tl.where(total > 0.0, total, 1.0), 0.0)
    # the entry: compressed_entry's chain (token_ops.token_rows_kernel with NORM_WEIGHTED) on one row
    x = pooled[None, :]  # [1, BLOCK_D], zeros past D
    if ROUND_BF16:
        x = _round_bf16(x)
    weight = tl.load(norm_ptr + chans, mask=ch_ok, other=0.0).to(tl.float32)
    x = weight[None, :] * (x * _inv_rms(x, D, eps)[:, None])
    if ROUND_BF16:
        x = _round_bf16(x)
    if ROPE_DIM > 0:  # at the window's first position: _angles rounds pos down to a multiple of RATIO
        cos, sin, rotated = _angles(
            b + tl.zeros((1,), tl.int32), freq_ptr, freq_ptr, pos_ptr, freq_ptr, 0, RATIO, D, ROPE_DIM, BLOCK_D, True,
            False,
        )  # fmt: skip
        x = _rotate(x, cos, sin, rotated, 1, BLOCK_D, ROUND_BF16)
    if QUANT == 1:
        x = _fp8_blocks(x, QUANT_DIM, FP8_BLOCK, 1, BLOCK_D)
    elif QUANT == 2:
        x = _hadamard(x, hadamard_scale, HADAMARD_STAGES, 1, BLOCK_D)
        if ROUND_BF16:
            x = _round_bf16(x)
        x = _fp4_blocks(x, QUANT_DIM, 1, BLOCK_D)
    page = tl.load(bt_ptr + b.to(tl.int64) * stride_btb + e // PER_PAGE).to(tl.int64)
    entry = entry_ptr + page * stride_ep + (e % PER_PAGE) * stride_ee
    tl.store(
        entry + chans[None, :], x.to(entry_ptr.dtype.element_ty), mask=(ch_ok & ((chans * 0 + page) >= 0))[None, :]
    )
    if OVERLAP:  # a closed window's A halves (the token's from registers) become the previous half
        tl.debug_barrier()  # every thread has loaded `prev` above before any thread overwrites it
        if j == RATIO - 1:
            a_mask = (rows < RATIO)[:, None] & ch_ok[None, :]
            a_offs = rows[:, None] * stride_pl + chans[None, :]
            is_new = (rows == j)[:, None] & a_mask
            a_kv = tl.where(is_new, new_kv_a[None, :], tl.load(pend_kv + a_offs, mask=a_mask, other=0.0))
            a_score = tl.where(is_new, new_score_a[None, :], tl.load(pend_score + a_offs, mask=a_mask, other=0.0))
            prev_offs = slot * stride_vs + rows[:, None] * stride_vl + chans[None, :]
            tl.store(prev_kv_ptr + prev_offs, a_kv, mask=a_mask)
            tl.store(prev_score_ptr + prev_offs, a_score, mask=a_mask)


def pick_block_l(ratio: int, block_d: int, overlap: bool) -> int:
    """Carry rows a tile holds: the whole window for CSA (its m rows, the previous half's tile too), else as
    many as keep the tile near TILE_ELEMENTS (HCA: 8 rows of 512 channels)."""
    rows = triton.next_power_of_2(ratio)
    return rows if overlap else max(1, min(rows, TILE_ELEMENTS // block_d))


def _check(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    pending: tuple[torch.Tensor, torch.Tensor],
    prev: tuple[torch.Tensor | None, torch.Tensor | None],
    entries: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """ValueError unless the arguments have the contract's shapes, dtypes and unit channel strides."""
    n_rows, width = kv.shape
    ratio, d = pending[0].shape[1], entries.shape[2]
    overlap = prev[0] is not None
    f32 = (kv, gate, ape, *pending, *(t for t in prev if t is not None))
    problems = []
    if any(t.dtype != torch.float32 for t in f32) or any(t.stride(-1) != 1 for t in f32):
        problems.append("kv, gate, ape, pending_* and prev_* must be fp32 with unit channel stride")
    if gate.shape != kv.shape or width != (2 if overlap else 1) * d or ape.shape != (ratio, width):
        problems.append(f"kv / gate {tuple(kv.shape)}, ape {tuple(ape.shape)} do not fit d = {d}, ratio {ratio}")
    if any(t.shape[1:] != (ratio, width) or not t.is_contiguous() for t in pending) or pending[0].stride() != (
        pending[1].stride()
    ):
        problems.append(f"pending_* must be one contiguous [slots, {ratio}, {width}] layout")
    prev_kv, prev_score = prev
    if overlap and (
        prev_kv is None
        or prev_score is None
        or any(t.shape[1:] != (ratio, d) or not t.is_contiguous() for t in (prev_kv, prev_score))
        or prev_kv.stride() != prev_score.stride()
    ):
        problems.append(f"prev_* must be one contiguous [slots, {ratio}, {d}] layout")
    if overlap != (ratio == 4) or (prev[1] is not None) != overlap:
        problems.append("prev_* go with the overlapping ratio-4 form only")
    if any(t.dtype != torch.int32 or t.shape[0] != n_rows for t in rows) or rows[2].stride(1) != 1:
        problems.append("positions, slots [B] and block_table [B, W] must be int32")
    if entries.dtype not in (torch.bfloat16, torch.float32) or entries.stride(2) != 1:
        problems.append(f"entries must be bf16 / fp32 with unit channel stride, got {entries.dtype}")
    if problems:
        raise ValueError("compressor_decode: " + "; ".join(problems))


def compressor_decode(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_table: torch.Tensor,
    pending_kv: torch.Tensor,
    pending_score: torch.Tensor,
    prev_kv: torch.Tensor | None,
    prev_score: torch.Tensor | None,
    entries: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    freqs: torch.Tensor,
    mode: str,
    compute_dtype: torch.dtype,
    nope_dims: int = 0,
    fp8_block: int = KV_BLOCK,
) -> None:
    """See the module contract: one launch, B programs; the cache tensors are updated in place. The entries
    hold the compute dtype (the pool's dtype)."""
    quant = {"kv": QUANT_FP8, "index": QUANT_HADAMARD_FP4, "plain": QUANT_NONE}.get(mode)
    if quant is None:
        raise ValueError(f"mode must be 'kv', 'index' or 'plain', got {mode!r}")
    if compute_dtype not in (torch.bfloat16, torch.float32) or entries.dtype != compute_dtype:
        raise ValueError(
            f"the compute dtype must be bf16 or fp32 and the entries', got {compute_dtype}, {entries.dtype}"
        )
    _check(kv, gate, ape, (pending_kv, pending_score), (prev_kv, prev_score), entries, (positions, slots, block_table))
    d = entries.shape[2]
    rope_dim = 2 * freqs.shape[0]
    if quant == QUANT_FP8 and not nope_dims:
        quant = QUANT_NONE
    stages = d.bit_length() - 1
    if quant == QUANT_HADAMARD_FP4 and d != 1 << stages:
        raise ValueError(f"the Hadamard transform needs a power-of-two dim, got {d}")
    if rope_dim > d or norm_weight.shape != (d,) or norm_weight.dtype != torch.float32:
        raise ValueError(f"norm weight [{d}] fp32 and freqs of rope dim <= {d} needed, got rope dim {rope_dim}")
    n_rows, ratio = kv.shape[0], pending_kv.shape[1]
    if n_rows == 0:
        return
    overlap = prev_kv is not None
    block_d = max(triton.next_power_of_2(d), fp8_block if quant == QUANT_FP8 else 1, FP4_BLOCK if quant else 1)
    prev_kv = prev_kv if prev_kv is not None else pending_kv  # never read without OVERLAP
    prev_score = prev_score if prev_score is not None else pending_score
    compressor_decode_kernel[(n_rows,)](
        kv,
        gate,
        ape,
        positions,
        slots,
        block_table,
        pending_kv,
        pending_score,
        prev_kv,
        prev_score,
        entries,
        norm_weight.contiguous(),
        freqs.contiguous(),
        kv.stride(0),
        gate.stride(0),
        ape.stride(0),
        block_table.stride(0),
        pending_kv.stride(0),
        pending_kv.stride(1),
        prev_kv.stride(0),
        prev_kv.stride(1),
        entries.stride(0),
        entries.stride(1),
        eps,
        d**-0.5,
        RATIO=ratio,
        PER_PAGE=entries.shape[1],
        D=d,
        OVERLAP=overlap,
        BLOCK_L=pick_block_l(ratio, block_d, overlap),
        BLOCK_D=block_d,
        ROPE_DIM=rope_dim,
        QUANT=quant,
        QUANT_DIM={QUANT_FP8: nope_dims, QUANT_HADAMARD_FP4: d}.get(quant, 0),
        FP8_BLOCK=fp8_block,
        HADAMARD_STAGES=stages if quant == QUANT_HADAMARD_FP4 else 0,
        ROUND_BF16=compute_dtype == torch.bfloat16,
    )


COMPILE_SIGNATURE = {
    **{name: "*fp32" for name in ("kv_ptr", "gate_ptr", "ape_ptr", "pend_kv_ptr", "pend_score_ptr")},
    **{name: "*fp32" for name in ("prev_kv_ptr", "prev_score_ptr", "norm_ptr", "freq_ptr")},
    **{name: "*i32" for name in ("pos_ptr", "slot_ptr", "bt_ptr")},
    "entry_ptr": "*bf16",  # the pool's entries hold the compute dtype: bf16 on the GPU
    **{name: "i32" for name in ("stride_kvb", "stride_gb", "stride_ape", "stride_btb", "stride_ps", "stride_pl")},
    **{name: "i32" for name in ("stride_vs", "stride_vl", "stride_ep", "stride_ee")},
    "eps": "fp32",
    "hadamard_scale": "fp32",
    **{name: "constexpr" for name in ("RATIO", "PER_PAGE", "D", "OVERLAP", "BLOCK_L", "BLOCK_D", "ROPE_DIM")},
    **{name: "constexpr" for name in ("QUANT", "QUANT_DIM", "FP8_BLOCK", "HADAMARD_STAGES", "ROUND_BF16")},
}

# multiples of 16 at DeepSeek-V4-Flash's dims (registry.py): every channel-count stride (d = 512 or 128)
ALIGNED_INTS: tuple[str, ...] = (
    "stride_kvb",
    "stride_gb",
    "stride_ape",
    "stride_ps",
    "stride_pl",
    "stride_vs",
    "stride_vl",
)
ALIGNED_INTS += ("stride_ep", "stride_ee")


def _config(ratio: int, d: int, quant: int, per_page: int) -> dict:
    """The constexprs `compressor_decode` passes for DeepSeek-V4-Flash (128-token pages, rope dim 64)."""
    overlap = ratio == 4
    return {
        "RATIO": ratio,
        "PER_PAGE": per_page,
        "D": d,
        "OVERLAP": overlap,
        "BLOCK_L": pick_block_l(ratio, d, overlap),
        "BLOCK_D": d,
        "ROPE_DIM": 64,
        "QUANT": quant,
        "QUANT_DIM": {QUANT_FP8: d - 64, QUANT_HADAMARD_FP4: d}.get(quant, 0),
        "FP8_BLOCK": KV_BLOCK,
        "HADAMARD_STAGES": d.bit_length() - 1 if quant == QUANT_HADAMARD_FP4 else 0,
        "ROUND_BF16": True,
    }


# (config name, signature, constexprs) for the CPU compile checks (tests/kernels/test_compile.py): the CSA
# attention compressor (d 512, FP8 nope), the CSA indexer's (d 128, Hadamard + FP4), and HCA's (ratio 128)
COMPILE_CONFIGS = (
    ("csa_kv", COMPILE_SIGNATURE, _config(4, 512, QUANT_FP8, 32)),
    ("csa_index", COMPILE_SIGNATURE, _config(4, 128, QUANT_HADAMARD_FP4, 32)),
    ("hca_kv", COMPILE_SIGNATURE, _config(128, 512, QUANT_FP8, 1)),
)
