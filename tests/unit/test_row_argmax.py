"""The sampler's two-level CPU argmax against torch.argmax (the oracle): the same index for every row, ties,
NaN, infinities and signed zeros included; the masked variant against a masked copy, leaving the logits as
they were, bit for bit."""

from __future__ import annotations

import pytest
import torch

from dsv4serve.worker.row_argmax import BLOCK, argmax_without, row_argmax

VOCAB = 129_280  # DeepSeek-V4's: a multiple of BLOCK, so the two-level path runs


def _logits(kind: str, rows: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, VOCAB, generator=gen)
    if kind == "ties":  # many equal maxima, across and inside blocks
        x = torch.randint(-3, 4, (rows, VOCAB), generator=gen).float()
    elif kind == "nan":
        x[:, torch.randint(0, VOCAB, (5,), generator=gen)] = float("nan")
    elif kind == "all -inf":
        x.fill_(float("-inf"))
    elif kind == "inf":
        x[:, [7, BLOCK + 3, VOCAB - 1]] = float("inf")
    elif kind == "signed zeros":
        x = torch.full((rows, VOCAB), -1.0)
        x[:, 5 * BLOCK + 1] = -0.0
        x[:, 3] = 0.0
    elif kind == "last block":
        x[:, -1] = 100.0
    return x


KINDS = ["random", "ties", "nan", "all -inf", "inf", "signed zeros", "last block"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_row_argmax_is_torch_argmax(kind: str, rows: int) -> None:
    x = _logits(kind, rows, torch.Generator().manual_seed(rows))
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_row_argmax_on_other_shapes_falls_back_to_torch() -> None:
    x = torch.randn(2, 1000)  # not a multiple of BLOCK
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    y = torch.randn(4, VOCAB)[:, :-BLOCK]  # non-contiguous rows: reshape copies, the result stays
    assert torch.equal(row_argmax(y), y.argmax(dim=-1))


@pytest.mark.parametrize("kind", KINDS)
def test_argmax_without_masks_like_a_copy_and_restores_the_logits(kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    x = _logits(kind, 4, gen)
    best = x.argmax(dim=-1)
    # mask every row's own argmax (and one token twice): the answer must move to the runner-up
    flat_index = torch.cat([torch.arange(4) * VOCAB + best, torch.tensor([VOCAB + 11, VOCAB + 11])])
    want = x.clone().view(-1).index_fill_(0, flat_index, float("-inf")).view(x.shape).argmax(dim=-1)
    before = x.clone()
    assert torch.equal(argmax_without(x, flat_index), want)
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))  # bitwise, NaN payloads included


def test_argmax_without_takes_inference_tensors_outside_inference_mode() -> None:
    """A forward's logits are inference tensors, and the sampler runs outside inference mode."""
    with torch.inference_mode():
        x = torch.randn(2, VOCAB)
    flat_index = torch.tensor([int(x[0].argmax())])
    assert int(argmax_without(x, flat_index)[0]) != int(x[0].argmax())
    assert torch.equal(argmax_without(x, None), x.argmax(dim=-1))
