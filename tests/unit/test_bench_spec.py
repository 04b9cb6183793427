"""Issue 19's benchmark parts: the speed-up arithmetic against a simulation, the bandwidth model against the
end-to-end case's own byte count, the verify sampler's host syncs (none) on the census counter, and the GPU case
module's import and its real-model rows' arithmetic without a GPU or a checkpoint."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # as tests/unit/test_step_census.py: before any kernel module import

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: `bench.*`

from bench.census.counter import StepCounter
from bench.spec_projection import BandwidthModel, distinct_experts, expected_tokens, speedup
from dsv4serve.ipc.sampling import SamplingParams
from dsv4serve.model.args import read_model_args
from dsv4serve.worker.sampling import SamplingRow, make_generator
from dsv4serve.worker.spec_sampling import verify


@pytest.mark.parametrize("num_drafts", [1, 2, 3])
@pytest.mark.parametrize("acceptance", [0.0, 0.5, 0.9, 1.0])
def test_expected_tokens_matches_a_simulation_of_independent_acceptance(acceptance: float, num_drafts: int):
    gen = torch.Generator().manual_seed(0)
    runs = 100_000
    accepted = torch.rand(runs, num_drafts, generator=gen) < acceptance  # each draft kept with probability a
    tokens = accepted.long().cumprod(dim=1).sum(dim=1) + 1  # the run of kept drafts, then the target's token
    mean, sigma = tokens.double().mean(), tokens.double().std() / runs**0.5
    assert abs(float(mean) - expected_tokens(acceptance, num_drafts)) <= 5 * float(sigma) + 1e-12
    # a step that costs as much as a decode step and yields E tokens is E times faster
    assert speedup(acceptance, num_drafts, 1.0, 1.0, 0.0) == pytest.approx(expected_tokens(acceptance, num_drafts))


def test_bandwidth_model_agrees_with_the_end_to_end_cases_decode_bytes(real_model_dir: Path):
    from bench.gpu_cases.end_to_end import decode_bytes_per_token

    real = read_model_args(real_model_dir)
    model = BandwidthModel.from_config(real)
    assert model.forward_bytes(1) == pytest.approx(decode_bytes_per_token(real), rel=1e-9)
    assert model.forward_bytes(4, independent=False) == pytest.approx(model.forward_bytes(1))  # same experts
    assert model.forward_bytes(1) < model.forward_bytes(4) < model.forward_bytes(1) + 3 * 6 * model.main_expert_bytes
    assert distinct_experts(256, 6, 1) == pytest.approx(6.0) and distinct_experts(256, 6, 100) < 256
    # one draft: the MTP block (one layer, ~0.2 GB with its experts' share) and the 1.06 GB bf16 head
    assert model.head_bytes == real.vocab_size * real.dim * 2
    assert 1.1e9 < model.draft_bytes(1, 1) < 1.4e9


def test_the_verify_sampler_never_waits_for_the_device():
    """The step's one read is the caller's: sampled, greedy and seeded rows mixed, nothing inside syncs."""
    rows = [
        SamplingRow(SamplingParams(temperature=0.7, top_p=0.9, top_k=20), (), (), 1),
        SamplingRow(SamplingParams(temperature=0.0), (), (), 1),
        SamplingRow(SamplingParams(temperature=1.0, seed=5), (), (), 1, make_generator(5, "cpu")),
    ]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 3, 64, generator=gen)
    q = torch.rand(3, 2, 64, generator=gen).softmax(-1)
    d = torch.multinomial(q.flatten(0, 1), 1, generator=gen).view(3, 2)
    with StepCounter() as seen:
        out = verify(logits, q, d, rows)
    assert seen.syncs == [], [s.site for s in seen.syncs]
    assert out.token_ids.shape == (3, 3)


def test_the_gpu_case_module_imports_and_reports_without_a_checkpoint(monkeypatch, tmp_path: Path):
    from bench.gpu_cases import spec_decode

    monkeypatch.delenv("DSV4_REAL_CHECKPOINT_DIR", raising=False)
    cases = spec_decode.cases(torch.device("cpu"))
    assert cases and all(c.name.startswith("spec verify sampler") for c in cases)  # no real-model rows
    assert "no real-model rows" in spec_decode.notes({}, {})[0]
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("DSV4_REAL_CHECKPOINT_DIR", str(tmp_path))
    assert spec_decode.checkpoint_dir() == tmp_path
    assert len(spec_decode.cases(torch.device("cpu"))) == len(cases)  # a CPU never starts the real model


def test_a_real_case_turns_metrics_deltas_into_acceptance():
    from bench.gpu_cases import spec_decode

    class FakeServers:  # what a server of N = 2 would answer: 10 verify steps, 20 drafts, 15 accepted
        seen = 0

        def counters(self, n):
            self.seen += 1
            k = 0 if self.seen == 1 else 1
            return dict(zip(spec_decode.COUNTERS, (10.0 * k, 20.0 * k, 15.0 * k)))

        def generate(self, n):
            return "text", 250, 2.0

        def close(self):
            pass

    results = {0: {"tok_s": 100.0}}
    case = spec_decode.RealCase(FakeServers(), 2, results)  # type: ignore[arg-type]
    assert torch.equal(case.run(), case.reference())
    assert case.notes() == [
        "spec_decode real N=2: 125.0 tok/s (1.25x N=0), acceptance 0.75, 2.50 tokens per verify step"
    ]
