"""The output head (dsv4-model.md §2.0 step 6: logits = head . y in fp32 with the bf16 weight upcast) in
Triton, reading the weight as stored.

Contract (reference: `head_logits_ref.head_logits_ref`):
  y    [M, K] fp32 or bf16 (upcast in the kernel, exactly), row-major (K contiguous): the final normed hidden
       states of the rows that need logits (bf16 as the final norm leaves them: no cast launch before this one)
  w    [V, K] bf16, row-major: the head weight as the checkpoint stores it
  out  [M, V] fp32 = y @ w^T, every product exact, fp32 accumulation

Why: upcast once and held in fp32 (the dense loader's way), DeepSeek-V4-Flash's head is 1.97 GiB of
device memory and of reads per decode step; held in bf16 it is half of both. The kernel splits y into
three bf16 parts, hi = bf16(y), mid = bf16(y - hi), lo = bf16(y - hi - mid): each takes the next 8
significant bits of what is left and fp32 has 24, so hi + mid + lo == y exactly (for |y| above
2^-100, where no part falls below bf16's normal range). Then w @ y = w @ hi + w @ mid + w @ lo, and
each bf16 x bf16 product is exact in the fp32 accumulator: three tensor-core dots per tile give the
fp32 GEMM's result up to summation order, while w is read once.

Tiles are computed transposed, out^T [BLOCK_V, BLOCK_M] = w_tile [BLOCK_V, BLOCK_K] @ y_tile^T: the
vocabulary fills the MMA's 64-row side and a decode batch its N side (16). The wrapper sets EVEN_K when
K is a multiple of BLOCK_K (K = 4096 for the real model), dropping the K masks. A narrow product (the
compressors' [wkv; wgate], 512-2,048 rows: model/compressor.py) has too few vocabulary tiles to keep the
GPU's SMs reading: `split_k` > 1 gives each tile's K to that many programs in the one launch, their fp32
sums added in split order by the last to arrive (split_k.py; `pick_split_k`). Under the Triton
interpreter the tiles are fp32 holding the bf16 values (DOT_FP32; toolchain.md: bf16 dots are wrong
there); the interpreter's fp32 -> bf16 casts truncate instead of rounding, which keeps the split exact
(each part then takes exactly the next 8 bits).

A second product of the same input can ride in the same launch, its weight rows stacked under the first's
(`tail`): the indexer's head weights under its compressor's [wkv; wgate] (model/compressor.py). Their columns,
from `tail.start` on, leave as the torch path leaves that projection: rounded to bf16 (round to nearest even,
by bits: the interpreter's casts truncate) when `tail.round_bf16`, then times `tail.scale` in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4_kernels.fp4_moe_tiles import _round_bf16  # the one bf16 rounding every kernel uses
from dsv4_kernels.outputs import output_buffer
from dsv4_kernels.split_k import (
    _split_arrive,
    _split_sum,
    k_splits_allowed,
    split_counters,
    split_to_fill,
    unsplit_args,
)

BLOCK_V = 128
# under the Triton interpreter each program costs milliseconds of Python whatever its size: 2048 vocabulary
# rows a program (64 programs for 129,280 instead of 1,010) give the same logits (a logit's sum over K does
# not depend on the tile's vocabulary width) and take whole-model CPU tests minutes less
INTERPRETER_BLOCK_V = 2048
BLOCK_K = 64  # 3 pipeline stages of a [128, 64] bf16 weight tile and a [64, BLOCK_M] fp32 y tile fit sm_120


def interpreting() -> bool:
    """True when @triton.jit builds interpreter functions (TRITON_INTERPRET=1 at import time)."""
    return not isinstance(head_logits_kernel, triton.runtime.JITFunction)


@triton.jit
def head_logits_kernel(
    y_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    V,
    K,
    stride_ym,
    stride_wv,
    stride_om,
    stride_ps,
    tail_start,
    tail_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,
    TAIL: tl.constexpr = 0,
):
    """One [BLOCK_M rows, BLOCK_V vocabulary] tile of the logits, computed transposed; with SPLIT_K > 1 program
    axis 2 takes K / SPLIT_K and the tile's last split to arrive adds the parts (part_ptr [SPLIT_K, M, V]
    fp32, count_ptr one counter a tile) and stores the tile. TAIL (module doc): 0 none; 1 the columns from
    tail_start on times tail_scale; 2 rounded to bf16 first."""
    pid_v = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    v_ok = offs_v < V
    m_ok = offs_m < M
    w_ptrs = w_ptr + offs_v.to(tl.int64)[:, None] * stride_wv + offs_k[None, :]  # [BV, BK]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_k[:, None]  # [BK, BM]: y^T
    acc = tl.zeros((BLOCK_V, BLOCK_M), dtype=tl.float32)
    k_lo = 0
    k_hi = K
    if SPLIT_K > 1:
        k_lo = tl.program_id(2) * (K // SPLIT_K)
        k_hi = k_lo + K // SPLIT_K
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w_mask = v_ok[:, None]
        y_mask = m_ok[None, :]
        if not EVEN_K:
            k_ok = offs_k < K - k0
            w_mask = w_mask & k_ok[None, :]
            y_mask = y_mask & k_ok[:, None]
        w = tl.load(w_ptrs + k0, mask=w_mask, other=0.0)
        y = tl.load(y_ptrs + k0, mask=y_mask, other=0.0).to(tl.float32)  # bf16 y: exact, its split trivial
        hi = y.to(tl.bfloat16)
        rest = y - hi.to(tl.float32)  # exact
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)  # exact: at most 8 significant bits were left
        if DOT_FP32:
            w = w.to(tl.float32)
            acc = tl.dot(w, lo.to(tl.float32), acc)
            acc = tl.dot(w, mid.to(tl.float32), acc)
            acc = tl.dot(w, hi.to(tl.float32), acc)
        else:
            acc = tl.dot(w, lo, acc)  # the smallest part first
            acc = tl.dot(w, mid, acc)
            acc = tl.dot(w, hi, acc)
    o_mask = v_ok[:, None] & m_ok[None, :]
    o_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_v[:, None]  # M x V passes 2^31 at 16,612 rows
    if SPLIT_K > 1:
        p_ptrs = part_ptr + offs_m.to(tl.int64)[None, :] * V + offs_v[:, None]
        tl.store(p_ptrs + tl.program_id(2) * stride_ps, acc, mask=o_mask)
        if _split_arrive(count_ptr, pid_m * tl.num_programs(0) + pid_v, SPLIT_K):
            total = _split_sum(p_ptrs, o_mask, stride_ps, SPLIT_K)
            tl.store(o_ptrs, _tail(total, offs_v, tail_start, tail_scale, TAIL), mask=o_mask)
    else:
        tl.store(o_ptrs, _tail(acc, offs_v, tail_start, tail_scale, TAIL), mask=o_mask)


@triton.jit
def _tail(acc, offs_v, tail_start, tail_scale, TAIL: tl.constexpr):
    """The tail rows' columns of a finished [BLOCK_V, BLOCK_M] tile as the module doc says; the rest as summed."""
    if TAIL != 0:
        done = acc
        if TAIL == 2:
            done = _round_bf16(acc)
        acc = tl.where((offs_v >= tail_start)[:, None], done * tail_scale, acc)
    return acc


@dataclass(frozen=True)
class Tail:
    """A second projection's rows stacked under the first's in `w` (module doc): its columns start at `start`,
    leave rounded to bf16 when `round_bf16`, then times `scale` (fp32)."""

    start: int
    scale: float
    round_bf16: bool


def pick_block_m(m: int, batch_invariant: bool = False) -> int:
    """16 rows (a decode batch: the wgmma's N side) up to 16 rows, else 32. Not 64: on mma.sync GPUs
    (sm_120) every warp holds the whole [BLOCK_K, BLOCK_M] right operand, three of them here, and at 64
    rows they spill (python -m dsv4_kernels.build_report); the weight is then read once per 32 rows,
    which matters only past a few dozen rows, where the step's other work dwarfs the head.
    Batch-invariant numerics take 16 always, so a row's tile shape never depends on the others."""
    return 16 if batch_invariant or m <= 16 else 32


def pick_split_k(tiles: int, k: int) -> int:
    """The K split for a launch of `tiles` output tiles (split_k.split_to_fill), each split a whole number of
    BLOCK_K steps of K."""
    return split_to_fill(tiles, k // BLOCK_K if k % BLOCK_K == 0 else 1)


def head_logits(
    y: torch.Tensor,
    w: torch.Tensor,
    block_m: int | None = None,
    out: torch.Tensor | None = None,
    split_k: int | None = None,
    tail: Tail | None = None,
) -> torch.Tensor:
    """See the module contract. `out` ([M, V] fp32, unit column stride) receives the stores (tests pass
    a NaN-poisoned view). `split_k`: K split over that many programs a tile (default `pick_split_k`; 1 under
    the interpreter, whose programs cost time whatever their size); it must divide K in BLOCK_K steps.
    `tail`: a second projection's rows stacked under the first's (module doc)."""
    m, k = y.shape
    v, k_w = w.shape
    if y.dtype not in (torch.float32, torch.bfloat16) or w.dtype != torch.bfloat16 or k_w != k:
        raise ValueError(
            f"need fp32 / bf16 y [M, K] and bf16 w [V, K], got {y.dtype} {tuple(y.shape)}, {w.dtype} {tuple(w.shape)}"
        )
    y, w = y.contiguous(), w.contiguous()
    out = output_buffer(out, (m, v), torch.float32, y.device)
    if m == 0:
        return out
    bm = block_m or pick_block_m(m)
    block_v = INTERPRETER_BLOCK_V if interpreting() else BLOCK_V
    tiles = triton.cdiv(v, block_v) * triton.cdiv(m, bm)
    if split_k is None:
        split_k = 1 if interpreting() or not k_splits_allowed() else pick_split_k(tiles, k)
    if split_k < 1 or (split_k > 1 and k % (split_k * BLOCK_K)):
        raise ValueError(f"split_k {split_k} x BLOCK_K {BLOCK_K} must divide K={k}")
    if tail is not None and not 0 <= tail.start <= v:
        raise ValueError(f"the tail's first row {tail.start} is outside the weight's {v} rows")
    part, counters = unsplit_args(y.device)
    if split_k > 1:
        part = torch.empty((split_k, m, v), dtype=torch.float32, device=y.device)
        counters = split_counters(tiles, y.device)
    grid = (triton.cdiv(v, block_v), triton.cdiv(m, bm), split_k)
    head_logits_kernel[grid](
        y,
        w,
        out,
        part,
        counters,
        m,
        v,
        k,
        y.stride(0),
        w.stride(0),
        out.stride(0),
        part.stride(0),
        v if tail is None else tail.start,
        1.0 if tail is None else float(tail.scale),
        BLOCK_M=bm,
        BLOCK_V=block_v,
        BLOCK_K=BLOCK_K,
        EVEN_K=k % BLOCK_K == 0,
        DOT_FP32=interpreting(),
        SPLIT_K=split_k,
        TAIL=0 if tail is None else 2 if tail.round_bf16 else 1,
    )
    return out


_SIG = {
    "y_ptr": "*fp32",
    "w_ptr": "*bf16",
    "out_ptr": "*fp32",
    "part_ptr": "*fp32",
    "count_ptr": "*i32",
    "M": "i32",
    "V": "i32",
    "K": "i32",
    "stride_ym": "i32",
    "stride_wv": "i32",
    "stride_om": "i32",
    "stride_ps": "i32",
    "tail_start": "i32",
    "tail_scale": "fp32",
    "BLOCK_M": "constexpr",
    "BLOCK_V": "constexpr",
    "BLOCK_K": "constexpr",
    "EVEN_K": "constexpr",
    "DOT_FP32": "constexpr",
    "SPLIT_K": "constexpr",
    "TAIL": "constexpr",
}
_GPU = {"BLOCK_V": BLOCK_V, "BLOCK_K": BLOCK_K, "EVEN_K": True, "DOT_FP32": False, "SPLIT_K": 1, "TAIL": 0}
# multiples of 16 at DeepSeek-V4-Flash's dims: V = 129280, K = 4096 and the row strides equal to them;
# not M
ALIGNED_INTS = ("V", "K", "stride_ym", "stride_wv", "stride_om")

# (config name, signature, constexprs) for the CPU compile checks (tests/kernels/test_compile.py)
_BF16_Y = {**_SIG, "y_ptr": "*bf16"}  # what the model passes: the final norm's output, the compressors' input
COMPILE_CONFIGS = (
    ("decode", _BF16_Y, {**_GPU, "BLOCK_M": 16}),
    ("batch", _BF16_Y, {**_GPU, "BLOCK_M": 32}),
    ("decode_fp32_y", _SIG, {**_GPU, "BLOCK_M": 16}),  # fp32 y: the start-up split check's exact sums
    # the compressors' projection at decode: 4-16 tiles, K 4096 split 8 (pick_split_k)
    ("narrow_split8", _BF16_Y, {**_GPU, "BLOCK_M": 16, "SPLIT_K": 8}),
    # the CSA indexer's compressor with the indexer's head weights stacked under it (a bf16-rounded, scaled tail)
    ("narrow_split8_tail", _BF16_Y, {**_GPU, "BLOCK_M": 16, "SPLIT_K": 8, "TAIL": 2}),
)
