"""bench/decode_timeline.py and bench/bench_cpu_experts.py: the parts a wrong number would come from."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from dsv4serve.memory import decode_speed as ds
from dsv4serve.model.args import read_model_args
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.schema import checkpoint_schema

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def timeline():
    return _load("decode_timeline")


def test_the_rates_it_says_the_target_needs_do_reach_it(timeline):
    ns = argparse.Namespace(
        host_bandwidth=80.0, h2d_bandwidth=50.0, cpu_efficiency=0.5, grid_host=[80.0], grid_efficiency=[0.5]
    )
    r = timeline.run(ns)
    args = read_model_args(REPO / "tests" / "data" / "DeepSeek-V4-Flash")
    b = ds.decode_bytes(checkpoint_schema(args), args, KernelBackends.every("triton"))
    slots, bw = r["slots"], ds.Bandwidths(1790.0, 50.0, 80.0, 0.5)
    need_host, need_hits = r["required_host_gbps"], r["required_hit_rate"]
    at = ds.project_decode(b, slots, ds.Bandwidths(1790.0, 50.0, need_host, 0.5)).tokens_per_second
    below = ds.project_decode(b, slots, ds.Bandwidths(1790.0, 50.0, need_host * 0.98, 0.5)).tokens_per_second
    assert below < timeline.TARGET_TOKENS_S <= at + 1e-6
    assert ds.project_decode(b, slots, bw, hit_rate=need_hits).tokens_per_second >= timeline.TARGET_TOKENS_S - 1e-6
    assert ds.project_decode(b, slots, bw, hit_rate=need_hits - 0.01).tokens_per_second < timeline.TARGET_TOKENS_S
    # FreeToken: 258 uses x 12.75 MiB = 3.45 GB a token at 119.5 GB/s (issue 18's numbers)
    assert r["freetoken"]["moe_only_ceiling_tokens_s"] == pytest.approx(119.5e9 / (258 * 12.75 * 2**20))
    assert r["grid_tokens_s"]["80 GB/s x 0.5"] == pytest.approx(r["projections"]["hybrid"]["tokens_per_second"], 0.01)
    # the 128 GiB host itself cannot hold the 137 GiB bank: part of it on disk, the graphs cut at those layers
    run_on = r["as_run_on_128_gib"]
    # 120 GiB of RAM, less one layer's pinned staging area (137.06 / 43 GiB)
    assert run_on["offload"]["tiers"]["disk"] == pytest.approx(1 - (120 - 137.06 / 43) / 137.06, abs=1e-3)
    assert run_on["offload"]["eager"] is None and run_on["hybrid"]["eager"] is None
    assert run_on["offload"]["tokens_per_second"] < r["projections"]["offload"]["tokens_per_second"]


def test_the_torch_expert_path_matches_the_kt_oracle_on_a_small_layer():
    experts = _load("bench_cpu_experts")
    spec = importlib.util.spec_from_file_location("kt_oracle", REPO / "tests" / "unit" / "kt_oracle.py")
    kt_oracle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kt_oracle)
    parts = experts.random_experts(8, dim=256, inter=128)  # small dimensions: the oracle loops in Python
    g = torch.Generator().manual_seed(3)
    x, ids, w = experts.routing(3, 8, g, dim=256)
    got = experts.TorchExperts(parts).forward(x, ids, w)
    want = kt_oracle.kt_reference(x, ids, w, parts, experts.LIMIT)
    # the oracle rounds each expert's output to bf16 before the weighted sum; the bench sums in fp32
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=1e-2 * want.float().abs().max().item())
    assert int(12.75 * 2**20) == experts.EXPERT_BYTES
