"""The MoE layer's output combined inside the mHC post launch that reads it: `moe_combine` then `hc_post` as one
launch (issue 16: launches a layer).

    new = hc_post_combine(pairs, addends, out_dtype, h, post, comb)
        == hc_mix.hc_post(moe_combine(pairs, addends, out_dtype), h, post, comb), bit for bit

pairs [N, k, D] (the MXFP4 kernel's per-route outputs), addends up to two [N, D] (the shared expert's output; under
hybrid the CPU experts' part first), out_dtype the MoE output's dtype (the compute dtype), h [N, hc, D], post
[N, hc], comb [N, hc, hc] fp32 -> new [N, hc, D] in h's dtype.

Each post program (hc_mix.post_tile's tokens and channels) first forms its tile of the MoE output as moe_combine
does (fp32 zero, the k routes added in order, then each addend, then the rounding to out_dtype: to the nearest
bf16 by bits, ties to even, as a GPU's bf16 store rounds), then runs hc_mix's post on it (hc_mix_tiles._post_tile):
the [N, D] MoE output is never stored nor read back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_kernels.fp4_moe_tiles import _round_bf16
from dsv4_kernels.hc_mix import NUM_STAGES, NUM_WARPS, _hcp, interpreting, post_operands, post_tile
from dsv4_kernels.hc_mix_tiles import _post_rows, _post_tile
from dsv4_kernels.moe_combine import combine_operands
from dsv4_kernels.outputs import output_buffer


@triton.jit
def hc_post_combine_kernel(
    pairs_ptr, add0_ptr, add1_ptr, h_ptr, post_ptr, comb_ptr, new_ptr,
    N, D, stride_pt, stride_pk, stride_a0, stride_a1, stride_hn, stride_pn, stride_cn, stride_cj, stride_yn,
    stride_yk,
    K: tl.constexpr, N_ADD: tl.constexpr, X_BF16: tl.constexpr, HC: tl.constexpr, HCP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """See the module doc. Grid (cdiv(N, BLOCK_N), cdiv(D, BLOCK_D)); X_BF16: the MoE output is bf16 (rounded
    here), else fp32 (as summed); ROUND_BF16: the new values rounded by bits (the interpreter's bf16 rule)."""
    n, t_ok, offs_d, d_ok = _post_rows(N, D, BLOCK_N, BLOCK_D)
    td_ok = t_ok[:, None] & d_ok[None, :]
    x = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    route = pairs_ptr + n[:, None] * stride_pt + offs_d[None, :]
    for j in tl.static_range(K):
        x += tl.load(route + j * stride_pk, mask=td_ok, other=0.0).to(tl.float32)
    if N_ADD >= 1:
        x += tl.load(add0_ptr + n[:, None] * stride_a0 + offs_d[None, :], mask=td_ok, other=0.0).to(tl.float32)
    if N_ADD >= 2:
        x += tl.load(add1_ptr + n[:, None] * stride_a1 + offs_d[None, :], mask=td_ok, other=0.0).to(tl.float32)
    if X_BF16:
        x = _round_bf16(x)
    _post_tile(
        x, n, t_ok, offs_d, d_ok, h_ptr, post_ptr, comb_ptr, new_ptr,
        D, stride_hn, stride_pn, stride_cn, stride_cj, stride_yn, stride_yk, HC, HCP, BLOCK_N, BLOCK_D, ROUND_BF16,
    )  # fmt: skip


def hc_post_combine(
    pairs: torch.Tensor,
    addends: tuple[torch.Tensor, ...],
    out_dtype: torch.dtype,
    h: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    new_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See the module doc: new [N, hc, D] in h's dtype, one launch."""
    h, post, comb = post_operands(h, post, comb)
    n, hc, d = h.shape
    if pairs.dim() != 3 or pairs.shape[0] != n or pairs.shape[2] != d:
        raise ValueError(f"pairs must be [{n}, k, {d}] for h {tuple(h.shape)}, got {tuple(pairs.shape)}")
    pairs, adds = combine_operands(pairs, addends)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the MoE output is bf16 or fp32, not {out_dtype}")
    new = output_buffer(new_out, (n, hc, d), h.dtype, h.device)
    if n:
        a0 = adds[0] if adds else pairs  # never read without N_ADD
        a1 = adds[1] if len(adds) > 1 else pairs
        block_n, block_d = post_tile(hc, d)
        hc_post_combine_kernel[(triton.cdiv(n, block_n), triton.cdiv(d, block_d))](
            pairs, a0, a1, h, post, comb, new,
            n, d, pairs.stride(0), pairs.stride(1), a0.stride(0), a1.stride(0), h.stride(0), post.stride(0),
            comb.stride(0), comb.stride(1), new.stride(0), new.stride(1),
            K=pairs.shape[1], N_ADD=len(adds), X_BF16=out_dtype == torch.bfloat16, HC=hc, HCP=_hcp(hc),
            BLOCK_N=block_n, BLOCK_D=block_d, ROUND_BF16=interpreting() and h.dtype == torch.bfloat16,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )  # fmt: skip
    return new


_SIG = {
    **dict.fromkeys(("pairs_ptr", "add0_ptr", "add1_ptr", "h_ptr", "new_ptr"), "*bf16"),
    **dict.fromkeys(("post_ptr", "comb_ptr"), "*fp32"),
    **dict.fromkeys(("N", "D", "stride_pt", "stride_pk", "stride_a0", "stride_a1", "stride_hn"), "i32"),
    **dict.fromkeys(("stride_pn", "stride_cn", "stride_cj", "stride_yn", "stride_yk"), "i32"),
    **dict.fromkeys(("K", "N_ADD", "X_BF16", "HC", "HCP", "BLOCK_N", "BLOCK_D", "ROUND_BF16"), "constexpr"),
}
# DeepSeek-V4-Flash: 6 routes a token, hc_mult 4, D 4,096, bf16 everywhere; the shared expert added (1), or the CPU
# experts' part and the shared expert (2, hybrid)
_REAL = {"K": 6, "X_BF16": True, "HC": 4, "HCP": 4, "BLOCK_N": post_tile(4, 4096)[0], "BLOCK_D": post_tile(4, 4096)[1]}
COMPILE_CONFIGS = (
    ("shared", _SIG, {**_REAL, "N_ADD": 1, "ROUND_BF16": False}),
    ("hybrid", _SIG, {**_REAL, "N_ADD": 2, "ROUND_BF16": False}),
)
LAUNCH_OPTIONS = {name: {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES} for name, _, _ in COMPILE_CONFIGS}
ALIGNED_INTS = (
    "D",
    "stride_pt",
    "stride_pk",
    "stride_a0",
    "stride_a1",
    "stride_hn",
    "stride_cn",
    "stride_yn",
    "stride_yk",
)
