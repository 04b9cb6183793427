"""The cold prefill's expert transfers (memory/prefill_speed.py), by hand, and the stream's area in the memory plan."""

from __future__ import annotations

import pytest

from dsv4serve.memory.decode_lanes import BankTiers
from dsv4serve.memory.decode_speed import Bandwidths, DecodeBytes
from dsv4serve.memory.plan import Machine, plan_memory
from dsv4serve.memory.prefill_speed import IN_PLACE_GBPS, planned_stream_group, project_prefill
from dsv4serve.memory.weights import weight_bytes
from dsv4serve.model.args import read_model_args
from dsv4serve.model.schema import checkpoint_schema
from tests.unit.test_memory_plan import GIB, settings

# two MoE layers of 256 experts, 10 MB an expert, 64 slots (32 a layer: 224 experts a layer read from the host)
BYTES = DecodeBytes(0, 0, 0, 0, expert_bytes=10**7, expert_uses=12, n_experts=512, n_moe_layers=2, context_tokens=0)
BW = Bandwidths(h2d_gbps=50.0, host_gbps=80.0, disk_gbps=4.0)


def test_a_range_is_a_sixteenth_of_a_layer_up_to_16_experts():
    assert [planned_stream_group(e) for e in (8, 64, 256, 1024)] == [1, 4, 16, 16]


def test_a_pinned_bank_streams_each_expert_once_and_reads_it_in_place_once_per_64_routes():
    p = project_prefill(BYTES, 64, 4096, 6, BankTiers(), BW)  # 96 routes an expert: 2 blocks
    assert p.blocks_per_expert == 2 and p.streamed_bytes == 2 * 224 * 10**7
    assert p.streamed_seconds == pytest.approx(2 * 224 * 1e7 / 50e9)  # each expert in no slot, once
    assert p.in_place_seconds == pytest.approx(2 * 224 * 1e7 * 2 / (IN_PLACE_GBPS * 1e9))
    assert p.tokens_per_second() == pytest.approx(4096 / p.streamed_seconds)
    assert project_prefill(BYTES, 64, 8192, 6, BankTiers(), BW).tokens_per_second() == pytest.approx(
        2 * p.tokens_per_second()
    )  # the same bytes for twice the tokens
    assert project_prefill(BYTES, 64, 512, 6, BankTiers(), BW).blocks_per_expert == 1


def test_a_layer_on_disk_is_paged_in_and_staged_before_either_path():
    p = project_prefill(BYTES, 64, 4096, 6, BankTiers(pinned=0.5), BW)  # one layer pinned, one on disk
    staging = 224 * 1e7 * (2 / 80e9 + 1 / 4e9)  # the host's copy (read and write) after the page-in
    assert p.streamed_seconds == pytest.approx(2 * 224 * 1e7 / 50e9 + staging)
    assert p.in_place_seconds == pytest.approx(2 * 224 * 1e7 * 2 / (IN_PLACE_GBPS * 1e9) + staging)


def test_offloaded_plans_hold_the_stream_area_beside_the_slots(real_model_dir):
    args = read_model_args(real_model_dir)
    w = weight_bytes(checkpoint_schema(args), args)
    area = 2 * 16 * w.expert_bytes
    auto = plan_memory(args, w, Machine(32 * GIB, 128 * GIB, "native"), settings(args))
    assert auto.stream_area_bytes == area and any(d.startswith("prefill expert stream") for d in auto.decisions)
    assert auto.gpu_used_bytes + auto.activation_free_bytes == auto.budget_bytes
    explicit = plan_memory(args, w, Machine(32 * GIB, 128 * GIB, "native"), settings(args, moe_cache_size=100))
    assert explicit.expert_slots == 100 and explicit.stream_area_bytes == area  # the flag's slots, and the area
    resident = plan_memory(args, w, Machine(192 * GIB, None, "native"), settings(args))
    assert resident.experts_resident and resident.stream_area_bytes == 0
