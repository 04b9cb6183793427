"""KV capacity on a (faked) CUDA device: free memory after the weights, minus the platform margin, the
sequence slots and one planned chunk, in whole pages; an explicit --num-tokens is honoured or refused."""

from __future__ import annotations

import pytest
import torch

from dsv4serve.memory import capacity
from dsv4serve.memory.chunk_planner import PLATFORM_MARGIN_BYTES, MemorySnapshot, prefill_geometry
from dsv4serve.memory.kv_geometry import kv_geometry
from dsv4serve.model.args import read_model_args

GIB = 2**30
CUDA = torch.device("cuda")


@pytest.fixture
def real(real_model_dir, monkeypatch):
    args = read_model_args(real_model_dir)
    monkeypatch.setattr(
        capacity, "take_snapshot", lambda device, ratio, **kw: MemorySnapshot(20 * GIB, 32 * GIB, "wsl2")
    )
    return args, prefill_geometry(args, context_tokens=65536)


def test_auto_capacity_fills_what_is_left_in_whole_pages(real):
    args, geo = real
    tokens = capacity.kv_capacity(args, CUDA, 2, 8, 10**9, None, 0.9, 2048, geo)
    kv = kv_geometry(args)
    keep = (
        PLATFORM_MARGIN_BYTES["wsl2"] + 8 * kv.seq_state_bytes + 2048 * geo.activation_bytes_per_token + geo.fixed_bytes
    )
    assert tokens % 128 == 0 and 0 <= (20 * GIB - keep) - tokens * kv.bytes_per_token < 128 * kv.bytes_per_token
    assert capacity.kv_capacity(args, CUDA, 2, 8, 4096, None, 0.9, 2048, geo) == 4096  # no more than usable


def test_explicit_num_tokens_is_honoured_or_refused_by_name(real):
    args, geo = real
    assert capacity.kv_capacity(args, CUDA, 2, 8, 10**9, 1000 * 128, 0.9, 2048, geo) == 1000 * 128
    with pytest.raises(capacity.CapacityError, match="--num-tokens 100000000 does not fit"):
        capacity.kv_capacity(args, CUDA, 2, 8, 10**9, 10**8, 0.9, 2048, geo)


def test_cpu_capacity_is_the_setting_or_the_default():
    from dsv4serve.model.args import args_from_dicts
    from dsv4serve.tiny.spec import TINY_CONFIG

    args = args_from_dicts(TINY_CONFIG, expert_dtype_hint="fp4")
    geo = prefill_geometry(args, context_tokens=4096)
    cpu = torch.device("cpu")
    assert capacity.kv_capacity(args, cpu, 2, 8, 10**9, None, 0.9, 2048, geo) == capacity.CPU_KV_CAPACITY_TOKENS
    assert capacity.kv_capacity(args, cpu, 2, 8, 10**9, 1000, 0.9, 2048, geo) == 992  # whole 16-token pages
