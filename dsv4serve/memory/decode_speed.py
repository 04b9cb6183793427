"""The projected batch-1 decode speed of a memory plan, term by term (pure: no device calls).

    decode_bytes(specs, args, backends, context_tokens) -> DecodeBytes   what one token reads, by kind
    project_decode(bytes, slots, bandwidths, backend, cuda_graphs, hit_rate) -> DecodeProjection

Model of one batch-1 decode step (every constant below names its source or says it is an assumption):
- The GPU reads every resident weight once per token: attention, compressors, indexer, router, norms and
  hyper-connections (`dense`), the shared experts, the head and one embedding row, and the KV cache at
  `context_tokens`, at the card's bandwidth x DEVICE_READ_EFFICIENCY. Sizes are the worker's loaded sizes
  (memory/weights.py: packed FP8, the rest in fp32 or bf16), the same bytes the memory plan places.
- Routed experts: n_layers x n_activated_experts uses per token (258 on DeepSeek-V4-Flash). Hit-rate model:
  uniform, independent routing, so a use finds its expert in a GPU slot with probability slots / experts
  (any slot policy gives that under uniform references; real routing is skewed, so real hits are higher and
  this is the pessimistic end). Hits are read from GPU memory.
- Each miss is either read by the GPU over PCIe (h2d bandwidth), or computed on the CPU from host memory (host
  bandwidth x cpu_efficiency: kt-kernel's streaming rate over the weights). The two run in parallel with the
  GPU's expert work, but only after the layer's router has run: per layer, time = attention part + the slowest
  of the MoE lanes (GPU experts, PCIe copies, staged copies, CPU experts, host memory). Where the miss's expert
  lives changes its path (decode_lanes.py, `BankTiers`): pinned, read in place; pageable or on disk, staged by
  the host first (a disk page-in at disk bandwidth before it); and with hybrid only the layers kt-kernel holds
  can send misses to the CPU. Layers alike form a class; the step's MoE phase sums each class's slowest lane,
  at the CPU share of its misses that minimises it.
- Host memory is one resource for both ways of serving a miss: a copy's DMA reads the expert from host memory
  as the CPU's GEMV does, so every miss's bytes cross the host's memory bus once whichever lane takes it, and
  the `host memory` lane (all misses' bytes at host bandwidth) bounds the two together: PCIe's 50 GB/s beside
  a CPU's 40 cannot move 90 GB/s out of 80 GB/s of DDR5 (first-order: each lane keeps its own cap, and the
  sum of their reads is capped by the host's).
- A hybrid step hands each MoE layer's hidden state to the CPU and its output back: HANDOFF_SECONDS per layer.
- Launch overhead: CENSUS_LAUNCHES_PER_STEP launches x a per-launch gap (replayed CUDA graph or eager), added:
  at batch 1 most decode kernels run shorter than a launch, so the GPU waits for each.
Not modelled: speculative decoding (MTP), the page cache keeping some of the experts left on disk (a host
with spare RAM would; the bank's tiers leave it the margin only), the CPU's own contention with the copies
beyond the shared cap (cache, memory controller queues), and a KV cache that is not bf16.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dsv4serve.memory.decode_lanes import (
    TIERS,
    BankTiers,
    Rates,
    class_hit_rates,
    class_lanes,
    fetch_seconds_per_byte,
    miss_seconds_per_byte,
)
from dsv4serve.model.args import ModelArgs
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.schema import TensorSpec

GB = 1e9  # bandwidths are in GB/s (10^9 bytes), as cards and memory are sold

# the defaults `dsv4serve plan` assumes when not told (each an assumption, printed with its source)
DEFAULT_GPU_GBPS = 1790.0  # RTX 5090 (users.md: the first users' card), NVIDIA's spec sheet: 1792 GB/s GDDR7
DEFAULT_H2D_GBPS = 50.0  # PCIe 5.0 x16, pinned: ~64 GB/s raw per direction, ~50 achieved (issue 18)
DEFAULT_HOST_GBPS = 80.0  # DDR5 dual channel: 2 x 8 B x 5600 MT/s = 89.6 GB/s peak, ~80 sustained
# assumed: an NVMe SSD (PCIe 4.0, ~7 GB/s sequential on spec sheets) read through page faults on the memory-mapped
# shards, one expert (13 MB) at a time in readahead-sized pieces: about 3 GB/s
DEFAULT_DISK_GBPS = 3.0
# kt-kernel's MXFP4 expert GEMV streams its weights at this fraction of the host's memory bandwidth. Measured
# on a 2-core VM: 24% (issue 18; compute-bound per core there). A desktop with 8-16 cores is memory-bound; 0.5
# is an assumption between that floor and STREAM-like reads (~0.8); bench/bench_cpu_experts.py measures it.
DEFAULT_CPU_EFFICIENCY = 0.5
# achieved / spec device-memory bandwidth: toolchain.md measured 4.3 TB/s copy on an H200 sold at 4.8 TB/s
DEVICE_READ_EFFICIENCY = 0.9
# the share of that read bandwidth today's decode kernels reach: measured on one H200 (2026-12-04, bench/RESULTS.md
# "the second GPU session"): a batch-1 decode step of 2 real-dimension layers + head, replayed as a CUDA graph, read
# its weights at 1,164 GB/s against a 4,267 GB/s device copy (1,061 before the decode GEMMs' K splits). The
# projection prints the step at the bandwidth bound (1.0) and at this share (`plan`'s "with today's kernels" line)
MEASURED_KERNEL_EFFICIENCY = 0.27
MEASURED_KERNEL_EFFICIENCY_SOURCE = (
    "one H200, 2026-12-04: a batch-1 decode step read its weights at 27% of the copy bandwidth (1,164 of 4,267 GB/s)"
)
# kernel launches of one batch-1 decode step projected to DeepSeek-V4-Flash (bench/RESULTS.md, issue 16 census;
# 2,134 until the interpreter's casts back to bf16, no-ops on a GPU, stopped counting on 2026-12-05; 1,898 until
# the attention kernel's row index became per-step and the MoE output one launch, moe_combine, the same day; 1,556
# until the CSA indexer's head weights rode in its compressor's launch, 2026-12-07; 1,451 until the mHC launch that
# writes x applied the sub-layer norm, the same day; 1,364 until the compressors and the head took bf16 input; 1,322
# until a decode step's keys went into their window rings in the kv launch; 1,273 until each attention's wq_a and
# wkv became one launch, model/joined_fp8.py; 1,230 until wq_b's FP8 launches applied q_norm themselves; 1,187
# until the mHC post launch summed the MoE output itself, dsv4_kernels.hc_post_combine)
CENSUS_LAUNCHES_PER_STEP = 1144
# gap per kernel node when a CUDA graph replays: measured on that H200, 0.095 ms of idle device time over the 110
# kernels of a replayed batch-1 step (bench/gpu_profile.py: wall 1.634 ms, kernels 1.539 ms)
GRAPH_LAUNCH_SECONDS = 1e-6
# host cost per eager launch: measured there, the eager step of those 110 kernels left the device idle 3.6 ms
# (wall 5.14 ms, kernels 1.53 ms): ~33 us a launch, the model's Python and torch dispatch included
EAGER_LAUNCH_SECONDS = 33e-6
# assumed per MoE layer and hybrid step: the hidden state to the host, kt-kernel's submit / sync, the result
# back (two small copies at ~10 us latency each, plus the CPU pool's wake-up)
HANDOFF_SECONDS = 25e-6
# assumed per staged layer in a cut decode graph (experts/graph_cuts.py): the host's wait for the segment's routing
# (a stream sync, ~10 us once the device drains), the hook's Python, and the next segment's launch (~10 us)
CUT_SECONDS = 40e-6
DEFAULT_CONTEXT_TOKENS = 32768  # the KV read is priced at this context (users.md: agent prompts 20K-300K)

DENSE_GROUPS = ("attention", "compressor", "indexer", "router", "hc_norm")  # read before / at routing
BACKENDS = ("gpu", "offload", "hybrid")  # where misses go: none, PCIe only, PCIe or CPU (best split)
ALL_PINNED = BankTiers()  # a bank in pinned memory, every layer held by kt-kernel with hybrid
LANES = ("GPU experts", "PCIe copies", "staged copies", "CPU experts", "host memory")


@dataclass(frozen=True)
class DecodeBytes:
    """What one batch-1 decode token reads, by kind (bytes as the CUDA worker holds them)."""

    dense_bytes: int  # attention, compressors, indexer, router, norms / hc of all main layers
    shared_expert_bytes: int
    head_bytes: int  # the head plus one embedding row (the embedding is a lookup)
    kv_bytes: int  # KV entries read at the context the bytes were priced at
    expert_bytes: int  # one routed expert (w1 + w3 + w2 with scales): one slot
    expert_uses: int  # routed expert uses per token: n_layers x n_activated_experts
    n_experts: int  # routed experts of all main layers
    n_moe_layers: int
    context_tokens: int


@dataclass(frozen=True)
class Bandwidths:
    """GB/s: the GPU's memory (spec), host-to-device copies, host memory; and kt-kernel's share of the last."""

    gpu_gbps: float = DEFAULT_GPU_GBPS
    h2d_gbps: float = DEFAULT_H2D_GBPS
    host_gbps: float = DEFAULT_HOST_GBPS
    cpu_efficiency: float = DEFAULT_CPU_EFFICIENCY
    kernel_efficiency: float = 1.0  # the share of the GPU's read bandwidth the kernels reach (1: the bound)
    disk_gbps: float = DEFAULT_DISK_GBPS  # page-ins of experts the bank left on disk

    def __post_init__(self) -> None:
        for name in ("gpu_gbps", "h2d_gbps", "host_gbps", "cpu_efficiency", "kernel_efficiency", "disk_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def gpu_read_bps(self) -> float:
        return self.gpu_gbps * GB * DEVICE_READ_EFFICIENCY * self.kernel_efficiency

    @property
    def cpu_expert_bps(self) -> float:
        return self.host_gbps * GB * self.cpu_efficiency

    @property
    def host_bps(self) -> float:
        return self.host_gbps * GB

    def rates(self) -> Rates:
        return Rates(self.gpu_read_bps, self.h2d_gbps * GB, self.host_bps, self.cpu_expert_bps, self.disk_gbps * GB)


def miss_cost_weights(bw: Bandwidths | None = None) -> dict[str, float]:
    """What a fetched miss costs in each tier of the bank, relative to a pinned one (decode_lanes' chains; the
    defaults' assumptions unless measured bandwidths are given): the expert-slot cache's residency weights."""
    rates = (bw or Bandwidths()).rates()
    pinned = fetch_seconds_per_byte("pinned", rates)
    return {tier: fetch_seconds_per_byte(tier, rates) / pinned for tier in TIERS}


@dataclass(frozen=True)
class Term:
    name: str
    seconds: float
    detail: str


@dataclass(frozen=True)
class DecodeProjection:
    backend: str
    cuda_graphs: bool
    hits_per_token: float
    misses_per_token: float
    cpu_fraction: float  # of the misses, computed on the CPU
    serial: tuple[Term, ...]  # run one after another on the GPU's stream
    parallel: tuple[Term, ...]  # the MoE phase's lanes, each summed over the classes of layers (decode_lanes.py)
    moe_seconds: float  # the MoE phase: per class of layers its slowest lane, summed
    bound_by: str  # the slowest lane of the class that costs most; lanes within 0.1% of it named too
    notes: tuple[str, ...] = field(default=())

    @property
    def step_seconds(self) -> float:
        return sum(t.seconds for t in self.serial) + self.moe_seconds

    @property
    def tokens_per_second(self) -> float:
        return 1.0 / self.step_seconds

    def to_json(self) -> dict:
        return {
            "backend": self.backend,
            "cuda_graphs": self.cuda_graphs,
            "tokens_per_second": round(self.tokens_per_second, 2),
            "step_ms": round(self.step_seconds * 1e3, 3),
            "hits_per_token": round(self.hits_per_token, 2),
            "misses_per_token": round(self.misses_per_token, 2),
            "cpu_fraction_of_misses": round(self.cpu_fraction, 4),
            "moe_ms": round(self.moe_seconds * 1e3, 4),
            "moe_phase_bound_by": self.bound_by,
            "serial_ms": {t.name: round(t.seconds * 1e3, 4) for t in self.serial},
            "parallel_ms": {t.name: round(t.seconds * 1e3, 4) for t in self.parallel},
            "terms": [
                {"name": t.name, "lane": lane, "ms": round(t.seconds * 1e3, 4), "detail": t.detail}
                for lane, terms in (("serial", self.serial), ("parallel", self.parallel))
                for t in terms
            ],
            "notes": list(self.notes),
        }


def kv_read_bytes(args: ModelArgs, context_tokens: int, entry_bytes: int = 2) -> int:
    """KV bytes one decode token reads at this context (dsv4-model.md §2.11; bf16 cache): every layer its
    window; a CSA layer all its indexer keys and the top-k compressed entries; an HCA layer every entry."""
    total = 0
    for i in range(args.n_layers):
        r, kind = args.compress_ratios[i], args.kind(i)
        total += min(context_tokens, args.window_size) * args.head_dim * entry_bytes
        entries = context_tokens // r if r else 0
        if kind == "csa":
            total += entries * args.index_head_dim * entry_bytes
            total += min(args.index_topk, entries) * args.head_dim * entry_bytes
        elif r:
            total += entries * args.head_dim * entry_bytes
    return total


def decode_bytes(
    specs: Iterable[TensorSpec],
    args: ModelArgs,
    backends: KernelBackends,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
) -> DecodeBytes:
    """The per-token reads of the main model (no MTP) with the worker's loaded sizes for `backends`."""
    from dsv4serve.memory.weights import device_bytes, weight_bytes

    main = [s for s in specs if s.layer is None or s.layer < args.n_layers]
    rope = device_bytes([], args, backends, False, False).non_expert_bytes  # per-block buffers, counted once

    def loaded(groups: tuple[str, ...]) -> int:
        part = [s for s in main if s.group in groups]
        return device_bytes(part, args, backends, False, False).non_expert_bytes - rope

    embed_row = loaded(("embed",)) // args.vocab_size
    w = weight_bytes(main, args)
    return DecodeBytes(
        dense_bytes=loaded(DENSE_GROUPS) + rope,
        shared_expert_bytes=loaded(("shared_experts",)),
        head_bytes=loaded(("head",)) + embed_row,
        kv_bytes=kv_read_bytes(args, context_tokens),
        expert_bytes=w.expert_bytes,
        expert_uses=args.n_layers * args.n_activated_experts,
        n_experts=w.n_experts,
        n_moe_layers=args.n_layers,
        context_tokens=context_tokens,
    )


def expected_hits(b: DecodeBytes, slots: int) -> float:
    """Slot hits per token under uniform, independent routing: uses x slots / experts."""
    return b.expert_uses * min(slots, b.n_experts) / b.n_experts


def _serial_terms(
    b: DecodeBytes, gpu_bps: float, cuda_graphs: bool, handoff_s: float, cut_layers: float = 0.0
) -> tuple[Term, ...]:
    """The GPU stream's own work, one term after another; `cut_layers`: staged layers cutting a graph step."""
    launch_s = GRAPH_LAUNCH_SECONDS if cuda_graphs else EAGER_LAUNCH_SECONDS
    cuts = cut_layers if cuda_graphs else 0.0
    mb = 1e6
    return (
        Term(
            "dense weights", b.dense_bytes / gpu_bps, f"{b.dense_bytes / mb:,.0f} MB (attention, compressors, indexer)"
        ),
        Term("KV cache", b.kv_bytes / gpu_bps, f"{b.kv_bytes / mb:,.1f} MB at {b.context_tokens:,} tokens of context"),
        Term("head + embedding row", b.head_bytes / gpu_bps, f"{b.head_bytes / mb:,.0f} MB"),
        Term(
            "kernel launches",
            CENSUS_LAUNCHES_PER_STEP * launch_s,
            f"{CENSUS_LAUNCHES_PER_STEP:,} x {launch_s * 1e6:g} us ({'CUDA graph' if cuda_graphs else 'eager'})",
        ),
        Term(
            "CPU handoffs",
            handoff_s,
            f"{b.n_moe_layers} layers x {HANDOFF_SECONDS * 1e6:g} us" if handoff_s else "none",
        ),
        Term(
            "graph cuts",
            cuts * CUT_SECONDS,
            f"{cuts:.1f} staged layers x {CUT_SECONDS * 1e6:g} us (the host stages between graph segments)"
            if cuts
            else "none",
        ),
    )


def project_decode(
    b: DecodeBytes,
    slots: int,
    bw: Bandwidths,
    backend: str = "hybrid",
    cuda_graphs: bool = True,
    hit_rate: float | None = None,
    tiers: BankTiers = ALL_PINNED,
) -> DecodeProjection:
    """Batch-1 decode step time with `slots` GPU expert slots (slots >= experts: all resident). `hit_rate`
    replaces the uniform-routing hit model (a what-if for skewed routing); `tiers` where the bank holds the
    experts outside the slots (default: all pinned, every layer held by kt-kernel with hybrid)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if hit_rate is not None and not 0.0 <= hit_rate <= 1.0:
        raise ValueError(f"hit_rate must be within [0, 1], got {hit_rate}")
    rates = bw.rates()
    hits = expected_hits(b, slots) if hit_rate is None else b.expert_uses * hit_rate
    misses = b.expert_uses - hits
    if misses > 0 and backend == "gpu":
        raise ValueError(f"backend 'gpu' needs every expert resident: {slots} slots < {b.n_experts} experts")
    classes = tiers.classes() if misses else [("pinned", 1.0, False)]
    # uniform routing: the slots hold the costliest misses' experts (decode_lanes.class_hit_rates); a given hit
    # rate applies to every class alike
    cost = [miss_seconds_per_byte(t, held, rates, backend == "hybrid") for t, _, held in classes]
    rates_by_class = (
        class_hit_rates(classes, min(slots, b.n_experts) / b.n_experts, cost)
        if hit_rate is None and misses
        else [hits / b.expert_uses] * len(classes)
    )
    lanes: dict[str, float] = dict.fromkeys(LANES, 0.0)
    moe_s = handoff_s = cpu_misses = 0.0
    fetched: dict[str, float] = dict.fromkeys(TIERS, 0.0)
    binding: tuple[float, str] = (-1.0, "")
    for (tier, share, held), h in zip(classes, rates_by_class):
        class_hits, class_misses = b.expert_uses * share * h, b.expert_uses * share * (1 - h)
        fixed_s = (b.shared_expert_bytes * share + class_hits * b.expert_bytes) / rates.gpu
        args = (tier, held, fixed_s, class_misses * b.expert_bytes, rates)
        class_lanes_s, f = class_lanes(*args, use_cpu=False)
        if backend == "hybrid" and held:  # the handoff is paid only where the CPU takes a share: worth it?
            with_cpu, f_cpu = class_lanes(*args, use_cpu=True)
            class_handoff = share * b.n_moe_layers * HANDOFF_SECONDS
            if f_cpu > 0 and max(with_cpu.values()) + class_handoff < max(class_lanes_s.values()):
                class_lanes_s, f, handoff_s = with_cpu, f_cpu, handoff_s + class_handoff
        slowest = max(class_lanes_s.values())
        moe_s += slowest
        if slowest > binding[0]:
            binding = (slowest, " = ".join(n for n in LANES if class_lanes_s[n] >= slowest * 0.999))
        for name in LANES:
            lanes[name] += class_lanes_s[name]
        cpu_misses += class_misses * f
        fetched[tier] += class_misses * (1 - f)
    mb = 1e6
    n_fetched = sum(fetched.values())
    parallel = (
        Term(
            "GPU experts",
            lanes["GPU experts"],
            f"shared {b.shared_expert_bytes / mb:,.0f} MB + {hits:.1f} hits + {n_fetched:.1f} fetched "
            f"x {b.expert_bytes / mb:.2f} MB at {rates.gpu / GB:,.0f} GB/s",
        ),
        Term("PCIe copies", lanes["PCIe copies"], f"{fetched['pinned']:.1f} pinned misses at {bw.h2d_gbps:g} GB/s"),
        Term(
            "staged copies",
            lanes["staged copies"],
            f"{fetched['pageable'] + fetched['disk']:.1f} unpinned misses ({fetched['disk']:.1f} from disk at "
            f"{bw.disk_gbps:g} GB/s), each copied by the host then read over PCIe"
            if fetched["pageable"] + fetched["disk"]
            else "none: the bank is pinned",
        ),
        Term(
            "CPU experts",
            lanes["CPU experts"],
            f"{cpu_misses:.1f} misses at {bw.host_gbps:g} GB/s x {bw.cpu_efficiency:g} = "
            f"{bw.cpu_expert_bps / GB:.1f} GB/s",
        ),
        Term(
            "host memory",
            lanes["host memory"],
            f"{misses:.1f} misses x {b.expert_bytes / mb:.2f} MB read at {bw.host_gbps:g} GB/s "
            "(copies and CPU share it; staged misses cross it 3-4 times)",
        ),
    )
    if hit_rate is None:
        note = (
            f"hits: {b.expert_uses} uses x {min(slots, b.n_experts)} slots / {b.n_experts} experts = {hits:.2f} "
            "per token (uniform routing; skewed routing hits more)"
        )
    else:
        note = f"hits: {b.expert_uses} uses x {hit_rate:g} (hit rate given) = {hits:.2f} per token"
    notes = [note]
    if misses and "host memory" in binding[1]:
        notes.append(
            f"host memory binds the MoE phase: each miss is read from host memory once, by a copy's DMA or by the "
            f"CPU, {misses * b.expert_bytes / GB:.2f} GB a token at {bw.host_gbps:g} GB/s whichever lane takes it; "
            "only more slot hits (more slots, skewed routing) or a faster host memory (more channels) raise it"
        )
    cut_layers = (1.0 - tiers.pinned) * b.n_moe_layers if misses else 0.0  # every staged layer cuts the graph
    serial = _serial_terms(b, rates.gpu, cuda_graphs, handoff_s, cut_layers)
    return DecodeProjection(
        backend, cuda_graphs, hits, misses, cpu_misses / misses if misses else 0.0, serial, parallel, moe_s,
        binding[1], tuple(notes),
    )  # fmt: skip
