"""The hybrid backend's pure parts, without kt-kernel: the E8M0 -> bf16 scale shift, kt-kernel's threads
from the machine's NUMA layout, --moe-backend's choice and refusals, the fetch-vs-compute split (against
a brute-force search), and the host-memory plan counting kt-kernel's copy."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch

from dsv4_kernels.formats import e8m0_to_float
from dsv4serve.experts.kt_backend import _cpulist, e8m0_as_bf16, kt_threads
from dsv4serve.experts.miss_split import CpuExpertCost, SplitCosts, split_misses
from dsv4serve.experts.moe_backend import MoeBackendError, choose_moe_backend
from dsv4serve.memory.host_plan import KT_COPY_FACTOR, host_split
from dsv4serve.memory.plan import Machine

GIB = 2**30
KT_YES, KT_NO = (True, "kt-kernel installed"), (False, "kt-kernel is not installed (pip install ...)")


def test_e8m0_bytes_become_the_same_powers_of_two_in_bf16():
    codes = torch.arange(255, dtype=torch.uint8)  # 255 is E8M0's NaN
    assert torch.equal(e8m0_as_bf16(codes).float(), e8m0_to_float(codes).float())
    assert e8m0_as_bf16(torch.tensor([0], dtype=torch.uint8)).float().item() == 2.0**-127


def test_threads_leave_a_core_and_follow_the_numa_nodes():
    assert _cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    one = kt_threads(set(range(8)), {0: set(range(8))})
    assert one.numa_nodes == (0,) and one.threads == (7,)
    two = kt_threads(set(range(16)), {0: set(range(8)), 1: set(range(8, 16))})
    assert two.numa_nodes == (0, 1) and two.total == 15 and min(two.threads) >= 7
    narrowed = kt_threads({8, 9, 10}, {0: set(range(8)), 1: set(range(8, 16))})  # affinity on node 1 only
    assert narrowed.numa_nodes == (1,) and narrowed.threads == (2,)
    assert kt_threads({0}, {}).threads == (1,)  # one core: still one thread


@pytest.mark.parametrize(
    ("requested", "explicit", "offloaded", "kt", "expected"),
    [
        ("auto", False, False, KT_YES, "gpu"),
        ("auto", False, True, KT_YES, "hybrid"),
        ("auto", False, True, KT_NO, "offload"),
        ("auto", True, True, KT_NO, "offload"),
        ("gpu", True, False, KT_NO, "gpu"),
        ("offload", True, True, KT_YES, "offload"),
        ("hybrid", True, True, KT_YES, "hybrid"),
    ],
)
def test_the_backend_choice(requested, explicit, offloaded, kt, expected):
    assert choose_moe_backend(requested, explicit, offloaded, kt)[0] == expected


@pytest.mark.parametrize(
    ("requested", "offloaded", "kt", "invariant", "message"),
    [
        ("hybrid", True, KT_NO, False, "--moe-backend hybrid needs kt-kernel: kt-kernel is not installed"),
        ("hybrid", False, KT_YES, False, "--moe-backend hybrid: every routed expert is resident.*--moe-cache-size"),
        ("hybrid", True, KT_YES, True, "--moe-backend hybrid with --batch-invariant"),
        ("gpu", True, KT_YES, False, "--moe-backend gpu: the routed experts are offloaded"),
        ("offload", False, KT_YES, False, "--moe-backend offload: every routed expert is resident"),
    ],
)
def test_an_explicit_backend_that_cannot_be_honoured_is_refused_by_name(requested, offloaded, kt, invariant, message):
    with pytest.raises(MoeBackendError, match=message):
        choose_moe_backend(requested, True, offloaded, kt, invariant)


def test_auto_with_batch_invariance_stays_on_the_device_path():
    assert choose_moe_backend("auto", False, True, KT_YES, batch_invariant=True)[0] == "offload"


def test_auto_keeps_offload_where_the_projection_says_it_decodes_faster(monkeypatch):
    """Installing kt-kernel must not make auto slower: a CUDA worker projects both backends as it would run them
    (memory/decode_choice.py) and auto keeps offload when it wins; an explicit hybrid is still honoured."""
    line = "projected batch-1 decode offload 14.3 vs hybrid 10.3 tokens/s"
    backend, why = choose_moe_backend("auto", False, True, KT_YES, offload_faster=line)
    assert backend == "offload" and line in why
    assert choose_moe_backend("hybrid", True, True, KT_YES, offload_faster=line)[0] == "hybrid"
    from types import SimpleNamespace

    from dsv4serve.experts import moe_backend

    monkeypatch.setattr(moe_backend, "kt_kernel_available", lambda: KT_YES)
    monkeypatch.setattr(moe_backend, "kt_version", lambda: "0.7.2")
    asked = []

    def faster() -> str:
        asked.append(1)
        return line

    numerics = SimpleNamespace(batch_invariant=False)
    auto, hybrid = SimpleNamespace(value="auto", explicit=False), SimpleNamespace(value="hybrid", explicit=True)
    assert moe_backend.moe_backend_for(auto, True, numerics, faster)[0] == "offload" and asked == [1]
    assert moe_backend.moe_backend_for(hybrid, True, numerics, faster)[0] == "hybrid" and asked == [1]  # not asked
    assert moe_backend.moe_backend_for(auto, False, numerics, faster)[0] == "gpu" and asked == [1]
    assert moe_backend.moe_backend_for(auto, True, numerics, lambda: None)[0] == "hybrid"


def brute_force(miss_tokens, expert_bytes, costs) -> float:
    """The best max(fetch, CPU) seconds over every subset sent to the CPU."""
    fetch = costs.fetch_seconds(expert_bytes, True)
    best = float("inf")
    experts = list(miss_tokens)
    for n in range(len(experts) + 1):
        for cpu in itertools.combinations(experts, n):
            cpu_s = sum(costs.cpu.seconds(miss_tokens[e]) for e in cpu)
            best = min(best, max((len(experts) - n) * fetch, cpu_s))
    return best


def split_seconds(miss_tokens, cpu, expert_bytes, costs) -> float:
    fetch = costs.fetch_seconds(expert_bytes, True) * (len(miss_tokens) - len(cpu))
    return max(fetch, sum(costs.cpu.seconds(miss_tokens[e]) for e in cpu))


EXPERT = 12 * 2**20  # bytes
COSTS = SplitCosts(CpuExpertCost(fixed_s=1.5e-3, per_token_s=0.4e-3), 50e9, 8e9)  # fetch 0.25 ms pinned


def test_the_split_is_as_good_as_any_subset():
    gen = torch.Generator().manual_seed(5)
    for _ in range(40):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        tokens = {e: int(t) for e, t in enumerate(torch.randint(1, 40, (n,), generator=gen).tolist())}
        cpu = split_misses(tokens, EXPERT, True, COSTS)
        assert split_seconds(tokens, cpu, EXPERT, COSTS) == pytest.approx(brute_force(tokens, EXPERT, COSTS))


def test_decode_computes_misses_on_the_cpu_and_prefill_fetches_them():
    slow_link = SplitCosts(CpuExpertCost(1e-3, 1e-4), 2e9, 1e9)  # 6.3 ms a fetch: the CPU wins at 1 token
    assert split_misses({3: 1, 5: 1, 9: 1}, EXPERT, True, slow_link) == {3, 5, 9}
    prefill = {e: 500 for e in range(16)}  # 500 tokens per expert: 51 ms each on the CPU
    assert len(split_misses(prefill, EXPERT, True, slow_link)) <= 2
    assert split_misses({1: 1}, EXPERT, True, SplitCosts(CpuExpertCost(1e-3, 0), None, None)) == {1}  # CPU device
    pageable = split_misses({e: 1 for e in range(8)}, EXPERT, False, COSTS)
    assert len(pageable) >= len(split_misses({e: 1 for e in range(8)}, EXPERT, True, COSTS))
    # a layer left on disk: a fetch would page in first, kt-kernel reads its own RAM copy: all on the CPU
    assert split_misses(prefill, EXPERT, False, slow_link, on_disk=True) == set(prefill)


def test_a_miss_in_a_layer_kt_kernel_holds_weighs_the_fetch_and_the_cpu_in_parallel():
    """The slot cache's weight of such a miss (residency.py), in pinned fetches: fetch 0.25 ms (12 MiB at 50 GB/s)
    against 1.9 ms of CPU at one token: 1 / (1 + 0.25 / 1.9) pinned fetches; a disk layer (20 fetches) much less
    than its own 20; nothing on a CPU device."""
    from dsv4serve.experts.miss_split import held_miss_weight

    fetch = EXPERT / 50e9
    assert held_miss_weight(1.0, COSTS, EXPERT) == pytest.approx(1 / (1 + fetch / 1.9e-3))
    assert held_miss_weight(20.0, COSTS, EXPERT) == pytest.approx(1 / (1 / 20 + fetch / 1.9e-3))
    assert held_miss_weight(20.0, COSTS, EXPERT) < 20 * held_miss_weight(1.0, COSTS, EXPERT)
    assert held_miss_weight(1.0, SplitCosts(CpuExpertCost(1e-3, 0), None, None), EXPERT) is None


def test_the_host_plan_counts_kt_kernel_s_copy_first():
    bank = 137 * GIB
    decisions, warnings = [], []
    split = host_split(bank, Machine(32 * GIB, 384 * GIB, "native"), decisions, warnings, cpu_experts=True)
    assert split.kt_copy_bytes == int(bank * KT_COPY_FACTOR) and split.ram_bytes == bank and not warnings
    assert "kt-kernel's copy" in decisions[-1]
    small, warnings = Machine(32 * GIB, 128 * GIB, "native"), []
    split = host_split(bank, small, [], warnings, cpu_experts=True)
    assert split.kt_copy_bytes == 120 * GIB and split.ram_bytes == 0 and split.disk_bytes == bank
    assert "does not fit" in warnings[0] and "offload" in warnings[0]
    assert host_split(bank, small, [], []).kt_copy_bytes == 0  # offload: no copy


def test_detection_does_not_import_kt_kernel_or_torch():
    code = (
        "import sys; from dsv4serve.experts.kt_backend import kt_kernel_available; ok, why = kt_kernel_available();"
        "assert 'torch' not in sys.modules and 'kt_kernel' not in sys.modules, sorted(sys.modules);"
        "assert ok or 'pip install --no-deps kt-kernel==0.7.2' in why, why"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_graph_step_s_cpu_set_is_the_coldest_free_experts_up_to_the_cpu_share():
    """hybrid_graph.cpu_set: by expected use (the slot cache's scores; unseen experts at the mean), coldest first."""
    from dsv4serve.experts.hybrid_graph import cpu_set, decode_cpu_share

    free = torch.tensor([True, True, False, True, True, True])
    scores = torch.tensor([4.0, 1.0, 9.0, 0.0, 2.0, 1.0], dtype=torch.float64)  # expert 3 unseen: the mean, 2
    # free rates 4, 1, 2, 2, 1 (sum 10): half of it is experts 1, 5 (1 + 1), then 3 (2): 4 <= 5, then 4 (2) > 5
    assert torch.nonzero(cpu_set(free, scores, 0.5)).flatten().tolist() == [1, 3, 5]
    assert cpu_set(free, scores, 1.0).tolist() == free.tolist() and not cpu_set(free, scores, 0.0).any()
    assert not cpu_set(torch.zeros(6, dtype=torch.bool), scores, 0.5).any()
    assert torch.nonzero(cpu_set(free, torch.zeros(6, dtype=torch.float64), 0.4)).flatten().tolist() == [0, 1]
    # the decode split at one token per expert: the copy (12 MiB at 50 GB/s) and the CPU (1.9 ms) finish together
    fetch = EXPERT / 50e9
    assert decode_cpu_share(COSTS, EXPERT) == pytest.approx(fetch / (fetch + 1.9e-3))
    assert decode_cpu_share(SplitCosts(CpuExpertCost(1e-3, 0), None, None), EXPERT) == 1.0  # CPU device
    # a pageable layer's fetch (8 GB/s: staged by the host) takes longer, so the CPU takes more; a disk layer all
    staged = EXPERT / 8e9
    assert decode_cpu_share(COSTS, EXPERT, "pageable") == pytest.approx(staged / (staged + 1.9e-3))
    assert decode_cpu_share(COSTS, EXPERT, "disk") == 1.0


def test_a_graph_split_keeps_its_cpu_sets_while_the_slot_map_stands_and_rewrites_kt_kernel_s_masks():
    """GraphSplit.begin_step: a CPU set is chosen again when the slot map changes or REFRESH_STEPS steps on;
    kt-kernel's masks are written every step (an eager step's split rewrites them in between)."""
    from types import SimpleNamespace

    from dsv4serve.experts.hybrid_graph import REFRESH_STEPS, GraphSplit

    slot_map = torch.tensor([[0, -1, -1, 1], [-1, 2, -1, -1]], dtype=torch.int32)  # layers 4 and 7, 4 experts
    scores = {4: torch.tensor([0.0, 5.0, 1.0, 0.0], dtype=torch.float64), 7: torch.zeros(4, dtype=torch.float64)}
    cache = SimpleNamespace(
        layers=[4, 7],
        bank=SimpleNamespace(n_experts=4),
        host_slot_maps=lambda layers: slot_map[[[4, 7].index(la) for la in layers]].clone(),
        expert_scores=lambda layer: scores[layer],
    )
    masks: dict[int, list[bool]] = {}
    kt = SimpleNamespace(holds=lambda layer: True, set_mask=lambda layer, m: masks.__setitem__(layer, m.tolist()))
    split = GraphSplit(kt, cache, 0.5, torch.device("cpu"))  # type: ignore[arg-type]
    split.begin_step()
    # layer 4: free 1 (rate 5), 2 (rate 1): half of 6 is 3: expert 2 only; layer 7: free 0, 2, 3 (unseen: 1 each)
    assert split.cpu_experts(4) == {2} and split.cpu_experts(7) == {0}
    assert split.stand_in.tolist() == [0, 1] and masks == {4: [True, True, False, True], 7: [False, True, True, True]}
    masks.clear()
    scores[4][2] = 9.0  # the scores drift, the slot map stands: the sets are kept, kt-kernel's masks rewritten
    split.begin_step()
    assert split.cpu_experts(4) == {2} and masks[4] == [True, True, False, True]
    scores[7][:] = torch.tensor([5.0, 0.0, 0.1, 0.1])  # layer 7's rates move: 2 and 3 are now the coldest
    slot_map[0, 2] = 3  # expert 2 of layer 4 promoted into a slot: layer 4 is chosen again at once, 7 is not
    split.begin_step()
    assert split.cpu_experts(4) == set()  # expert 1 alone (rate 5) is all of the free rate: more than half
    assert split.cpu_experts(7) == {0}
    for _ in range(REFRESH_STEPS - 2):
        split.begin_step()
    assert split.cpu_experts(7) == {0}  # kept for REFRESH_STEPS steps
    split.begin_step()
    assert split.cpu_experts(7) == {2, 3}  # then every layer is chosen again
