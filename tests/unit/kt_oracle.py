"""The torch oracle for kt-kernel's MXFP4 experts (issue 18, checked bit for bit at batch 1): per routed
expert, gate and up rounded to bf16, clamped SwiGLU rounded to bf16, down projection rounded to bf16; the
experts' outputs summed in route order with the fp32 routing weights, the sum rounded to bf16. The
weights are dequantized by dsv4_kernels.formats (the repository's own MXFP4 reference), not by kt-kernel.
Loaded by path (tests run with --import-mode=importlib)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4_kernels.formats import dequant_fp4


def expert_out(x: torch.Tensor, parts: dict[str, torch.Tensor], e: int, limit: float) -> torch.Tensor:
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
    parts: dict[str, torch.Tensor],
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
