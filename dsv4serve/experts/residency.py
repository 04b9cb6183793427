"""Which routed experts live in the device slots: a decayed-frequency (LFU) policy, pure and host-side.

    scores = decayed(scores, used, policy)                 # after each harvest of the usage counters
    plan = plan_promotions(scores, slot_keys, policy)      # at a step boundary: [Promotion(slot, key, evicted)]

Experts are flat keys, row * E + expert (row: the MoE layer's index in the cache). `used` counts, per
key, the steps that routed to it since the last harvest; a score is the exponentially decayed sum of
those counts (one `decay` per harvest), so it follows a drifting workload.

Why frequency, not recency (LRU): a miss is not a stall here. An expert outside the slots is read in
place from pinned host memory, over PCIe, by the same kernel; promoting it costs the same PCIe bytes
as one such read, plus a wait at the next step boundary. A promotion pays only if the expert is used
again, often, while it stays: LRU would promote every miss (at decode about 6 experts x 43 layers a
step, a quarter of them misses with 8,640 of 11,008 experts resident) and evict experts that are
hot but were idle for a step. So a candidate must out-score the resident expert it replaces by
`margin` (no ping-pong between equals), free slots fill first, and at most `max_per_step` copies are
issued per boundary, which bounds the compute's wait for them.

Misses do not all cost the same: a layer the bank holds pinned is read in place over PCIe, a pageable one is
staged by the host first, one left on disk is paged in before that (memory/decode_lanes.py). So scores are
weighed by the miss cost of their layer's tier (`weights`, relative to a pinned miss:
memory/decode_speed.miss_cost_weights), and a fresh cache fills the costliest layers first: a slot saves most
where a miss costs most. With the whole bank pinned every weight is 1 and this is plain LFU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromotionPolicy:
    decay: float = 0.8  # per harvest: an expert used every step scores ~1 / (1 - decay) = 5
    margin: float = 0.5  # a used-once expert (1.0) beats a resident idle for 4 harvests (0.8^4 = 0.41)
    max_per_step: int = 8  # ~107 MB of DeepSeek-V4-Flash experts: ~2 ms over PCIe 5


@dataclass(frozen=True)
class Promotion:
    slot: int
    key: int  # the flat key copied into the slot
    evicted: int  # the flat key it replaces, -1 for a free slot


def decayed(scores: torch.Tensor, used: torch.Tensor, policy: PromotionPolicy) -> torch.Tensor:
    """scores [K] float64, used [K] (steps each key was routed to since the last harvest) -> new scores."""
    return scores * policy.decay + used.to(scores.dtype)


def initial_keys(n_slots: int, n_rows: int, n_experts: int, row_weights: list[float] | None = None) -> list[int]:
    """The keys of a fresh cache, before any usage is known: the rows of the highest miss cost first
    (`row_weights`, module doc; none: all equal), and within rows of one weight an equal share of the slots each
    (layer-major round robin, experts in index order); one key per slot, at most every key once."""
    weights = row_weights if row_weights is not None else [1.0] * n_rows
    if len(weights) != n_rows:
        raise ValueError(f"{len(weights)} row weights for {n_rows} rows")
    keys: list[int] = []
    for w in sorted(set(weights), reverse=True):
        rows = [r for r in range(n_rows) if weights[r] == w]
        take = min(n_slots - len(keys), len(rows) * n_experts)
        keys += [rows[i % len(rows)] * n_experts + i // len(rows) for i in range(take)]
    return keys


def plan_promotions(
    scores: torch.Tensor, slot_keys: torch.Tensor, policy: PromotionPolicy, weights: torch.Tensor | None = None
) -> list[Promotion]:
    """scores [K] float64, slot_keys [S] int64 (-1: free) -> at most policy.max_per_step promotions: the
    best-scoring keys outside the slots (score > 0; ties: the lower key) into the free slots first, then
    each over the worst-scoring resident left (ties: the lower slot) while it out-scores it by margin.
    `weights` [K] float64: each key's miss cost (module doc); the scores compared are score x weight."""
    if weights is not None:
        scores = scores * weights
    in_slot = torch.zeros(scores.numel(), dtype=torch.bool)
    held = slot_keys[slot_keys >= 0]
    in_slot[held] = True
    outside = scores.masked_fill(in_slot, 0.0)
    n_cand = min(policy.max_per_step, int((outside > 0).sum()))
    if n_cand == 0:
        return []
    candidates = torch.sort(-outside, stable=True).indices[:n_cand].tolist()
    free = (slot_keys < 0).nonzero().flatten().tolist()
    plan = [Promotion(slot, key, -1) for slot, key in zip(free, candidates)]
    resident = (slot_keys >= 0).nonzero().flatten()
    victims = resident[torch.sort(scores[slot_keys[resident]], stable=True).indices].tolist()
    for key, slot in zip(candidates[len(plan) :], victims):
        old = int(slot_keys[slot])
        if scores[key] <= scores[old] + policy.margin:
            break  # later candidates score no higher, later victims no lower
        plan.append(Promotion(slot, key, old))
    return plan
