"""Manifold-constrained hyper-connections (mHC), dsv4-model.md §2.1.

The residual is `hc_mult` streams per token. Each block site mixes them into one sub-layer input
(`pre`), and writes back `post * out + comb^T @ streams`, where `comb` is Sinkhorn-normalized.
All mixing runs in fp32; the streams themselves stay in the compute dtype.

With `num.backends.hc == "triton"` each of hc_pre, hc_post and hc_head is one Triton kernel launch
(dsv4_kernels.hc_mix; its tokens-per-program choice follows `num.batch_invariant`); the torch path
below, about 120 small ops per hc_pre (80 of them the Sinkhorn rounds), is the reference it matches; on the CPU
everything after the mixes is one compiled call (hc_cpu.py), bit for bit those ops.
hc_pre and hc_head take the sub-layer's RMSNorm (`norm`) that their x goes through next: with token_ops on
Triton too, the mHC launch that writes x applies it (one launch a site fewer); otherwise the norm module runs
after, as before.
"""

from __future__ import annotations

import torch

from dsv4serve.model import hc_cpu
from dsv4serve.model.layers import RMSNorm
from dsv4serve.model.moe_output import Combined
from dsv4serve.model.numerics import Numerics, in_fp64, matmul
from dsv4serve.model.sinkhorn_cpu import HC, sinkhorn_rounds_cpu


def _mixes(h: torch.Tensor, fn: torch.Tensor, norm_eps: float, num: Numerics) -> torch.Tensor:
    """h [N, hc, D] -> fn . flat(h) / rms(flat(h)) : [N, n_mix] fp32."""
    flat = h.flatten(1).float()
    rho = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return matmul(flat, fn.float(), num) * rho


def sinkhorn(logits: torch.Tensor, n_iters: int, eps: float) -> torch.Tensor:
    """[N, hc, hc] logits -> near doubly-stochastic comb: row softmax, then column/row rounds (on the CPU
    compiled, sinkhorn_cpu: the torch rounds bit for bit in one call instead of ~120 tiny ops)."""
    comb = in_fp64(lambda z: torch.softmax(z, dim=-1), logits).add_(eps)
    fits = comb.dtype == torch.float32 and comb.shape[1:] == (HC, HC) and comb.is_contiguous()
    on_cpu = fits and comb.device.type == "cpu" and not comb.requires_grad
    # in place on comb's memory; False where numba cannot compile (sinkhorn_cpu.compiled): torch's rounds then
    if not (on_cpu and sinkhorn_rounds_cpu(comb.numpy(), n_iters, eps)):
        sinkhorn_rounds(comb, n_iters, eps)
    return comb


def sinkhorn_rounds(comb: torch.Tensor, n_iters: int, eps: float) -> None:
    """The column / row rounds in torch, in place on comb [N, hc, hc] fp32 (20 rounds of tiny ops): the
    reference of the compiled CPU rounds and of the mHC kernels."""
    comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))
    for _ in range(n_iters - 1):
        comb.div_(comb.sum(dim=-1, keepdim=True).add_(eps))
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(eps))


def hc_pre(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    n_iters: int,
    hc_eps: float,
    norm_eps: float,
    num: Numerics,
    norm: RMSNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [N, hc, D] -> (x [N, D] in h's dtype, post [N, hc] fp32, comb [N, hc, hc] fp32); x through `norm`
    when given (module doc)."""
    if num.backends.hc == "triton":
        import dsv4_kernels.hc_mix as hc_mix  # lazy, as for the other kernels

        block_n = hc_mix.pick_block_n(h.shape[0], num.batch_invariant)
        fused = _fused_norm(norm, num)
        x, post, comb = hc_mix.hc_pre(h, fn, scale, base, n_iters, hc_eps, norm_eps, block_n=block_n, norm=fused)
        return (x if fused or norm is None else norm(x, num)), post, comb
    hc = h.shape[1]
    m = _mixes(h, fn, norm_eps, num)
    if h.device.type == "cpu" and (done := hc_cpu.gates_and_mix(m, scale, base, h, hc_eps, n_iters)) is not None:
        x, post, comb = done  # compiled: the ops below in one call (hc_cpu.py)
        return (x if norm is None else norm(x, num)), post, comb
    scale, base = scale.float(), base.float()
    pre = in_fp64(torch.sigmoid, m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * in_fp64(torch.sigmoid, m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb_logits = m[:, 2 * hc :].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc :].view(hc, hc)
    comb = sinkhorn(comb_logits, n_iters, hc_eps)
    x = (pre.unsqueeze(-1) * h.float()).sum(dim=1).to(h.dtype)
    return (x if norm is None else norm(x, num)), post, comb


def _fused_norm(norm: RMSNorm | None, num: Numerics) -> tuple[torch.Tensor, float] | None:
    """The (weight, eps) the mHC kernel applies itself: when the norm would run on token_ops' Triton kernel."""
    return None if norm is None or num.backends.token_ops != "triton" else (norm.weight, norm.eps)


def hc_post(
    out: torch.Tensor | Combined, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, num: Numerics
) -> torch.Tensor:
    """new[k] = post[k] * out + sum_j comb[j, k] * h[j]; out [N, D], h [N, hc, D] -> [N, hc, D]. out `Combined`
    (an MoE output not yet summed): on Triton the post launch sums it (dsv4_kernels.hc_post_combine)."""
    if num.backends.hc == "triton":
        import dsv4_kernels.hc_mix as hc_mix

        if isinstance(out, Combined):
            from dsv4_kernels.hc_post_combine import hc_post_combine

            return hc_post_combine(out.pairs, out.addends, out.dtype, h, post, comb)
        return hc_mix.hc_post(out, h, post, comb)
    if isinstance(out, Combined):
        out = out.value()
    mixed = (comb.unsqueeze(-1) * h.float().unsqueeze(2)).sum(dim=1)  # a plain sum: row-invariant
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed).to(h.dtype)


def hc_head(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    num: Numerics,
    norm: RMSNorm | None = None,
) -> torch.Tensor:
    """Final collapse of the streams: h [N, hc, D] -> [N, D] in h's dtype (no Sinkhorn, no post); through `norm`
    when given (module doc)."""
    if num.backends.hc == "triton":
        import dsv4_kernels.hc_mix as hc_mix

        block_n = hc_mix.pick_block_n(h.shape[0], num.batch_invariant)
        fused = _fused_norm(norm, num)
        x = hc_mix.hc_head(h, fn, scale, base, hc_eps, norm_eps, block_n=block_n, norm=fused)
        return x if fused or norm is None else norm(x, num)
    m = _mixes(h, fn, norm_eps, num)
    if h.device.type == "cpu" and (done := hc_cpu.gates_and_mix(m, scale, base, h, hc_eps, 0)) is not None:
        x = done[0]  # compiled: the ops below in one call (hc_cpu.py)
        return x if norm is None else norm(x, num)
    pre = in_fp64(torch.sigmoid, m * scale.float() + base.float()) + hc_eps
    x = (pre.unsqueeze(-1) * h.float()).sum(dim=1).to(h.dtype)
    return x if norm is None else norm(x, num)
