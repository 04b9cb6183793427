"""The expert-slot cache on CPU: the promotion policy, the slot map and the slots' bytes, the lagged
usage counts and the stats, and the staging path, checked against hand-worked step sequences on a
small synthetic bank (3 layers x 8 experts, 4 slots). On the CPU every transfer is synchronous, so a
step's usage is seen at the next step boundary."""

from __future__ import annotations

import torch

from dsv4serve.experts.bank import BankReport, ExpertBank
from dsv4serve.experts.pinning import PinBudget
from dsv4serve.experts.residency import Promotion, PromotionPolicy, decayed, initial_keys, plan_promotions
from dsv4serve.experts.slot_cache import PART_ORDER, ExpertSlotCache

N_EXPERTS, LAYERS = 8, (0, 1, 2)
SHAPES = {"w1": (4, 16), "w1_scale": (4, 1), "w3": (4, 16), "w3_scale": (4, 1), "w2": (32, 2), "w2_scale": (32, 1)}
EXPERT_BYTES = sum(a * b for a, b in SHAPES.values())
CPU = torch.device("cpu")


class ShardReader:
    """Stands in for the checkpoint's SafetensorsFolder: `read(name)` / `view(name)` of a mapped expert's part."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors, self.reads = tensors, 0

    def read(self, name: str) -> torch.Tensor:
        self.reads += 1
        return self.tensors[name]

    def view(self, name: str) -> torch.Tensor:
        """As SafetensorsFolder.view: the tensor's bytes, uint8 [nbytes], no copy."""
        self.reads += 1
        return self.tensors[name].contiguous().view(torch.uint8).flatten()


def make_bank(mapped_layers: tuple[int, ...] = ()) -> ExpertBank:
    g = torch.Generator().manual_seed(0)
    full = {
        layer: {p: torch.randint(0, 255, (N_EXPERTS, *s), generator=g, dtype=torch.uint8) for p, s in SHAPES.items()}
        for layer in LAYERS
    }
    names = {layer: {(e, p): f"{layer}.{e}.{p}" for e in range(N_EXPERTS) for p in SHAPES} for layer in mapped_layers}
    reader = ShardReader({n: full[layer][p][e] for layer in mapped_layers for (e, p), n in names[layer].items()})
    ram = {layer: parts for layer, parts in full.items() if layer not in mapped_layers}
    total = EXPERT_BYTES * N_EXPERTS * len(LAYERS)
    mapped_bytes = EXPERT_BYTES * N_EXPERTS * len(mapped_layers)
    shapes = {p: (s, torch.uint8) for p, s in SHAPES.items()}
    report = BankReport(0, total - mapped_bytes, mapped_bytes, PinBudget(0, "native", "test"))
    bank = ExpertBank(ram, names, reader if mapped_layers else None, shapes, N_EXPERTS, EXPERT_BYTES, report)
    object.__setattr__(bank, "full", full)  # the test's own copy of every expert (frozen dataclass)
    return bank


def key(layer: int, expert: int) -> int:
    return layer * N_EXPERTS + expert


def step(cache: ExpertSlotCache, uses: dict[int, list[int]]) -> None:
    """One step through the torch path: each layer (in order) routes to `uses[layer]`; checks every lent
    expert's bytes."""
    for layer in LAYERS:
        for e, parts in cache.layer_experts(layer, uses.get(layer, [])):
            for p, t in parts.items():
                assert torch.equal(t, cache.bank.full[layer][p][e])


def assert_consistent(cache: ExpertSlotCache) -> None:
    """Every slot holds its expert's bytes and the device map says where each resident expert is."""
    slot_map = torch.full((len(LAYERS), N_EXPERTS), -1, dtype=torch.int32)
    for (layer, e), slot in cache.resident.items():
        slot_map[layer, e] = slot
        for p, t in cache.slots.items():
            assert torch.equal(t[slot], cache.bank.full[layer][p][e])
    assert torch.equal(cache.slot_of_expert, slot_map)


def test_plan_promotions_fills_free_slots_then_replaces_by_margin_within_the_budget():
    policy = PromotionPolicy(decay=0.5, margin=0.5, max_per_step=3)
    scores = torch.tensor([0.0, 2.0, 0.2, 1.0, 1.0, 0.9, 3.0, 0.0], dtype=torch.float64)
    slot_keys = torch.tensor([2, -1, 5, 0], dtype=torch.int64)  # slot 1 free
    # outside: 6 (3.0), 1 (2.0), 3 and 4 (1.0: the lower key first); victims by score: slot 3 (key 0:
    # 0.0), slot 0 (key 2: 0.2), slot 2 (key 5: 0.9); budget 3
    assert plan_promotions(scores, slot_keys, policy) == [
        Promotion(1, 6, -1),
        Promotion(3, 1, 0),
        Promotion(0, 3, 2),  # 1.0 > 0.2 + 0.5
    ]
    wide = PromotionPolicy(decay=0.5, margin=0.5, max_per_step=8)
    assert plan_promotions(scores, slot_keys, wide)[3:] == []  # key 4 (1.0) vs key 5 (0.9): within margin
    assert plan_promotions(torch.zeros(8, dtype=torch.float64), slot_keys, wide) == []
    assert torch.equal(decayed(scores, torch.ones(8), policy), scores * 0.5 + 1)


def test_initial_fill_gives_every_layer_an_equal_share():
    assert initial_keys(4, 3, 8) == [key(0, 0), key(1, 0), key(2, 0), key(0, 1)]
    assert initial_keys(30, 3, 8) == initial_keys(24, 3, 8) and len(set(initial_keys(24, 3, 8))) == 24
    cache = ExpertSlotCache(make_bank(), 4, CPU)
    assert cache.resident == {(0, 0): 0, (1, 0): 1, (2, 0): 2, (0, 1): 3}
    assert_consistent(cache)
    assert cache.stats.h2d_bytes == 0  # the fill at load is not counted


def test_misses_are_weighed_by_what_they_cost_where_the_bank_holds_them():
    """A disk-tier layer's experts fill the slots first and out-score RAM layers' experts of the same use; a RAM
    layer's expert used often enough still wins a slot (the weighted scores, residency.py)."""
    # 3 rows of 2 experts (key = row * 2 + expert): row 1 (9.0) whole, then row 2 (2.0), then row 0
    assert initial_keys(5, 3, 2, [1.0, 9.0, 2.0]) == [2, 3, 4, 5, 0]
    assert initial_keys(4, 3, 8, [1.0] * 3) == initial_keys(4, 3, 8)
    weights = torch.tensor([1.0] * 8 + [10.0] * 8, dtype=torch.float64)  # row 1 on disk
    slot_keys = torch.tensor([8, 9], dtype=torch.int64)
    scores = torch.zeros(16, dtype=torch.float64)
    scores[[0, 10]] = 1.0  # one use each: the disk expert (1,2) outscores (0,0), and both out-score idle residents
    policy = PromotionPolicy(margin=0.5)
    assert [p.key for p in plan_promotions(scores, slot_keys, policy, weights)] == [10, 0]
    scores[[8, 9]] = 0.2  # residents used a little: x10 = 2.0, beyond (0,0)'s 1.0 + margin; (1,2) still wins
    assert [(p.key, p.evicted) for p in plan_promotions(scores, slot_keys, policy, weights)] == [(10, 8)]
    scores[0], scores[10] = 5.0, 0.3  # a hot RAM expert (5.0) goes before a lukewarm disk one (3.0)
    assert plan_promotions(scores, slot_keys, policy, weights) == [Promotion(0, 0, 8), Promotion(1, 10, 9)]
    bank = make_bank(mapped_layers=(1,))
    cache = ExpertSlotCache(bank, 10, CPU, miss_weights={"pinned": 1.0, "pageable": 2.0, "disk": 10.0})
    assert cache.row_tiers == ["pinned", "disk", "pinned"]
    assert {layer for layer, _ in cache.resident} == {0, 1, 2} and sum(lay == 1 for lay, _ in cache.resident) == 8
    assert_consistent(cache)
    assert [cache.miss_weight(layer) for layer in LAYERS] == [1.0, 10.0, 1.0]
    for held in (False, True):  # 8 slots, all layer 1's; kt-kernel holds layer 1 or not
        cache = ExpertSlotCache(bank, 8, CPU, miss_weights={"pinned": 1.0, "pageable": 2.0, "disk": 10.0})
        if held:
            cache.weigh_layers({1: 0.5})  # its misses split with the CPU: cheaper than a RAM layer's fetch
        step(cache, {1: list(range(8))})
        step(cache, {0: [7]})
        step(cache, {})  # (0,7) at 1.0 against residents at 0.8 x 10 = 8 (no), or 0.8 x 0.5 = 0.4 (+ margin 0.5: yes)
        assert ((0, 7) in cache.resident) == held


def test_lagged_usage_promotes_at_the_next_boundary_with_counted_copies():
    cache = ExpertSlotCache(make_bank(), 4, CPU)
    step(cache, {0: [1, 5], 1: [5], 2: [3]})  # boundary at layer 0 first: nothing known yet
    assert cache.stats.prefetches == 0
    step(cache, {0: [5, 6]})
    # the boundary saw step 1: uses (0,1) (0,5) (1,5) (2,3), one hit ((0,1)); all three misses score 1.0
    # and replace the idle initial experts of slots 0, 1, 2 (score 0 + margin 0.5 < 1.0)
    assert cache.resident == {(0, 5): 0, (1, 5): 1, (2, 3): 2, (0, 1): 3}
    assert_consistent(cache)
    s = cache.stats
    assert (s.queries, s.hits, s.prefetches, s.evictions, s.stalls) == (4, 1, 3, 3, 1)
    assert s.h2d_bytes == 3 * EXPERT_BYTES
    step(cache, {})
    # step 2: (0,5) hit, (0,6) missed with 1.0; every resident decayed to 0.8 ((0,5): 1.8): 1.0 < 0.8 + 0.5
    assert (s.queries, s.hits, s.prefetches, s.stalls) == (6, 2, 3, 1)
    assert cache.resident[(0, 5)] == 0 and (0, 6) not in cache.resident


def test_the_budget_defers_promotions_to_later_boundaries():
    cache = ExpertSlotCache(make_bank(), 4, CPU, policy=PromotionPolicy(max_per_step=2))
    step(cache, {0: [5], 1: [5], 2: [3]})
    step(cache, {})
    assert set(cache.resident) == {(0, 5), (1, 5), (2, 0), (0, 1)}  # two copies this boundary
    step(cache, {})
    assert set(cache.resident) == {(0, 5), (1, 5), (2, 3), (0, 1)}  # (2,3) at 0.8 beats (2,0) at 0
    assert cache.stats.prefetches == 3 and cache.stats.stalls == 2
    assert_consistent(cache)


def test_an_explicit_step_boundary_is_not_repeated_by_the_first_layer():
    cache = ExpertSlotCache(make_bank(), 4, CPU, policy=PromotionPolicy(max_per_step=1))
    step(cache, {1: [5, 6]})
    cache.begin_step()  # promotes one of the two (the budget)
    assert cache.stats.prefetches == 1
    step(cache, {})  # its layer 0 runs no second boundary, which would promote the other
    assert cache.stats.prefetches == 1
    step(cache, {})
    assert cache.stats.prefetches == 2 and {(1, 5), (1, 6)} <= set(cache.resident)


def test_kernel_sources_read_ram_layers_in_place_and_stage_mapped_ones():
    bank = make_bank(mapped_layers=(2,))
    cache = ExpertSlotCache(bank, 4, CPU)
    assert cache.staged_layers == [2] and ExpertSlotCache(make_bank(), 4, CPU).staged_layers == []
    ids0 = torch.tensor([[1, 3]])
    src = cache.kernel_sources(0, ids0)
    assert all(t is bank.layers[0][p] for t, p in zip(src.bank, PART_ORDER))  # read in place
    assert src.slot_of_expert.tolist() == cache.slot_of_expert[0].tolist() and src.usage.shape == (N_EXPERTS + 1,)
    assert cache.stats.stalls == 0
    # layer 2 is in the shards: its routed experts outside the slots are staged; its misses cost the most, so the
    # fresh cache gave it every slot: (2,0) .. (2,3)
    assert cache.resident == {(2, 0): 0, (2, 1): 1, (2, 2): 2, (2, 3): 3}
    reads = bank.source.reads
    staged = cache.kernel_sources(2, torch.tensor([[0, 4], [4, 7]]))
    assert bank.source.reads - reads == 2 * len(SHAPES)  # experts 4 and 7, not 0
    for e in (4, 7):
        for t, p in zip(staged.bank, PART_ORDER):
            assert torch.equal(t[e], bank.full[2][p][e])
    assert cache.stats.staged_layers == 1 and cache.stats.stalls == 1
    assert cache.stats.staged_bytes == 2 * EXPERT_BYTES
    cache.kernel_sources(2, torch.tensor([[7, 5]]))  # 7 is staged already: only 5 is read
    assert bank.source.reads - reads == 3 * len(SHAPES) and cache.stats.staged_layers == 2


def test_the_kernel_usage_row_feeds_the_same_accounting():
    """The FP4 path records uses by adding to `usage` on the device (moe_align); emulate those adds."""
    cache = ExpertSlotCache(make_bank(), 4, CPU)
    src = cache.kernel_sources(0, torch.tensor([[0, 6]]))
    src.usage[[0, 6]] += 1
    src.usage[-1] += 1  # (0,0) is in slot 0: one hit
    cache.collect_usage()
    assert (cache.stats.queries, cache.stats.hits) == (2, 1)


def test_a_stand_in_route_s_count_is_taken_back_where_no_real_route_used_it():
    """Hybrid's weight-0 stand-in routes (experts/hybrid.py) count as the stand-in's use, and a hit if it sits in a
    slot, in moe_align's record: uncount_stand_in takes both back when `fake`, nothing otherwise."""
    cache = ExpertSlotCache(make_bank(), 4, CPU)
    in_slot = int(torch.nonzero(cache.host_slot_map(1) >= 0).flatten()[0])
    free = int(torch.nonzero(cache.host_slot_map(1) < 0).flatten()[0])
    before = cache.usage_row(1).clone()
    cache.uncount_stand_in(1, torch.tensor(in_slot), torch.tensor(True))
    cache.uncount_stand_in(1, torch.tensor(free), torch.tensor(True))  # a use, not a hit
    cache.uncount_stand_in(1, torch.tensor(free), torch.tensor(False))
    taken = before - cache.usage_row(1)
    want = torch.zeros(N_EXPERTS + 1, dtype=torch.int64)
    want[in_slot] = want[free] = want[-1] = 1
    assert torch.equal(taken, want)
