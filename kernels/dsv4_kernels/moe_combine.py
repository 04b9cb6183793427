"""The MoE layer's output in one launch: each token's k routed-expert outputs summed, what the layer adds to them
(the CPU experts' part under hybrid, the shared expert), and the cast to the compute dtype.

    out = moe_combine(pairs, addends, out_dtype)   (reference: moe_combine_ref.moe_combine_ref)

pairs [T, k, D] (the MXFP4 kernel's per-route outputs, route = token * k + j, bf16 or fp32), addends up to two
[T, D] tensors (any float dtype) -> out [T, D] out_dtype:

    acc = 0 (fp32); acc += pairs[t, j] for j = 0 .. k - 1; acc += addend for each addend, in order; out = acc

The order is that of `torch.sum(pairs, dim=1, dtype=torch.float32)` on the CPU followed by in-place adds (the
layer's torch form), so the two agree bit for bit. It replaces three launches of a decode step's MoE (the
routed sum, the shared expert's add, the cast) by one. A program per (token, BLOCK_D channels); no reduction
across programs, so a token's output never depends on the batch.

Under the interpreter an fp32 -> bf16 store rounds differently from torch (docs/toolchain.md): there the kernel
stores fp32 and the wrapper casts (`outputs.as_gpu_stored`, a no-op on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_kernels.outputs import as_gpu_stored, output_buffer

BLOCK_D = 512  # channels a program: DeepSeek-V4-Flash's 4,096 in 8 programs a token
MAX_ADDENDS = 2


@triton.jit
def moe_combine_kernel(
    pairs_ptr,
    add0_ptr,
    add1_ptr,
    out_ptr,
    dim,
    stride_pt,
    stride_pk,
    stride_a0,
    stride_a1,
    stride_o,
    K: tl.constexpr,
    N_ADD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """See the module doc. Grid (T, cdiv(dim, BLOCK_D))."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < dim
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        acc += tl.load(pairs_ptr + t * stride_pt + j * stride_pk + cols, mask=mask, other=0.0).to(tl.float32)
    if N_ADD >= 1:
        acc += tl.load(add0_ptr + t * stride_a0 + cols, mask=mask, other=0.0).to(tl.float32)
    if N_ADD >= 2:
        acc += tl.load(add1_ptr + t * stride_a1 + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def interpreting() -> bool:
    """True when @triton.jit builds interpreter functions (TRITON_INTERPRET=1 at import time)."""
    return not isinstance(moe_combine_kernel, triton.runtime.JITFunction)


def stored_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """What the kernel stores for an `out_dtype` result: bf16 is stored as fp32 under the interpreter."""
    return torch.float32 if interpreting() and out_dtype == torch.bfloat16 else out_dtype


def combine_operands(pairs: torch.Tensor, addends: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """pairs [T, k, D] and up to MAX_ADDENDS [T, D] float tensors checked, each with a unit last stride (a copy
    where it had none): what this kernel and hc_post_combine read."""
    if pairs.dim() != 3 or not pairs.is_floating_point():
        raise ValueError(f"pairs must be a float [T, k, D] tensor, got {tuple(pairs.shape)} {pairs.dtype}")
    t, _, dim = pairs.shape
    if len(addends) > MAX_ADDENDS:
        raise ValueError(f"at most {MAX_ADDENDS} addends, got {len(addends)}")
    for a in addends:
        if a.shape != (t, dim) or not a.is_floating_point() or a.device != pairs.device:
            raise ValueError(f"an addend must be a float [{t}, {dim}] tensor on {pairs.device}, got {tuple(a.shape)}")
    pairs = pairs if pairs.stride(-1) == 1 else pairs.contiguous()
    return pairs, [a if a.stride(-1) == 1 else a.contiguous() for a in addends]


def moe_combine(
    pairs: torch.Tensor,
    addends: tuple[torch.Tensor, ...] = (),
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """pairs [T, k, D], addends ([T, D], ...) -> [T, D] out_dtype (module doc); one launch. `out` ([T, D] in
    `stored_dtype(out_dtype)`, unit last stride) receives the stores."""
    pairs, adds = combine_operands(pairs, addends)
    t, k, dim = pairs.shape
    out = output_buffer(out, (t, dim), stored_dtype(out_dtype), pairs.device)
    if t == 0:
        return out.to(out_dtype)
    a0 = adds[0] if adds else out  # never read without N_ADD
    a1 = adds[1] if len(adds) > 1 else out
    grid = (t, triton.cdiv(dim, BLOCK_D))
    moe_combine_kernel[grid](
        pairs,
        a0,
        a1,
        out,
        dim,
        pairs.stride(0),
        pairs.stride(1),
        a0.stride(0),
        a1.stride(0),
        out.stride(0),
        K=k,
        N_ADD=len(adds),
        BLOCK_D=BLOCK_D,
        num_warps=4,
    )
    return as_gpu_stored(out, out_dtype)


_SIG = {
    "pairs_ptr": "*bf16",
    "add0_ptr": "*bf16",
    "add1_ptr": "*bf16",
    "out_ptr": "*bf16",
    "dim": "i32",
    "stride_pt": "i32",
    "stride_pk": "i32",
    "stride_a0": "i32",
    "stride_a1": "i32",
    "stride_o": "i32",
    "K": "constexpr",
    "N_ADD": "constexpr",
    "BLOCK_D": "constexpr",
}
# DeepSeek-V4-Flash: 6 routes a token over D = 4,096; served: the shared expert added (1), or the CPU experts'
# part and the shared expert (2, hybrid); bf16 pairs and output on a GPU. A tensor-parallel rank sums its routed
# part alone into fp32 (the all-reduce's operand): no addend, fp32 out
COMPILE_CONFIGS = (
    ("shared", _SIG, {"K": 6, "N_ADD": 1, "BLOCK_D": BLOCK_D}),
    ("hybrid", _SIG, {"K": 6, "N_ADD": 2, "BLOCK_D": BLOCK_D}),
    ("rank_sum", {**_SIG, "out_ptr": "*fp32"}, {"K": 6, "N_ADD": 0, "BLOCK_D": BLOCK_D}),
)
LAUNCH_OPTIONS = {name: {"num_warps": 4} for name, _, _ in COMPILE_CONFIGS}
ALIGNED_INTS = ("dim", "stride_pt", "stride_pk", "stride_a0", "stride_a1", "stride_o")
