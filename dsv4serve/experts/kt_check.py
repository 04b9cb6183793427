"""kt-kernel's MXFP4 experts checked against a torch reference before --moe-backend hybrid trusts them.

kt-kernel picks its build for the CPU it runs on (AVX2, AVX-512, AMX). At dsv4-tiny's expert shape (D = I = 128)
its output equals `kt_reference` bit for bit at batch 1 (tests/unit/test_kt_experts.py, on AVX2, AVX-512 and AMX
machines). At DeepSeek-V4-Flash's (D 4096, I 2048) every build is within 8e-4 relative L2 of it (bf16 roundings of
gate / up / SwiGLU that a longer fp32 sum moves by an ulp), and the AMX build equals the avx512_bf16 one bit for
bit and the AVX2 one within 7.3e-4 (bench/kt_builds.py, bench/RESULTS.md 2026-12-06). On the H200 host lent on
2026-12-04 (a Xeon with AMX) the hybrid decode step of a random 2-layer model differed from the offload step by 2
logits (bench/gpu_runs/2026-12-04b/2_gpu_check.log): not a wrong build. That step differs by design, since kt-
kernel feeds w2 the bf16 SwiGLU output where the model quantizes it to FP8 (2.5-2.7% on an expert's output; this
reference follows kt-kernel there, so it checks the build and not that), and the chaotic model amplifies that
difference (bench/gpu_cases/decode_step.py now checks each layer). Still, at start-up `verify_kt` runs a few tokens
through a layer's experts on kt-kernel and through `kt_reference`, and refuses a build whose output is off by more
than rounding (experts/attach.py then falls back to the offload path, or stops an explicit --moe-backend hybrid)
instead of serving wrong tokens: a future build or CPU is checked, not trusted. kt-kernel's notes put its AMX MXFP4
path at ~0.24% relative L2 from an fp32 reference: MAX_RELATIVE_ERROR leaves room for that.

The reference (also the tests' oracle, tests/unit/kt_oracle.py): per routed expert, gate and up rounded to
bf16, the clamped SwiGLU rounded to bf16, the down projection rounded to bf16; the experts' outputs summed
with the fp32 routing weights, the sum rounded to bf16. The weights are dequantized by
dsv4_kernels.formats (the repository's own MXFP4 reference), not by kt-kernel.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from dsv4_kernels.formats import dequant_fp4

CHECK_TOKENS = 2  # tokens through CHECK_EXPERTS experts each: a second or so at DeepSeek-V4-Flash's sizes
CHECK_EXPERTS = 2
MAX_RELATIVE_ERROR = 2.0**-6  # bit for bit where tested; this leaves room for another summation order


def expert_out(x: torch.Tensor, parts: Mapping[str, torch.Tensor], e: int, limit: float) -> torch.Tensor:
    """x [D] bf16 -> one expert's output [D], bf16 values held in fp32."""
    w1, w3, w2 = (dequant_fp4(parts[p][e], parts[f"{p}_scale"][e]) for p in ("w1", "w3", "w2"))
    gate = (x.float() @ w1.T).bfloat16().float().clamp(max=limit)
    up = (x.float() @ w3.T).bfloat16().float().clamp(-limit, limit)
    act = (F.silu(gate) * up).bfloat16().float()
    return (act @ w2.T).bfloat16().float()


def kt_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    parts: Mapping[str, torch.Tensor],
    limit: float,
    skip: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """x [T, D], ids [T, k] (-1 and `skip` left out), weights [T, k] fp32 -> [T, D] bf16."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= 0 and e not in skip:
                out[t] += weights[t, j].float() * expert_out(x[t], parts, e, limit)
    return out.bfloat16()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (L2, in fp32; NaN when either holds one)."""
    want = want.float()
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


def verify_kt(kt, layer: int, parts: Mapping[str, torch.Tensor], limit: float) -> float:
    """kt-kernel (a KtExperts holding `layer`, whose packed experts are `parts`) against `kt_reference` on
    CHECK_TOKENS random tokens routed to CHECK_EXPERTS experts: the relative error (L2). ValueError past
    MAX_RELATIVE_ERROR, naming the build."""
    g = kt.geometry
    gen = torch.Generator().manual_seed(layer)
    x = torch.randn(CHECK_TOKENS, g.dim, generator=gen).to(torch.bfloat16)
    ids = torch.full((CHECK_TOKENS, g.topk), -1, dtype=torch.int64)
    ids[:, :CHECK_EXPERTS] = torch.randperm(g.n_experts, generator=gen)[:CHECK_EXPERTS]
    weights = torch.rand(CHECK_TOKENS, g.topk, generator=gen)
    err = relative_error(kt.forward(layer, x, ids, weights), kt_reference(x, ids, weights, parts, limit))
    if not err <= MAX_RELATIVE_ERROR:  # NaN fails too
        raise ValueError(
            f"kt-kernel's {kt.variant} build disagrees with the torch MXFP4 reference on layer {layer} "
            f"(relative error {err:.3g}, allowed {MAX_RELATIVE_ERROR:.3g}): its CPU experts are not used"
        )
    return err
