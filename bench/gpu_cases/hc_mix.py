"""The mHC kernels (dsv4_kernels.hc_mix) at DeepSeek-V4-Flash's size: hc_mult 4, dim 4096 (K = 16384,
24 mixes, 20 Sinkhorn rounds, from the real config.json), bf16 streams, for 1, 64 and 4096 tokens.

hc_pre reads the streams (32 KiB a token) and fn (1.5 MiB, once per program, from L2 after the first)
and writes x; bytes_moved counts the streams and fn once, so its GB/s is against the minimum traffic
(the kernel reads each token's streams a second time for x, mostly from L2). At 1 and 64 tokens the
time is one SM streaming fn (hc_mix.py's module doc): the GB/s there says how far that is from
bandwidth. hc_post reads out and the streams and writes the new streams; hc_post_combine reads the MoE's route
outputs and shared expert output instead of out (the sum made in the launch), against the two launches as baseline.

Reference: hc_mix_ref in fp32 (the model's torch path). Tolerance: x and the new streams within one
bf16 ulp (rtol 2^-7: both sides round nearby fp32 values); post and comb to atol 1e-4: their fp32 sums
over K = 16384 terms of S = rho sum |fn h| ~ 80 err by ~sqrt(K) u S ~ 1e-6 in practice (the worst-case
bound of tests/kernels/test_hc_mix.py is looser), and an error of the mixing's own making (a wrong row,
a missing eps at 1e-6 relative to entries near 0.25) is either O(0.1) or needs the CPU tests' exact
inputs. Baseline: dsv4serve.model.hc's torch path with the CUDA worker's numerics (~120 launches).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from bench.gpu_cases import GpuCase, real_config_dir
from dsv4_kernels.hc_mix import hc_post, hc_pre
from dsv4_kernels.hc_mix_ref import hc_post_ref, hc_pre_ref


def _torch_numerics():
    from dsv4serve.model.numerics import NUMERICS_ON

    return dataclasses.replace(NUMERICS_ON, batch_invariant=False)  # the CUDA worker's setting


def _pre_cases(device, n, hc, d, n_iters, hc_eps, norm_eps, gen) -> list[GpuCase]:
    from dsv4serve.model import hc as model_hc

    h = torch.randn(n, hc, d, device=device, generator=gen).to(torch.bfloat16)
    fn = torch.randn((2 + hc) * hc, hc * d, device=device, generator=gen) * (hc * d) ** -0.5
    scale = torch.tensor([1.3, 0.7, 2.1], device=device)
    base = torch.randn((2 + hc) * hc, device=device, generator=gen) * 0.5
    args = (h, fn, scale, base, n_iters, hc_eps, norm_eps)
    baseline = partial(model_hc.hc_pre, *args, _torch_numerics())
    bytes_moved = n * hc * d * 2 + fn.numel() * 4 + n * d * 2 + n * (hc + hc * hc) * 4
    cases = [
        GpuCase(
            f"hc_pre N={n} (x)",
            lambda: hc_pre(*args)[0],
            reference=lambda: hc_pre_ref(*args)[0],
            atol=1e-4,
            rtol=2.0**-7,
            bytes_moved=bytes_moved,
            baseline=baseline,
            baseline_name="torch hc_pre",
        )
    ]
    if n > 1:
        cases.append(
            GpuCase(
                f"hc_pre N={n} (post, comb; + a cat)",
                lambda: torch.cat([t.flatten() for t in hc_pre(*args)[1:]]),
                reference=lambda: torch.cat([t.flatten() for t in hc_pre_ref(*args)[1:]]),
                atol=1e-4,
                rtol=0.0,
                bytes_moved=bytes_moved,
            )
        )
    return cases


def _post_case(device, n, hc, d, gen) -> GpuCase:
    from dsv4serve.model import hc as model_hc

    h = torch.randn(n, hc, d, device=device, generator=gen).to(torch.bfloat16)
    out = torch.randn(n, d, device=device, generator=gen).to(torch.bfloat16)
    post = 2 * torch.rand(n, hc, device=device, generator=gen)
    comb = torch.rand(n, hc, hc, device=device, generator=gen)
    comb = comb / comb.sum(-1, keepdim=True)
    return GpuCase(
        f"hc_post N={n}",
        partial(hc_post, out, h, post, comb),
        reference=partial(hc_post_ref, out, h, post, comb),
        atol=1e-4,
        rtol=2.0**-7,
        bytes_moved=n * d * 2 + 2 * n * hc * d * 2 + n * (hc + hc * hc) * 4,
        baseline=partial(model_hc.hc_post, out, h, post, comb, _torch_numerics()),
        baseline_name="torch hc_post",
    )


def _post_combine_case(device, n, hc, d, gen) -> GpuCase:
    """The MoE output (6 routes and the shared expert) summed inside the post launch (dsv4_kernels.hc_post_combine),
    against the same sum and post as two launches (moe_combine, hc_post): its baseline."""
    from dsv4_kernels.hc_post_combine import hc_post_combine
    from dsv4_kernels.moe_combine import moe_combine
    from dsv4_kernels.moe_combine_ref import moe_combine_ref

    h = torch.randn(n, hc, d, device=device, generator=gen).to(torch.bfloat16)
    pairs = torch.randn(n, 6, d, device=device, generator=gen).to(torch.bfloat16)
    shared = (torch.randn(n, d, device=device, generator=gen).to(torch.bfloat16),)
    post = 2 * torch.rand(n, hc, device=device, generator=gen)
    comb = torch.rand(n, hc, hc, device=device, generator=gen)
    comb = comb / comb.sum(-1, keepdim=True)
    bf16 = torch.bfloat16
    return GpuCase(
        f"hc_post_combine N={n}",
        partial(hc_post_combine, pairs, shared, bf16, h, post, comb),
        reference=lambda: hc_post_ref(moe_combine_ref(pairs, shared, bf16), h, post, comb),
        atol=1e-4,
        rtol=2.0**-7,
        bytes_moved=n * 7 * d * 2 + 2 * n * hc * d * 2 + n * (hc + hc * hc) * 4,
        baseline=lambda: hc_post(moe_combine(pairs, shared, bf16), h, post, comb),
        baseline_name="moe_combine + hc_post",
    )


def build(device: torch.device, hc: int, d: int, n_iters: int, hc_eps: float, norm_eps: float, ns) -> list[GpuCase]:
    gen = torch.Generator(device=device).manual_seed(16)
    out = []
    for n in ns:
        out += _pre_cases(device, n, hc, d, n_iters, hc_eps, norm_eps, gen)
        out.append(_post_case(device, n, hc, d, gen))
        out.append(_post_combine_case(device, n, hc, d, gen))
    return out


def cases(device: torch.device) -> list[GpuCase]:
    from dsv4serve.model.args import read_model_args

    a = read_model_args(real_config_dir())
    return build(device, a.hc_mult, a.dim, a.hc_sinkhorn_iters, a.hc_eps, a.norm_eps, (1, 64, 4096))


def smoke_cases(device: torch.device) -> list[GpuCase]:
    """Tiny shapes for the CPU interpreter: a decode token and a ragged 70-token prefill (16-token blocks)."""
    return build(device, 4, 64, 20, 1e-6, 1e-6, (1, 70))
