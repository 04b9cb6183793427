"""The expert-slot cache on CPU: real slot mapping, LRU eviction, prefetch rules and counted copies,
checked against hand-worked access sequences on a small synthetic bank."""

from __future__ import annotations

import torch

from dsv4serve.experts.bank import BankReport, ExpertBank
from dsv4serve.experts.pinning import PinBudget
from dsv4serve.experts.slot_cache import ExpertSlotCache

N_EXPERTS, LAYERS = 8, (0, 1, 2)
SHAPES = {"w1": (4, 16), "w1_scale": (4, 1), "w3": (4, 16), "w3_scale": (4, 1), "w2": (32, 2), "w2_scale": (32, 1)}
EXPERT_BYTES = sum(a * b for a, b in SHAPES.values())


def make_bank() -> ExpertBank:
    g = torch.Generator().manual_seed(0)
    layers = {
        layer: {p: torch.randint(0, 255, (N_EXPERTS, *s), generator=g, dtype=torch.uint8) for p, s in SHAPES.items()}
        for layer in LAYERS
    }
    total = EXPERT_BYTES * N_EXPERTS * len(LAYERS)
    shapes = {p: (s, torch.uint8) for p, s in SHAPES.items()}
    report = BankReport(0, total, 0, PinBudget(0, "native", "test"))
    return ExpertBank(layers, {}, None, shapes, N_EXPERTS, EXPERT_BYTES, report)


class HashGate:
    def __init__(self, table: list[list[int]]):
        self.tid2eid = torch.tensor(table)


def use(cache: ExpertSlotCache, layer: int, experts: list[int], n_tokens: int = 1) -> list[int]:
    """Run a layer through the cache; return the order the experts were lent in, checking each slot."""
    order = []
    for e, parts in cache.layer_experts(layer, experts, torch.zeros(n_tokens, dtype=torch.long)):
        for p, t in parts.items():
            assert torch.equal(t, cache.bank.layers[layer][p][e])  # the slot holds this expert's bytes
        order.append(e)
    return order


def test_lru_mapping_hits_and_counted_copies():
    cache = ExpertSlotCache(make_bank(), 3, torch.device("cpu"))
    use(cache, 0, [1, 2])
    use(cache, 1, [5])
    assert list(cache.resident) == [(0, 1), (0, 2), (1, 5)]
    assert use(cache, 0, [2, 7]) == [2, 7]  # (0, 2) hits; (0, 7) evicts the oldest, (0, 1)
    assert list(cache.resident) == [(1, 5), (0, 2), (0, 7)]
    assert use(cache, 2, [3, 5]) == [3, 5]  # evicts (1, 5), then (0, 2)
    assert list(cache.resident) == [(0, 7), (2, 3), (2, 5)]
    s = cache.stats
    assert (s.queries, s.hits, s.evictions, s.prefetches) == (7, 1, 3, 0)
    assert s.h2d_bytes == 6 * EXPERT_BYTES and s.stalls == 6  # CPU: every miss is served synchronously


def test_resident_experts_are_lent_first_and_more_experts_than_slots_still_run():
    cache = ExpertSlotCache(make_bank(), 3, torch.device("cpu"))
    use(cache, 0, [6])
    assert use(cache, 0, [0, 3, 6, 7, 4]) == [6, 0, 3, 4, 7]
    assert cache.stats.hits == 1 and cache.stats.h2d_bytes == 5 * EXPERT_BYTES


def test_prefill_prefetches_the_next_hash_layer_into_spare_slots_only():
    gate = HashGate([[4, 5], [5, 6], [6, 7]])  # token t -> experts of layer 1
    cache = ExpertSlotCache(make_bank(), 4, torch.device("cpu"), next_layer={0: 1, 1: 2}, hash_routers={1: gate})
    use(cache, 0, [0, 1])
    order = [e for e, _ in cache.layer_experts(0, [0, 1], torch.tensor([0, 1, 2]))]
    assert order == [0, 1] and cache.stats.prefetches == 2  # 4 slots - 2 needed = 2 spare: experts 4, 5
    assert set(cache.resident) == {(0, 0), (0, 1), (1, 4), (1, 5)}
    before = cache.stats.h2d_bytes
    assert use(cache, 1, [4, 5]) == [4, 5] and cache.stats.h2d_bytes == before  # both hits, no copy


def test_a_prefetch_never_evicts_what_the_current_layer_needs():
    cache = ExpertSlotCache(make_bank(), 3, torch.device("cpu"), next_layer={0: 1})
    use(cache, 1, [1, 2, 3])  # remembered as layer 1's last set, then evicted below
    use(cache, 0, [5, 6, 7])
    assert set(cache.resident) == {(0, 5), (0, 6), (0, 7)}
    use(cache, 0, [5, 6], n_tokens=8)  # one spare slot: one prefetch, into (0, 7)'s slot
    assert set(cache.resident) == {(0, 5), (0, 6), (1, 1)} and cache.stats.prefetches == 1
    use(cache, 0, [5, 6, 7], n_tokens=8)  # no spare slot: no prefetch
    assert cache.stats.prefetches == 1
    use(cache, 0, [5], n_tokens=1)  # decode: no prefetch
    assert cache.stats.prefetches == 1
