"""The projected batch-1 decode speed (memory/decode_speed.py, decode_lanes.py, decode_choice.py) against cases
computed by hand, and its byte counts against the real DeepSeek-V4-Flash tensor list and the model document."""

from __future__ import annotations

import pytest

from dsv4serve.memory import decode_speed as ds
from dsv4serve.memory.decode_choice import bank_tiers, best_kt_layers, faster_backend, offload_faster, project_backends
from dsv4serve.memory.decode_lanes import BankTiers, class_hit_rates
from dsv4serve.memory.decode_speed import Bandwidths, DecodeBytes, project_decode
from dsv4serve.memory.plan import Machine
from dsv4serve.memory.weights import loaded_weight_bytes
from dsv4serve.model.args import read_model_args
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.schema import checkpoint_schema

MS = 1e-3
# round numbers: GPU reads at 1000 GB/s x 0.9 = 900 GB/s, so 9 GB of dense weights take 10 ms
TOY = DecodeBytes(
    dense_bytes=9_000_000_000,
    shared_expert_bytes=900_000_000,
    head_bytes=900_000_000,
    kv_bytes=0,
    expert_bytes=10_000_000,  # 10 MB
    expert_uses=200,
    n_experts=1000,
    n_moe_layers=40,
    context_tokens=0,
)
BW = Bandwidths(gpu_gbps=1000 / ds.DEVICE_READ_EFFICIENCY * 0.9, h2d_gbps=50, host_gbps=80, cpu_efficiency=0.5)
LAUNCH_MS = ds.CENSUS_LAUNCHES_PER_STEP * ds.GRAPH_LAUNCH_SECONDS / MS
HANDOFF_MS = 40 * ds.HANDOFF_SECONDS / MS


def test_every_expert_resident_reads_all_uses_from_the_gpu():
    p = project_decode(TOY, slots=1000, bw=BW, backend="gpu")
    assert p.hits_per_token == 200 and p.misses_per_token == 0 and p.cpu_fraction == 0
    # 9 GB + 0.9 GB head = 11 ms serial; MoE lane: 0.9 GB shared + 200 x 10 MB = 2.9 GB = 3.222 ms
    assert p.step_seconds / MS == pytest.approx(10 + 1 + LAUNCH_MS + 2.9 / 0.9)
    assert p.bound_by == "GPU experts"


def test_offload_pays_every_miss_over_pcie():
    p = project_decode(TOY, slots=100, bw=BW, backend="offload")
    # uniform routing: 200 uses x 100 / 1000 slots = 20 hits, 180 misses = 1.8 GB at 50 GB/s = 36 ms
    assert p.hits_per_token == pytest.approx(20) and p.misses_per_token == pytest.approx(180)
    lanes = {t.name: t.seconds / MS for t in p.parallel}
    assert lanes["PCIe copies"] == pytest.approx(36) and lanes["CPU experts"] == 0
    assert lanes["GPU experts"] == pytest.approx((0.9 + 0.2 + 1.8) / 0.9)  # shared + hits + the fetched copies
    assert p.step_seconds / MS == pytest.approx(11 + LAUNCH_MS + 36)
    assert p.tokens_per_second == pytest.approx(1 / p.step_seconds)


def test_hybrid_splits_misses_so_pcie_and_cpu_finish_together():
    # a host memory fast enough not to bind: 1000 GB/s, the CPU's GEMV at 0.04 of it = 40 GB/s
    fast_host = Bandwidths(**{**vars(BW), "host_gbps": 1000, "cpu_efficiency": 0.04})
    p = project_decode(TOY, slots=100, bw=fast_host, backend="hybrid")
    # PCIe 50 GB/s and the CPU 40 GB/s in parallel move 1.8 GB like one 90 GB/s link: 20 ms,
    # with 40/90 of the misses on the CPU (each lane 20 ms); host memory reads 1.8 GB at 1000 GB/s: 1.8 ms
    assert p.cpu_fraction == pytest.approx(40 / 90)
    lanes = {t.name: t.seconds / MS for t in p.parallel}
    assert lanes["PCIe copies"] == pytest.approx(20) and lanes["CPU experts"] == pytest.approx(20)
    assert lanes["host memory"] == pytest.approx(1.8)
    assert p.bound_by == "PCIe copies = CPU experts"
    assert p.step_seconds / MS == pytest.approx(11 + LAUNCH_MS + HANDOFF_MS + 20)


def test_copies_and_cpu_experts_share_the_host_memory():
    # PCIe 50 + CPU 80 x 0.5 = 40 would move 1.8 GB in 20 ms, but both read the experts from the same
    # 80 GB/s host memory: 1.8 GB / 80 GB/s = 22.5 ms binds the MoE phase
    p = project_decode(TOY, slots=100, bw=BW, backend="hybrid")
    lanes = {t.name: t.seconds / MS for t in p.parallel}
    assert lanes["PCIe copies"] == pytest.approx(20) and lanes["CPU experts"] == pytest.approx(20)
    assert lanes["host memory"] == pytest.approx(22.5)
    assert p.bound_by == "host memory"
    assert p.step_seconds / MS == pytest.approx(11 + LAUNCH_MS + HANDOFF_MS + 22.5)
    # offload alone: PCIe's 36 ms binds, the host's 22.5 does not; a 30 GB/s host binds it at 60 ms
    assert project_decode(TOY, 100, BW, "offload").bound_by == "PCIe copies"
    slow_host = project_decode(TOY, 100, Bandwidths(**{**vars(BW), "host_gbps": 30}), "offload")
    assert slow_host.bound_by == "host memory"
    assert slow_host.step_seconds / MS == pytest.approx(11 + LAUNCH_MS + 60)


def test_a_slow_gpu_lane_gets_the_cpu_share_that_balances_it():
    # no shared expert or hits; the GPU reads a fetched miss in 10 MB / 900 GB/s; PCIe is nearly free, so the
    # GPU's reading of fetched copies binds: f x 180 x 10 MB / CPU = (1 - f) x 1.8 GB / GPU
    slow_gpu = Bandwidths(gpu_gbps=40 / ds.DEVICE_READ_EFFICIENCY, h2d_gbps=1e6, host_gbps=80, cpu_efficiency=0.5)
    p = project_decode(DecodeBytes(**{**TOY.__dict__, "shared_expert_bytes": 0}), 0, slow_gpu, "hybrid")
    assert p.cpu_fraction == pytest.approx(0.5) and p.hits_per_token == 0  # GPU 40 GB/s and CPU 40 GB/s: half each


def test_the_cpu_is_left_idle_when_its_handoffs_cost_more_than_it_saves():
    few = DecodeBytes(**{**TOY.__dict__, "expert_uses": 2})  # 1.8 misses: 0.36 ms over PCIe
    p = project_decode(few, slots=100, bw=BW, backend="hybrid")
    assert p.cpu_fraction == 0 and {t.name: t.seconds for t in p.serial}["CPU handoffs"] == 0
    # splitting would save 0.36 - 0.2 ms but cost 40 handoffs (1 ms)
    assert HANDOFF_MS > 0.36 - 0.2


def test_eager_launches_cost_the_census_count_times_the_eager_gap():
    eager = project_decode(TOY, 1000, BW, "gpu", cuda_graphs=False)
    graph = project_decode(TOY, 1000, BW, "gpu", cuda_graphs=True)
    expected = ds.CENSUS_LAUNCHES_PER_STEP * (ds.EAGER_LAUNCH_SECONDS - ds.GRAPH_LAUNCH_SECONDS)
    assert eager.step_seconds - graph.step_seconds == pytest.approx(expected)
    assert ds.CENSUS_LAUNCHES_PER_STEP == 1144  # bench/RESULTS.md, issue 16 (the census of 2026-12-07, fifth)


def test_a_given_hit_rate_replaces_the_uniform_model():
    p = project_decode(TOY, slots=100, bw=BW, backend="offload", hit_rate=0.5)
    # 100 hits, 100 misses = 1 GB at 50 GB/s = 20 ms (uniform would be 20 hits: 36 ms)
    assert p.hits_per_token == 100 and {t.name: t.seconds / MS for t in p.parallel}["PCIe copies"] == pytest.approx(20)
    with pytest.raises(ValueError, match="hit_rate"):
        project_decode(TOY, 100, BW, "offload", hit_rate=1.5)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="h2d_gbps"):
        Bandwidths(h2d_gbps=0)
    with pytest.raises(ValueError, match="every expert resident"):
        project_decode(TOY, 10, BW, "gpu")
    with pytest.raises(ValueError, match="backend"):
        project_decode(TOY, 10, BW, "cpu")


# --------------------------------------------------------------------------- the real model's bytes


@pytest.fixture(scope="module")
def real(real_model_dir):
    args = read_model_args(real_model_dir)
    specs = checkpoint_schema(args)
    backends = KernelBackends.every("triton")
    return args, specs, backends, ds.decode_bytes(specs, args, backends, context_tokens=32768)


def test_real_expert_uses_and_size_match_the_issue(real):
    _, _, _, b = real
    assert b.expert_uses == 258 and b.n_experts == 43 * 256 and b.n_moe_layers == 43  # issue 18: 258 uses
    assert b.expert_bytes == int(12.75 * 2**20)  # issue 18 / dsv4-model.md §6: 12.75 MiB per expert
    assert ds.expected_hits(b, 890) == pytest.approx(258 * 890 / 11008)


def test_real_kv_read_at_32k_matches_the_layout_by_hand(real):
    # dsv4-model.md §2.11, bf16, head_dim 512, indexer 128, window 128, top-k 512; 2 window-only layers,
    # 21 CSA (ratio 4), 20 HCA (ratio 128). At 32,768 tokens: every layer a 128 x 512 x 2 window; a CSA layer
    # 8,192 indexer keys x 128 x 2 + 512 entries x 512 x 2; an HCA layer 256 entries x 512 x 2
    _, _, _, b = real
    assert b.kv_bytes == 43 * 131_072 + 21 * (2_097_152 + 524_288) + 20 * 262_144 == 65_929_216


def test_real_read_bytes_are_the_plans_resident_weights_less_the_unread_embedding(real):
    args, specs, backends, b = real
    loaded = loaded_weight_bytes(specs, args, backends)  # what the memory plan places on the GPU
    embed_bytes = args.vocab_size * args.dim * 2  # bf16 (HELD_BF16): all but one row stays unread
    row = args.dim * 2
    assert b.dense_bytes + b.shared_expert_bytes + b.head_bytes == loaded.non_expert_bytes - embed_bytes + row
    assert b.head_bytes == args.vocab_size * args.dim * 2 + row  # the head held bf16 (HEAD_BF16 on Triton)
    # FP8 w1 / w3 / w2 (2048 x 4096 each) + one E8M0 byte per 128 x 128 block (16 x 32 blocks)
    assert b.shared_expert_bytes == 43 * 3 * (2048 * 4096 + 16 * 32)


def test_a_32gb_card_with_ddr5_is_projected_between_offload_and_a_perfect_link(real):
    _, _, _, b = real
    slots = 890  # the 32 GiB native plan's slot count (tests/unit/test_plan_cli.py checks the plan's own)
    offload = project_decode(b, slots, Bandwidths(), "offload")
    hybrid = project_decode(b, slots, Bandwidths(), "hybrid")
    misses_gb = (258 - 258 * slots / 11008) * b.expert_bytes / 1e9
    assert {t.name: t.seconds for t in offload.parallel}["PCIe copies"] == pytest.approx(misses_gb / 50)
    # the CPU's 40 GB/s beside PCIe's 50 would move the misses at 90 GB/s, but the 80 GB/s DDR5 they both
    # read from binds: every miss crosses it once
    lanes = {t.name: t.seconds for t in hybrid.parallel}
    assert lanes["CPU experts"] == pytest.approx(misses_gb / 90)
    assert lanes["host memory"] == pytest.approx(misses_gb / 80) and hybrid.bound_by == "host memory"
    assert offload.tokens_per_second < hybrid.tokens_per_second < 1 / (misses_gb / 80)


def test_todays_kernel_efficiency_scales_the_gpu_terms_only():
    """kernel_efficiency divides what the GPU reads (dense, head, GPU experts), not PCIe or the CPU's lane."""
    slow = Bandwidths(**{**vars(BW), "kernel_efficiency": 0.25})
    for backend in ("offload", "hybrid"):
        full, today = project_decode(TOY, 100, BW, backend), project_decode(TOY, 100, slow, backend)
        terms = {t.name: t.seconds for t in full.serial}
        slow_terms = {t.name: t.seconds for t in today.serial}
        assert slow_terms["dense weights"] == pytest.approx(4 * terms["dense weights"])
        assert slow_terms["kernel launches"] == terms["kernel launches"]
        assert today.step_seconds > full.step_seconds
    with pytest.raises(ValueError, match="kernel_efficiency"):
        Bandwidths(kernel_efficiency=0.0)


# --------------------------------------------------------------------------- where the bank holds the misses


def test_the_bank_tiers_cut_the_layers_into_classes():
    """Whole layers in order: pinned first, then pageable, then disk; kt-kernel holds the first cpu_layers."""
    classes = BankTiers(pinned=0.5, pageable=0.25, cpu_layers=0.6).classes()
    assert [(t, round(w, 9), held) for t, w, held in classes] == [
        ("pinned", 0.5, True), ("pageable", 0.1, True), ("pageable", 0.15, False), ("disk", 0.25, False),
    ]  # fmt: skip
    assert BankTiers().classes() == [("pinned", 1.0, True)] and BankTiers(0.3, 0.3).disk == pytest.approx(0.4)
    with pytest.raises(ValueError, match="exceed the bank"):
        BankTiers(0.8, 0.3)


def test_unpinned_misses_wait_for_the_host_to_stage_them_and_disk_ones_for_a_page_in_first():
    # 200 uses: half in pinned layers, a quarter pageable, a quarter on disk. The 100 slots go to the costliest
    # misses first (residency.py's weights): 100 of the disk layers' 250 experts, so 20 of their 50 uses hit
    p = project_decode(TOY, 100, BW, "offload", tiers=BankTiers(pinned=0.5, pageable=0.25))
    assert p.hits_per_token == pytest.approx(20) and p.misses_per_token == pytest.approx(180)
    lanes = {t.name: t.seconds / MS for t in p.parallel}
    pinned = 1.0 / 50  # 100 misses, 1 GB read in place over PCIe: 20 ms, beside its host reads (1.0 / 80)
    pageable = 0.5 * (1 / 50 + 2 / 80)  # 50: the host copies (a read and a write), then PCIe: 22.5 ms in a chain
    disk = 0.3 * (1 / 3 + 2 / 80 + 1 / 50)  # 30: a 3 GB/s page-in before that: 113.5 ms
    assert lanes["PCIe copies"] == pytest.approx(pinned * 1e3) and lanes["staged copies"] == pytest.approx(
        (pageable + disk) * 1e3
    )
    assert lanes["host memory"] == pytest.approx((1.0 * 1 + 0.5 * 3 + 0.3 * 4) / 80 * 1e3)
    assert p.moe_seconds == pytest.approx(pinned + pageable + disk)  # each class waits for its slowest lane
    cuts_ms = 0.5 * 40 * ds.CUT_SECONDS / MS  # the 20 unpinned layers cut the decode graph (graph_cuts.py)
    assert {t.name: t.seconds / MS for t in p.serial}["graph cuts"] == pytest.approx(cuts_ms)
    assert p.step_seconds / MS == pytest.approx(11 + LAUNCH_MS + cuts_ms + (pinned + pageable + disk) * 1e3)
    assert p.bound_by == "staged copies"


def test_slots_go_to_the_costliest_misses_first():
    """decode_lanes.class_hit_rates: the slot fraction fills classes by miss cost, equal costs alike."""
    classes = [("pinned", 0.5, True), ("pageable", 0.2, False), ("disk", 0.3, False)]
    assert class_hit_rates(classes, 0.1, [1.0, 2.0, 9.0]) == pytest.approx([0.0, 0.0, 1 / 3])
    assert class_hit_rates(classes, 0.4, [1.0, 2.0, 9.0]) == pytest.approx([0.0, 0.5, 1.0])
    assert class_hit_rates(classes, 0.5, [1.0, 9.0, 9.0]) == pytest.approx([0.0, 1.0, 1.0])
    assert class_hit_rates(classes, 0.2, [1.0, 1.0, 1.0]) == pytest.approx([0.2, 0.2, 0.2])  # uniform: slots / experts
    assert class_hit_rates(classes, 1.0, [3.0, 2.0, 1.0]) == pytest.approx([1.0, 1.0, 1.0])
    # the weights the slot cache takes at the assumed bandwidths: disk misses ~19 pinned ones, pageable ~2.25
    w = ds.miss_cost_weights()
    assert w["pinned"] == 1.0 and w["pageable"] == pytest.approx(1 + (2 / 80) / (1 / 50))
    assert w["disk"] == pytest.approx((1 / 50 + 2 / 80 + 1 / 3) / (1 / 50))


def test_hybrid_sends_a_disk_layer_s_misses_to_the_cpu_where_kt_kernel_holds_it():
    # every layer on disk, kt-kernel holds half of them: the other half fetch every miss through a page-in, so
    # the 100 slots go to it (its misses cost the most): 20 of its 100 uses hit
    p = project_decode(TOY, 100, BW, "hybrid", tiers=BankTiers(pinned=0.0, pageable=0.0, cpu_layers=0.5))
    per_gb = 1 / 3 + 2 / 80 + 1 / 50  # the page-in, the staging copy, PCIe
    chain = 0.8 * per_gb  # 80 misses, 0.8 GB: 302.7 ms fetched
    held = 1.0 * per_gb  # the held half's 100 misses if fetched: 378.3 ms
    f = held / (held + 1.0 / 40)  # there the CPU (40 GB/s) and the fetch chain finish together
    assert p.hits_per_token == pytest.approx(20)
    assert p.cpu_fraction == pytest.approx(100 * f / 180)
    assert p.moe_seconds == pytest.approx(chain + f * 1.0 / 40)
    assert {t.name: t.seconds / MS for t in p.serial}["CPU handoffs"] == pytest.approx(HANDOFF_MS / 2)


def test_a_32gb_card_s_backends_as_the_worker_runs_them(real):
    """On 128 GiB of RAM the bank (137 GiB) does not fit: offload stages 12% from disk, its graphs cut at those
    layers; hybrid's kt-kernel copy (1.3x) would leave the bank on disk, so it holds one layer only (the fewest
    hybrid can: best_kt_layers) and still loses to offload. With the whole bank pinned beside that copy (384 GiB) both replay graphs
    (hybrid with its CPU split fixed between steps) and hybrid's CPU share pays off; with --speculative-tokens
    hybrid's verify steps sync, so it runs eager and offload wins."""
    _, _, _, b = real
    slots, bank = 936, 137 * 2**30

    def backends(host_gib: int, eager: bool = False, speculative: bool = False):
        machine = Machine(32 * 2**30, host_gib * 2**30, "native")
        return project_backends(b, slots, bank, machine, Bandwidths(), eager, ("offload", "hybrid"), speculative)

    small = backends(128)
    # 120 GiB of RAM less one layer's staging area; the staged layers cut the graphs
    assert small["offload"][1].disk == pytest.approx(1 - (120 - 137 / 43) / 137) and small["offload"][2] is None
    # kt-kernel holding every layer that fits (28) left the bank all on disk: 2.5 tokens/s
    assert small["hybrid"][1].cpu_layers == pytest.approx(1 / 43) and small["hybrid"][1].pinned > 0.8
    assert faster_backend(small) == "offload" and small["offload"][0].tokens_per_second < 8
    # the slots hold disk layers' experts first, the graphs cut at the staged layers (3.8 tokens/s when the slots
    # held every layer's alike, those steps ran eager and the staging area's RAM went uncounted)
    assert "offload 6.8 vs hybrid 5.4" in (offload_faster(small) or "")
    big = backends(384)
    assert big["offload"][2] is None and big["hybrid"][2] is None  # both all pinned: graphs
    assert faster_backend(big) == "hybrid" and offload_faster(big) is None
    assert big["hybrid"][0].tokens_per_second == pytest.approx(21.35, abs=0.05)  # 21.3 at 1,273 launches
    spec = backends(384, speculative=True)
    assert spec["hybrid"][2] == "hybrid CPU experts sync per MoE layer in the speculative verify steps"
    assert "offload 14.4 vs hybrid 12.0" in (offload_faster(spec) or "")  # eager: 1,144 launches (11.4 at 1,273)


def test_hybrid_holds_the_count_of_layers_in_kt_kernel_that_decodes_fastest(real):
    """kt-kernel's copy (1.3x a layer's bytes) and the bank share host RAM: best_kt_layers projects every count from
    1 to what fits and keeps the fastest. On 192 GiB with the assumed rates (CPU experts 40 GB/s, below PCIe's 50) a
    layer's misses go faster pinned than on the CPU alone, so kt-kernel holds a few layers beside a bank still
    pinned (13, not the 43 that fit, which left the bank 98% on disk: 12.0 tokens/s, below offload's 14.3); with a
    host whose CPU experts outrun PCIe (8 channels) it holds more. Unknown host memory: None (all that fit)."""
    _, _, _, b = real
    slots, bank, n = 936, 137 * 2**30, 43

    def speed(k: int | None, machine: Machine, bw: Bandwidths) -> float:
        tiers = bank_tiers(bank, machine, True, n, k)
        return project_decode(b, slots, bw, "hybrid", True, None, tiers).tokens_per_second

    desktop = Machine(32 * 2**30, 192 * 2**30, "native")
    k = best_kt_layers(b, slots, bank, desktop, Bandwidths())
    assert k is not None and 1 <= k < n
    every = [speed(j, desktop, Bandwidths()) for j in range(1, n + 1)]  # 43 fit: 43 x 1.3 x 3.19 < 184 GiB
    assert speed(k, desktop, Bandwidths()) == pytest.approx(max(every)) and every[k - 1] == max(every)
    assert speed(None, desktop, Bandwidths()) == pytest.approx(every[-1])
    assert every[-1] < 14.3 < max(every)  # all 43: slower than offload (14.3), the best count faster
    projected = project_backends(b, slots, bank, desktop, Bandwidths(), False, ("offload", "hybrid"))
    assert faster_backend(projected) == "hybrid"
    assert projected["hybrid"][1].cpu_layers == pytest.approx(k / n)
    server = Bandwidths(host_gbps=200, cpu_efficiency=0.5)  # CPU experts at 100 GB/s, twice PCIe
    assert best_kt_layers(b, slots, bank, desktop, server) > k
    assert best_kt_layers(b, slots, bank, Machine(32 * 2**30, None, "native"), Bandwidths()) is None
    small = Machine(32 * 2**30, 128 * 2**30, "native")
    assert best_kt_layers(b, slots, bank, small, Bandwidths()) == 1  # at least one: hybrid was asked for
    assert best_kt_layers(b, slots, bank, small, Bandwidths(), at_least=0) == 0  # none beats any
