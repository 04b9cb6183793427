"""flashinfer's sampling kernels in the sampler (worker/sampling_flashinfer.py): when they draw, with what.

flashinfer runs only on CUDA; here a stand-in module implements its documented semantics of
`top_k_top_p_sampling_from_logits` (top_k_first: keep the k largest logits, softmax, keep the smallest set
of most likely tokens whose mass reaches p, draw) in plain torch, written from flashinfer's docs and not
from our stages. The sampler's draws through it must follow the same distribution as the torch draw, and
it must never serve a seeded row, a min-p row or an all-greedy step. On a lent GPU bench/gpu_cases/sampling.py
checks the real kernels the same way and times them against the torch draw.
"""

from __future__ import annotations

import types

import pytest
import torch

from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.worker import sampling, sampling_flashinfer
from dsv4serve.worker.sampling import SamplingRow, make_generator, sample

V = 12


class FakeFlashinfer:
    """flashinfer.sampling's top_k_top_p_sampling_from_logits, as documented, counting its calls."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def top_k_top_p_sampling_from_logits(self, logits, top_k, top_p, filter_apply_order, deterministic, generator):
        self.calls.append({"top_k": top_k, "top_p": top_p, "order": filter_apply_order, "rows": logits.shape[0]})
        b, v = logits.shape
        k = torch.as_tensor(top_k).expand(b).long()
        p = torch.as_tensor(top_p, dtype=torch.float32).expand(b)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        probs = logits.masked_fill(logits < kth, float("-inf")).softmax(dim=-1)
        desc, order = probs.sort(dim=-1, descending=True)
        mass_before = desc.cumsum(dim=-1) - desc
        keep_sorted = mass_before < p[:, None]
        keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
        probs = probs * keep
        return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=generator).squeeze(1).int()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeFlashinfer:
    module = FakeFlashinfer()
    monkeypatch.setattr(sampling, "flashinfer_sampling", lambda device: module)
    return module


def _rows(params: SamplingParams, n: int, seeded: bool = False) -> list[SamplingRow]:
    return [SamplingRow(params, (), (), None, make_generator(i, "cpu") if seeded else None) for i in range(n)]


def _histogram(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).double() / tokens.numel()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=4),
        SamplingParams(temperature=0.9, top_p=0.6),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.8),
    ],
)
def test_flashinfer_draws_the_torch_distribution(fake: FakeFlashinfer, monkeypatch: pytest.MonkeyPatch, params):
    # 20,000 rows of one distribution: each bin's frequency has a standard error below 0.0036, so the two draws'
    # total variation distance stays far below 0.03 unless the temperature or a filter is applied differently
    n = 20_000
    logits = torch.linspace(-1.5, 2.0, V).repeat(n, 1)
    ours = sample(logits, _rows(params, n), torch.Generator().manual_seed(1)).token_ids
    assert len(fake.calls) == 1 and fake.calls[0]["order"] == "top_k_first"
    monkeypatch.setattr(sampling, "flashinfer_sampling", lambda device: None)
    torch_draw = sample(logits, _rows(params, n), torch.Generator().manual_seed(2)).token_ids
    tv = 0.5 * (_histogram(ours) - _histogram(torch_draw)).abs().sum().item()
    assert tv < 0.03, tv
    # and the filters hold exactly: no token outside the top-k / top-p set is ever drawn
    allowed = set(torch_draw.unique().tolist()) | set(range(V - (params.top_k or V), V))
    assert set(ours.unique().tolist()) <= allowed


def test_top_k_off_and_top_p_off_are_flashinfer_no_filter_values(fake: FakeFlashinfer):
    rows = [
        SamplingRow(SamplingParams(temperature=1.0, top_k=3), (), (), None),
        SamplingRow(SamplingParams(temperature=1.0), (), (), None),
        SamplingRow(SamplingParams(temperature=1.0, top_p=0.5), (), (), None),
    ]
    sample(torch.randn(3, V), rows, torch.Generator().manual_seed(0))
    (call,) = fake.calls
    assert torch.as_tensor(call["top_k"]).tolist() == [3, V, V]
    assert torch.as_tensor(call["top_p"]).tolist() == [1.0, 1.0, 0.5]


def test_greedy_rows_keep_their_argmax_beside_flashinfer_rows(fake: FakeFlashinfer):
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3))
    rows = _rows(SamplingParams(temperature=0.0), 3) + _rows(SamplingParams(temperature=1.0), 3)
    out = sample(logits, rows, torch.Generator().manual_seed(0)).token_ids
    assert len(fake.calls) == 1
    assert out[:3].tolist() == logits[:3].argmax(-1).tolist()


@pytest.mark.parametrize(
    "rows",
    [
        _rows(SamplingParams(temperature=1.0, seed=5), 2, seeded=True),  # seeded: its own generator's noise
        _rows(SamplingParams(temperature=1.0, min_p=0.1), 2),  # min-p after top-p: not flashinfer's order
        _rows(SamplingParams(temperature=0.0), 2),  # nothing to draw
    ],
    ids=["seeded", "min_p", "greedy"],
)
def test_flashinfer_never_serves_rows_it_would_draw_differently(fake: FakeFlashinfer, rows):
    sample(torch.randn(2, V), rows, torch.Generator().manual_seed(0))
    assert fake.calls == []


def test_only_cuda_and_only_when_enabled(monkeypatch: pytest.MonkeyPatch):
    stand_in = types.SimpleNamespace()
    monkeypatch.setattr(sampling_flashinfer, "_import_flashinfer_sampling", lambda: stand_in)
    sampling_flashinfer._enabled.cache_clear()
    try:
        assert sampling_flashinfer.flashinfer_sampling(torch.device("cpu")) is None
        assert sampling_flashinfer.flashinfer_sampling(torch.device("cuda", 0)) is stand_in
        monkeypatch.setenv("DSV4SERVE_FLASHINFER_SAMPLING", "0")
        sampling_flashinfer._enabled.cache_clear()
        assert sampling_flashinfer.flashinfer_sampling(torch.device("cuda", 0)) is None
    finally:
        sampling_flashinfer._enabled.cache_clear()
