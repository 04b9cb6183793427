"""The prefill stream (experts/prefill_stream.py) on the CPU, where its copies run in turn: which steps stream, where
each expert is read from, what each buffer holds when its range is yielded, and the slot cache's wiring, on the
synthetic bank of tests/unit/test_expert_slot_cache.py (3 layers x 8 experts). The kernel's results through it are
checked bit for bit against in-place reads in tests/kernels/test_packed_load.py."""

from __future__ import annotations

import pytest
import torch

from dsv4serve.experts.prefill_stream import ExpertStream, streams
from dsv4serve.experts.slot_cache import PART_ORDER, ExpertSlotCache
from tests.unit.test_expert_slot_cache import CPU, EXPERT_BYTES, N_EXPERTS, SHAPES, make_bank

SLOTS, GROUP = 4, 3  # ranges [0, 3), [3, 6), [6, 8): buffers 0, 1, 0


def _prefill_ids(tokens: int = 24) -> torch.Tensor:
    """Top-2 routes of `tokens` tokens over all 8 experts: 48 routes, past the 32 (4 an expert) that stream."""
    return torch.arange(2 * tokens).remainder(N_EXPERTS).view(tokens, 2)


def test_steps_past_four_routes_an_expert_stream():
    assert not streams(32, 8) and streams(33, 8)
    assert not streams(64 * 6, 256) and streams(4096 * 6, 256)  # a 64-row decode step reads in place; a chunk streams


def test_each_range_is_in_its_buffer_when_yielded_and_the_next_is_copied_ahead():
    bank = make_bank()
    slots = {p: torch.zeros((SLOTS + 2 * GROUP, *s), dtype=torch.uint8) for p, s in SHAPES.items()}
    stream = ExpertStream(slots, SLOTS, GROUP, N_EXPERTS, CPU)
    assert stream.area_bytes == 2 * GROUP * EXPERT_BYTES
    slot_map = torch.tensor([-1, 2, -1, -1, -1, -1, 0, -1], dtype=torch.int32)  # experts 1 and 6 in cache slots
    layer = stream.layer(bank.layers[0], slot_map, slot_map >= 0)
    # a cache expert keeps its slot; the others their row in their range's buffer (slot rows 4..9); only those copy
    assert layer.slot_of_expert.tolist() == [4, 2, 6, 7, 8, 9, 0, 5]
    assert layer.runs == [[(0, 1), (2, 3)], [(3, 6)], [(7, 8)]] and layer.copied_experts == 6
    seen = []
    for lo, hi in layer.ranges():
        seen.append((lo, hi))
        for e in range(lo, hi):
            if slot_map[e] < 0:  # what the kernel reads for e right now is e's bytes
                for p in SHAPES:
                    assert torch.equal(slots[p][layer.slot_of_expert[e]], bank.full[0][p][e]), (e, p)
        if lo == 0:  # range 1 was copied ahead into buffer 1 before range 0 computes
            assert torch.equal(slots["w1"][7:10], bank.full[0]["w1"][3:6])
        if lo == 3:  # range 2 went into buffer 0 only once range 0 was done with it: expert 7, not 6 (in a slot)
            assert torch.equal(slots["w1"][5], bank.full[0]["w1"][7])
            assert torch.equal(slots["w1"][4], bank.full[0]["w1"][0])
    assert seen == [(0, 3), (3, 6), (6, 8)]
    assert torch.equal(slots["w1"][:SLOTS], torch.zeros_like(slots["w1"][:SLOTS]))  # the cache's slots untouched


def test_stream_rows_must_be_there():
    slots = {p: torch.zeros((SLOTS + GROUP, *s), dtype=torch.uint8) for p, s in SHAPES.items()}
    with pytest.raises(ValueError, match="need 10 rows"):
        ExpertStream(slots, SLOTS, GROUP, N_EXPERTS, CPU)


def test_the_slot_cache_streams_prefill_steps_and_reads_decode_steps_in_place():
    bank = make_bank(mapped_layers=(2,))
    cache = ExpertSlotCache(bank, SLOTS, CPU, stream_group=GROUP)
    assert all(t.shape[0] == SLOTS + 2 * GROUP for t in cache.slots.values())
    assert cache.kernel_sources(0, torch.tensor([[1, 3]])).stream is None  # 2 routes: in place
    src = cache.kernel_sources(0, _prefill_ids())
    assert src.stream is not None and all(t is bank.layers[0][p] for t, p in zip(src.bank, PART_ORDER))
    held = int((cache.host_slot_map(0) >= 0).sum())  # the fresh cache's slots went to layer 2 (on disk) first
    assert cache.stats.streamed_layers == 1 and cache.stats.h2d_bytes == 0  # counted as the copies are queued
    for _ in src.stream.ranges():
        pass
    ahead = int((cache.host_slot_map(1)[: 2 * GROUP] < 0).sum())  # layer 1 (in RAM): its first two ranges, ahead
    assert cache.stats.h2d_bytes == (N_EXPERTS - held + ahead) * EXPERT_BYTES
    # a layer in the shards is staged on the host first, then streamed out of the staging area
    staged = cache.kernel_sources(2, _prefill_ids())
    assert staged.stream is not None and staged.stream.bank["w1"] is cache._staging.area()["w1"]
    in_slot = cache.host_slot_map(2) >= 0
    for lo, hi in staged.stream.ranges():
        for e in range(lo, hi):
            for p in SHAPES:
                assert torch.equal(cache.slots[p][staged.stream.slot_of_expert[e]], bank.full[2][p][e]), (e, p, in_slot)
    assert cache.stats.streamed_layers == 2 and cache.stats.staged_layers == 1
    assert ExpertSlotCache(bank, SLOTS, CPU).kernel_sources(0, _prefill_ids()).stream is None  # made without one


def _consume(cache: ExpertSlotCache, layer: int) -> None:
    src = cache.kernel_sources(layer, _prefill_ids())
    assert src.stream is not None
    for _ in src.stream.ranges():
        pass


def test_the_next_pinned_layer_s_first_ranges_are_copied_ahead_and_used_within_the_step():
    bank = make_bank(mapped_layers=(2,))  # layers 0 and 1 in RAM ("pinned" on the CPU), 2 in the shards
    cache = ExpertSlotCache(bank, SLOTS, CPU, stream_group=GROUP)
    stream = cache.stream
    assert stream is not None
    copied: list[tuple[int, int]] = []
    experts: list[int] = []  # every copy's experts, as the cache counts them
    real = stream.copy_range
    stream.copy_range = lambda b, g, runs: (
        copied.append((b["w1"].data_ptr(), g)),
        experts.append(sum(hi - lo for lo, hi in runs)),
        real(b, g, runs),
    )[2]
    l0, l1 = bank.layers[0]["w1"].data_ptr(), bank.layers[1]["w1"].data_ptr()
    cache.begin_step()
    _consume(cache, 0)
    assert copied == [(l0, 0), (l0, 1), (l0, 2), (l1, 0), (l1, 1)]  # layer 1's first two ranges, ahead
    for e in range(2 * GROUP):  # the buffers now hold them (its experts in no slot)
        if cache.host_slot_map(1)[e] < 0:
            assert torch.equal(cache.slots["w1"][SLOTS + e], bank.full[1]["w1"][e])
    _consume(cache, 1)
    assert copied[5:] == [(l1, 2)]  # only its third; layer 2 is on disk: nothing ahead
    assert stream.ahead is None
    copied.clear()
    cache.begin_step()
    _consume(cache, 0)
    cache.begin_step()  # a boundary: the slots may have changed since layer 1's ranges went ahead
    _consume(cache, 1)
    assert copied == [(l0, 0), (l0, 1), (l0, 2), (l1, 0), (l1, 1), (l1, 0), (l1, 1), (l1, 2)]
    # h2d bytes count every copy, the ranges copied ahead and then copied again after the boundary too
    assert sum(experts[-3:]) > 0 and cache.stats.h2d_bytes == sum(experts) * EXPERT_BYTES
