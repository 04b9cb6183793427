"""numerics._round_e2m1, both its forms (the bucketize below E2M1_ROUND_ELEMENTS values, the grid's steps from
it), against dsv4_kernels.formats.round_e2m1 (nearest by distance, ties to the even code): bit for bit on
every fp32 tie point, its neighbours one ulp either side, and a dense sweep of [-6, 6], signed zeros included."""

from __future__ import annotations

import torch

from dsv4_kernels.formats import round_e2m1
from dsv4serve.model.numerics import E2M1_ROUND_ELEMENTS, _round_e2m1


def _values() -> torch.Tensor:
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    points = torch.cat([ties, grid, torch.linspace(0, 6, 200_001)])
    up, down = torch.nextafter(points, torch.tensor(7.0)), torch.nextafter(points, torch.tensor(-1.0))
    v = torch.cat([points, up, down]).clamp(0, 6)
    return torch.cat([v, -v])  # -0.0 among them


def test_both_forms_round_as_the_reference_bit_for_bit():
    v = _values()
    assert v.numel() >= E2M1_ROUND_ELEMENTS  # the step form
    want = round_e2m1(v)
    got = _round_e2m1(v)
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    small = v[torch.randperm(v.numel(), generator=torch.Generator().manual_seed(0))[: E2M1_ROUND_ELEMENTS - 1]]
    got_small = _round_e2m1(small)  # the bucketize form
    assert torch.equal(got_small, round_e2m1(small)) and torch.equal(got_small.signbit(), round_e2m1(small).signbit())
