"""The start-up check of kt-kernel's experts (dsv4serve/experts/kt_check.py), without kt-kernel: a stand-in
that computes the torch reference passes, one that is off by a bf16-sized amount passes, and ones that return
zeros, NaN or another expert's output are refused with the build named (the real build's check runs in
tests/unit/test_kt_experts.py's environment through attach_cpu_experts, CI's kt-kernel step)."""

from __future__ import annotations

import pytest
import torch

from dsv4_kernels.formats import quant_fp4
from dsv4serve.experts.kt_backend import KtGeometry
from dsv4serve.experts.kt_check import kt_reference, verify_kt

GEOMETRY = KtGeometry(n_experts=6, topk=3, dim=64, inter_dim=64, swiglu_limit=7.0)


def _parts() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    parts = {}
    for name, (n, k) in {"w1": (64, 64), "w3": (64, 64), "w2": (64, 64)}.items():
        codes, scales = zip(*(quant_fp4(0.2 * torch.randn(n, k, generator=gen)) for _ in range(GEOMETRY.n_experts)))
        parts[name], parts[f"{name}_scale"] = torch.stack(codes), torch.stack(scales)
    return parts


class StandIn:
    """What verify_kt reads of a KtExperts: geometry, variant, forward."""

    def __init__(self, parts, change=lambda out, ids: out):
        self.geometry, self.variant, self.parts, self.change = GEOMETRY, "stand-in", parts, change

    def forward(self, layer, x, ids, weights):
        return self.change(kt_reference(x, ids, weights, self.parts, GEOMETRY.swiglu_limit), ids)


def test_the_reference_passes_and_a_bf16_step_is_tolerated() -> None:
    parts = _parts()
    assert verify_kt(StandIn(parts), 3, parts, GEOMETRY.swiglu_limit) == 0.0
    nudged = StandIn(parts, lambda out, ids: (out.float() * (1 + 2.0**-8)).bfloat16())
    assert 0 < verify_kt(nudged, 3, parts, GEOMETRY.swiglu_limit) <= 2.0**-6


@pytest.mark.parametrize(
    "change",
    [
        lambda out, ids: torch.zeros_like(out),
        lambda out, ids: torch.full_like(out, float("nan")),
        lambda out, ids: out.flip(-1),  # the right values in the wrong places
    ],
    ids=["zeros", "nan", "scrambled"],
)
def test_a_build_that_computes_something_else_is_refused(change) -> None:
    parts = _parts()
    with pytest.raises(ValueError, match="stand-in build disagrees .* layer 3"):
        verify_kt(StandIn(parts, change), 3, parts, GEOMETRY.swiglu_limit)
