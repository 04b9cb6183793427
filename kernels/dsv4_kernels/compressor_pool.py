"""The KV compressor's gated per-channel softmax pooling in Triton (dsv4-model.md §2.4).
Reference: `compressor_pool_ref.compressor_pool_ref`.

Contract:
  kv, score  [n_windows, L, d] fp32 (channels contiguous); L = ratio for HCA (128) or 2 * ratio for
             the overlapping CSA form (8); a missing slot has score -inf
  -> pooled  [n_windows, d] fp32, pooled[w, c] = sum_l softmax_l(score[w, :, c]) * kv[w, l, c];
             a channel whose every score is -inf gives 0 (see the reference's doc)

What the kernel covers: the pooling only, the one step that reads the L slots of every window. The
RMSNorm, RoPE and QAT simulation that follow work on [n_windows, d], L times less data, and stay in
torch: fusing the norm needs whole rows in one program (HCA's 128 x 512 tile does not fit) and the
model's rounding to the compute dtype before the norm, too much for a pass L times smaller.

One program pools BLOCK_D channels of one window: it loads the [L, BLOCK_D] score and kv tiles once,
takes the per-channel max, and sums exp(score - max) and exp(score - max) * kv in fp32. Decode
closes at most a window per request per step and prefill many; both are the same program, so the
configurations differ only by L (the tile height).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_kernels.outputs import output_buffer


def interpreting() -> bool:
    """True when @triton.jit builds interpreter functions (TRITON_INTERPRET=1 at import time)."""
    return not isinstance(compressor_pool_kernel, triton.runtime.JITFunction)


@triton.jit
def compressor_pool_kernel(
    kv_ptr,
    score_ptr,
    out_ptr,
    d,
    stride_kvw,
    stride_kvl,
    stride_sw,
    stride_sl,
    stride_ow,
    L: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """pooled[w, c0:c0 + BLOCK_D] for window w = program_id(1), c0 = program_id(0) * BLOCK_D."""
    w = tl.program_id(1).to(tl.int64)
    offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_l = tl.arange(0, BLOCK_L)
    mask = (offs_l[:, None] < L) & (offs_d[None, :] < d)
    score = tl.load(
        score_ptr + w * stride_sw + offs_l[:, None] * stride_sl + offs_d[None, :], mask=mask, other=float("-inf")
    )  # [BLOCK_L, BLOCK_D]
    kv = tl.load(kv_ptr + w * stride_kvw + offs_l[:, None] * stride_kvl + offs_d[None, :], mask=mask, other=0.0)
    top = tl.max(score, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # an all -inf channel: every weight is exp(-inf) = 0
    weight = tl.exp(score - top[None, :])
    total = tl.sum(weight, axis=0)
    pooled = tl.sum(weight * kv, axis=0)
    pooled = tl.where(total > 0.0, pooled / tl.where(total > 0.0, total, 1.0), 0.0)
    tl.store(out_ptr + w * stride_ow + offs_d, pooled, mask=offs_d < d)


def pick_block_d(window_slots: int, d: int) -> int:
    """Channels per program: a [BLOCK_L, BLOCK_D] tile of ~4K fp32 per operand (32 per thread with
    4 warps), so the 8-slot CSA form takes 512 channels and the 128-slot HCA form 32."""
    return max(16, min(triton.next_power_of_2(d), 4096 // triton.next_power_of_2(window_slots)))


def compressor_pool(
    kv: torch.Tensor, score: torch.Tensor, block_d: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """See the module contract. `out` ([n_windows, d] fp32, unit column stride) receives the stores."""
    if kv.shape != score.shape or kv.dim() != 3 or kv.dtype != torch.float32 or score.dtype != torch.float32:
        raise ValueError(
            f"need fp32 kv and score of one [n_windows, L, d] shape, got {kv.dtype} {tuple(kv.shape)}"
            f" and {score.dtype} {tuple(score.shape)}"
        )
    n_windows, slots, d = kv.shape
    if kv.stride(2) != 1:
        kv = kv.contiguous()
    if score.stride(2) != 1:
        score = score.contiguous()
    out = output_buffer(out, (n_windows, d), torch.float32, kv.device)
    if n_windows == 0:
        return out
    block_d = block_d or pick_block_d(slots, d)
    grid = (triton.cdiv(d, block_d), n_windows)
    compressor_pool_kernel[grid](
        kv,
        score,
        out,
        d,
        kv.stride(0),
        kv.stride(1),
        score.stride(0),
        score.stride(1),
        out.stride(0),
        L=slots,
        BLOCK_L=triton.next_power_of_2(slots),
        BLOCK_D=block_d,
    )
    return out


COMPILE_SIGNATURE = {
    "kv_ptr": "*fp32",
    "score_ptr": "*fp32",
    "out_ptr": "*fp32",
    "d": "i32",
    "stride_kvw": "i32",
    "stride_kvl": "i32",
    "stride_sw": "i32",
    "stride_sl": "i32",
    "stride_ow": "i32",
    "L": "constexpr",
    "BLOCK_L": "constexpr",
    "BLOCK_D": "constexpr",
}

# multiples of 16 at DeepSeek-V4-Flash's dims (registry.py): d = 512 or 128 and the strides built from it
ALIGNED_INTS = ("d", "stride_kvw", "stride_kvl", "stride_sw", "stride_sl", "stride_ow")

# (config name, signature, constexprs) for the CPU compile checks (tests/kernels/test_compile.py): the
# overlapping CSA form (main d = 512, indexer d = 128) and HCA; decode and prefill run the same program
COMPILE_CONFIGS = (
    ("csa", COMPILE_SIGNATURE, {"L": 8, "BLOCK_L": 8, "BLOCK_D": 512}),
    ("csa_indexer", COMPILE_SIGNATURE, {"L": 8, "BLOCK_L": 8, "BLOCK_D": 128}),
    ("hca", COMPILE_SIGNATURE, {"L": 128, "BLOCK_L": 128, "BLOCK_D": 32}),
)
