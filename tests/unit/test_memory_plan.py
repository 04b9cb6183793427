"""The whole-card memory plan, checked against the model document's own numbers and the users' cards."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess

import pytest

from dsv4serve.config import ConfigError, Setting, Source
from dsv4serve.memory.chunk_planner import GEOMETRY_SAFETY_FACTOR, PLATFORM_MARGIN_BYTES, prefill_geometry
from dsv4serve.memory.graph_memory import decode_graph_bytes
from dsv4serve.memory.host_plan import HOST_MARGIN_BYTES
from dsv4serve.memory.kv_geometry import kv_bytes, kv_geometry
from dsv4serve.memory.plan import Machine, PlanSettings, plan_memory
from dsv4serve.memory.weights import weight_bytes
from dsv4serve.model.args import read_model_args
from dsv4serve.model.schema import checkpoint_schema

GIB, MIB, GB = 1024**3, 1024**2, 1000**3
REAL_BYTES = 159_609_485_896


@pytest.fixture(scope="module")
def real(real_model_dir):
    args = read_model_args(real_model_dir)
    return args, weight_bytes(checkpoint_schema(args), args)


def settings(args, **explicit) -> PlanSettings:
    """Defaults as resolve.py leaves them; keyword arguments become explicit (cli) values."""

    def pick(name, default, default_source=Source.DEFAULT):
        return Setting(explicit[name], Source.CLI) if name in explicit else Setting(default, default_source)

    return PlanSettings(
        memory_ratio=pick("memory_ratio", 0.9),
        num_tokens=pick("num_tokens", None),
        moe_cache_size=pick("moe_cache_size", None),
        max_num_seqs=pick("max_num_seqs", 32),
        max_model_len=pick("max_model_len", args.max_position_embeddings, Source.MODEL_RULE),
        max_prefill_length=pick("max_prefill_length", None),
        enforce_eager=pick("enforce_eager", False),
    )


def fits(plan) -> bool:
    """The chunk's activations + the platform margin fit in what is left after weights, slots and KV."""
    c, g = plan.chunk, plan.geometry
    return (
        c.effective_tokens * c.activation_bytes_per_token + g.fixed_bytes + plan.margin_bytes
        <= plan.activation_free_bytes
    )


# ------------------------------------------------------------------------- geometry vs the document


def test_kv_bytes_per_token_match_the_model_document(real):
    args, _ = real
    kv = kv_geometry(args)
    assert kv.bytes_per_token == 6880  # dsv4-model.md §2.11: 21 x 256 + 21 x 64 + 20 x 8
    # compressor carry, fp32 (model/kv_pool.py): HCA 2 x 128 x 512 x 4 = 512 KiB; CSA: attention
    # 2 x 4 x 1024 x 4 + 2 x 4 x 512 x 4 = 48 KiB, indexer 2 x 4 x 256 x 4 + 2 x 4 x 128 x 4 = 12 KiB
    rings = 20 * 512 * 1024 + 21 * 60 * 1024
    assert kv.seq_state_bytes == rings + 43 * 128 * 512 * 2  # + one 128-token bf16 window per layer
    assert kv_bytes(kv, 2**20) == pytest.approx(6.72 * GIB, rel=0.01)  # "about 6.7 GiB at 1M"


def test_weight_split_matches_the_checkpoint(real):
    _, w = real
    assert w.non_expert_bytes + w.routed_expert_bytes + w.mtp_bytes == REAL_BYTES
    assert w.expert_bytes == 3 * (2048 * 2048 + 2048 * 128)  # w1/w3/w2: FP4 packed + e8m0 per 32
    assert w.n_experts == 43 * 256
    assert w.routed_expert_bytes == pytest.approx(137.06 * GIB, rel=1e-3)  # users.md: experts ~137 GiB


# ------------------------------------------------------------------------------------ users' cards


def test_32gb_wsl2_offloads_experts_and_the_chunk_fits(real):
    args, w = real
    plan = plan_memory(args, w, Machine(32 * GIB, 128 * GIB, "wsl2"), settings(args))
    assert not plan.experts_resident and plan.expert_slots >= args.n_activated_experts
    assert plan.gpu_used_bytes + plan.activation_free_bytes == plan.budget_bytes
    assert plan.margin_bytes == PLATFORM_MARGIN_BYTES["wsl2"]
    assert fits(plan) and plan.chunk.binding == "memory" and plan.chunk.effective_tokens >= 2048
    assert plan.max_model_len == plan.kv_tokens <= args.max_position_embeddings
    assert any("larger than host memory" in x for x in plan.warnings)  # 137 GiB of experts, 128 GiB RAM


def test_32gb_wsl2_honours_an_explicit_4096_chunk(real):
    args, w = real
    plan = plan_memory(args, w, Machine(32 * GIB, 128 * GIB, "wsl2"), settings(args, max_prefill_length=4096))
    assert (plan.chunk.requested, plan.chunk.effective_tokens, plan.chunk.binding) == (4096, 4096, "user-cap")
    assert plan.chunk.warning is None and fits(plan)


def test_host_memory_holds_the_bank_minus_a_margin_and_the_pin_budget_is_shown(real):
    args, w = real
    wsl = plan_memory(args, w, Machine(32 * GIB, 128 * GIB, "wsl2"), settings(args)).host
    layer = w.routed_expert_bytes // args.n_layers  # the staging area a bank beyond the pin budget keeps (bank.py)
    assert wsl.bank_bytes == w.routed_expert_bytes and wsl.ram_bytes == 128 * GIB - HOST_MARGIN_BYTES - layer
    assert wsl.disk_bytes == w.routed_expert_bytes - wsl.ram_bytes > 0
    assert wsl.pin_estimate_bytes == 64 * GIB - layer  # users.md: WSL2 pins about half of RAM
    big = plan_memory(args, w, Machine(32 * GIB, 256 * GIB, "native"), settings(args))
    assert (big.host.ram_bytes, big.host.disk_bytes) == (w.routed_expert_bytes, 0)
    assert big.host.pin_estimate_bytes == w.routed_expert_bytes and not big.warnings
    assert plan_memory(args, w, Machine(32 * GIB, None, "native"), settings(args)).host.ram_bytes is None


def test_a_small_card_shrinks_the_expert_cache_but_keeps_a_window_page_of_prefill(real):
    args, w = real
    plan = plan_memory(args, w, Machine(16 * GIB, None, "wsl2"), settings(args))
    assert plan.expert_slots == args.n_activated_experts and fits(plan)
    assert plan.chunk.effective_tokens >= args.window_size
    assert any("shrank to their floors" in d for d in plan.decisions)


def test_h200_cannot_hold_every_expert_but_keeps_most(real):
    """One H200 (141 GB) is smaller than the 145 GiB of main-model weights: the arithmetic, not a choice."""
    args, w = real
    plan = plan_memory(args, w, Machine(141 * GIB, None, "native"), settings(args))
    assert w.non_expert_bytes + w.routed_expert_bytes > 141 * GIB
    assert not plan.experts_resident and plan.expert_slots > 0.75 * w.n_experts
    assert fits(plan)


def test_a_192gb_card_keeps_every_weight_resident_and_gives_kv_the_rest(real):
    args, w = real
    plan = plan_memory(args, w, Machine(192 * GB, None, "native"), settings(args))
    assert plan.experts_resident and plan.expert_slots == w.n_experts and plan.host_expert_bytes == 0
    assert plan.kv_tokens >= 262144 and fits(plan) and plan.chunk.effective_tokens >= 8192


@pytest.mark.parametrize("gpu", [24 * GIB, 32 * GIB, 48 * GIB, 80 * GIB, 141 * GIB])
@pytest.mark.parametrize("platform", ["native", "wsl2"])
def test_every_auto_plan_fits(real, gpu, platform):
    args, w = real
    plan = plan_memory(args, w, Machine(gpu, None, platform), settings(args))
    assert fits(plan) and plan.chunk.warning is None
    assert plan.chunk.effective_tokens % plan.geometry.alignment_tokens == 0


def test_tiny_is_all_resident_on_any_card(tiny_dir):
    args = read_model_args(tiny_dir)
    w = weight_bytes(checkpoint_schema(args), args)
    plan = plan_memory(args, w, Machine(8 * GIB, None, "native"), settings(args))
    assert plan.experts_resident and fits(plan) and plan.chunk.alignment_tokens == 16


# ---------------------------------------------------------------------------- the seed bug, whole card


def test_more_kv_never_means_a_bigger_chunk(real):
    args, w = real
    chunks = []
    for tokens in (65536, 262144, 524288, 1048576):
        plan = plan_memory(
            args, w, Machine(32 * GIB, None, "wsl2"), settings(args, num_tokens=tokens, moe_cache_size=64)
        )
        assert fits(plan) and plan.kv_tokens == tokens
        chunks.append(plan.chunk.effective_tokens)
    assert chunks == sorted(chunks, reverse=True) and chunks[0] > chunks[-1]


# ------------------------------------------------------------------------------ explicit user values


def test_explicit_cap_is_reserved_by_shrinking_the_expert_cache(real):
    args, w = real
    auto = plan_memory(args, w, Machine(32 * GIB, None, "wsl2"), settings(args))
    big = plan_memory(args, w, Machine(32 * GIB, None, "wsl2"), settings(args, max_prefill_length=12000))
    assert big.chunk.effective_tokens == 12000 and big.chunk.warning is None and fits(big)
    assert big.expert_slots < auto.expert_slots
    assert any("reserved before the expert cache" in d for d in big.decisions)


def test_explicit_cap_that_cannot_be_reserved_is_honoured_with_a_warning(real):
    args, w = real
    plan = plan_memory(args, w, Machine(32 * GIB, None, "wsl2"), settings(args, max_prefill_length=16384))
    assert plan.chunk.effective_tokens == 16384 and "--max-prefill-length 16384" in plan.chunk.warning
    assert plan.chunk.warning in plan.warnings


def test_explicit_cap_beyond_the_card_is_refused(real):
    args, w = real
    with pytest.raises(ConfigError, match=r"--max-prefill-length 65536: .* use at most \d+"):
        plan_memory(args, w, Machine(32 * GIB, None, "wsl2"), settings(args, max_prefill_length=65536))


def test_explicit_values_are_honoured_or_refused_by_name(real):
    args, w = real
    plan = plan_memory(
        args,
        w,
        Machine(32 * GIB, None, "native"),
        settings(args, num_tokens=100_000, moe_cache_size=300, max_model_len=90_000),
    )
    assert (plan.kv_tokens, plan.expert_slots, plan.max_model_len) == (100_000, 300, 90_000)
    with pytest.raises(ConfigError, match="--moe-cache-size 2000"):
        plan_memory(args, w, Machine(32 * GIB, None, "native"), settings(args, moe_cache_size=2000))
    with pytest.raises(ConfigError, match="--num-tokens 4000000"):
        plan_memory(args, w, Machine(32 * GIB, None, "native"), settings(args, num_tokens=4_000_000))
    with pytest.raises(ConfigError, match="--max-model-len 200000 needs .* --num-tokens 100000"):
        plan_memory(
            args, w, Machine(32 * GIB, None, "native"), settings(args, num_tokens=100_000, max_model_len=200_000)
        )
    with pytest.raises(ConfigError, match="--memory-ratio 0.2"):
        plan_memory(args, w, Machine(32 * GIB, None, "native"), settings(args, memory_ratio=0.2))


# ------------------------------------------------------------------------------------ the CLI


def _run(args):
    exe = shutil.which("dsv4serve") or pytest.fail("dsv4serve is not on PATH")
    return subprocess.run([exe, *args], capture_output=True, text=True, env=dict(os.environ), timeout=120)


def test_plan_cli_prints_and_emits_the_memory_plan(real_model_dir):
    base = [
        "plan",
        "--model",
        str(real_model_dir),
        "--gpu-memory",
        "32GiB",
        "--host-memory",
        "128GiB",
        "--platform",
        "wsl2",
    ]
    out = _run(base + ["--max-prefill-length", "4096", "--json"])
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    c = data["prefill_chunk"]
    assert (c["requested"], c["source"], c["effective"], c["binding"]) == (4096, "cli", 4096, "user-cap")
    mp = data["memory_plan"]
    assert mp["chunk"]["effective"] == 4096 and not mp["experts"]["all_resident"]
    layer = 147_169_738_752 // 43  # the bank's staging area: one of its 43 layers, pinned (experts/bank.py)
    assert mp["experts"]["host_memory"]["pin_estimate_bytes"] == 64 * GIB - layer
    # the resident weights are what the CUDA worker loads (packed FP8 + the tensors it keeps in fp32)
    from dsv4serve.memory.weights import device_bytes
    from dsv4serve.model.backends import KernelBackends

    args = read_model_args(real_model_dir)
    loaded = device_bytes(checkpoint_schema(args), args, KernelBackends.every("triton"), True, experts_resident=False)
    assert mp["resident_weight_bytes"] == loaded.non_expert_bytes
    # --kernels is honoured: the head on torch is held in fp32, 0.99 GiB more, fewer expert slots
    head_torch = json.loads(_run(base + ["--kernels", "head=torch", "--json"]).stdout)["memory_plan"]
    assert head_torch["resident_weight_bytes"] - loaded.non_expert_bytes == args.vocab_size * args.dim * 2
    assert head_torch["experts"]["slots"] < mp["experts"]["slots"]
    text = _run(base)
    assert text.returncode == 0 and "memory plan (32.00 GiB GPU, wsl2)" in text.stdout
    assert "bound by memory" in text.stdout and "expert slots" in text.stdout
    assert "on disk (mmap); about 60.81 GiB of it pinned" in text.stdout  # 64 GiB less a 3.19 GiB staging area
    bad = _run(base + ["--max-prefill-length", "65536"])
    assert bad.returncode == 2 and "--max-prefill-length 65536" in bad.stderr and "Traceback" not in bad.stderr


# ------------------------------------------------------------------------------- decode graphs


def test_decode_graphs_are_reserved_before_the_kv_and_eager_frees_them(real):
    args, w = real
    machine = Machine(int(139 * GIB), None, "native")
    graphs = plan_memory(args, w, machine, settings(args, max_model_len=65536))
    eager = plan_memory(args, w, machine, settings(args, max_model_len=65536, enforce_eager=True))
    # one forward of the largest bucket (32 rows): the per-token working set x safety per row + the fixed bytes
    geometry = prefill_geometry(args, 65536, 32)
    expected = 32 * math.ceil(geometry.activation_bytes_per_token * GEOMETRY_SAFETY_FACTOR) + geometry.fixed_bytes
    assert graphs.decode_graph_bytes == decode_graph_bytes(args, 32, 65536) == expected
    assert 10 * MIB < expected < 1 * GIB
    assert eager.decode_graph_bytes == 0 and any("none (--enforce-eager)" in d for d in eager.decisions)
    assert any(d.startswith("decode graphs:") and "32 rows" in d for d in graphs.decisions)
    assert graphs.to_json()["decode_graph_bytes"] == expected
    # what the graphs hold comes out of what the rest of the plan may use, never on top of the budget
    assert graphs.gpu_used_bytes <= graphs.budget_bytes - graphs.margin_bytes
    assert graphs.expert_slots * graphs.expert_slot_bytes + graphs.kv_cache_bytes < (
        eager.expert_slots * eager.expert_slot_bytes + eager.kv_cache_bytes
    )


def test_speculative_verify_graphs_grow_the_graph_reserve(real):
    """--speculative-tokens N: the largest captured forward is the verify step of 32 rows x (N + 1) tokens, and
    every verify bucket (rows 1, 2, 4, .., 32 x n = 1..N) and MTP chain bucket keeps its logits (fp32) and
    streams ([hc, D] bf16) alive: counted from the buckets by hand here."""
    args, w = real
    machine = Machine(int(139 * GIB), None, "native")
    n, rows = 3, [1, 2, 4, 8, 16, 32]
    geometry = prefill_geometry(args, 65536, 32 * (n + 1))
    working = 32 * (n + 1) * math.ceil(geometry.activation_bytes_per_token * GEOMETRY_SAFETY_FACTOR)
    kept_tokens = sum(r * (k + 1) for r in rows for k in (1, 2, 3)) + sum(rows)  # verify buckets, chain buckets
    expected = working + geometry.fixed_bytes + kept_tokens * (args.vocab_size * 4 + args.hc_mult * args.dim * 2)
    assert decode_graph_bytes(args, 32, 65536, n) == expected > decode_graph_bytes(args, 32, 65536)
    assert decode_graph_bytes(args, 32, 65536, 0) == decode_graph_bytes(args, 32, 65536)
    assert 100 * MIB < expected < 2 * GIB  # ~ 0.5 GiB: what a verify bucket pool costs on the real model
    spec = plan_memory(args, w, machine, dataclasses.replace(settings(args, max_model_len=65536), speculative_tokens=n))
    plain = plan_memory(args, w, machine, settings(args, max_model_len=65536))
    assert spec.decode_graph_bytes == expected
    # the larger reserve comes out of what the cache of experts and the KV may use
    assert spec.expert_slots * spec.expert_slot_bytes + spec.kv_cache_bytes < (
        plain.expert_slots * plain.expert_slot_bytes + plain.kv_cache_bytes
    )
    assert any("verify steps of up to 3 drafts" in d for d in spec.decisions)


def test_hybrid_cpu_experts_capture_decode_graphs_but_no_speculative_ones(real):
    """Hybrid decode steps replay graphs (the CPU split fixed between steps); its speculative verify steps sync."""
    args, w = real
    machine = Machine(32 * GIB, 384 * GIB, "native")  # room for kt-kernel's copy and the whole bank, pinned
    base = settings(args, max_model_len=65536)
    offload = plan_memory(args, w, machine, base)
    hybrid = plan_memory(args, w, machine, dataclasses.replace(base, cpu_experts=True))
    assert offload.decode_graph_bytes > 0 and hybrid.decode_graph_bytes == offload.decode_graph_bytes
    spec = plan_memory(args, w, machine, dataclasses.replace(base, cpu_experts=True, speculative_tokens=2))
    assert spec.decode_graph_bytes == 0 and any("none after all (hybrid" in d for d in spec.decisions)


def test_a_bank_beyond_the_pin_budget_cuts_its_decode_graphs(real):
    """Layers outside the pinned tier are staged by the host mid-step, between segments of the decode graphs
    (experts/graph_cuts.py): 137 GiB of experts on 128 GiB of RAM (17 GiB stay on disk), or on WSL2, which pins
    about half of RAM. The graphs' memory is planned as for a pinned bank (the same forward, in segments)."""
    args, w = real
    plans = {
        (host, platform): plan_memory(args, w, Machine(32 * GIB, host * GIB, platform), settings(args))
        for host, platform in ((192, "native"), (128, "native"), (256, "wsl2"))
    }
    assert plans[192, "native"].decode_graph_bytes > 0
    for key in ((128, "native"), (256, "wsl2")):
        p = plans[key]
        assert p.host is not None and p.host.pin_estimate_bytes < p.host.bank_bytes, key
        assert p.decode_graph_bytes == plans[192, "native"].decode_graph_bytes > 0, key
        assert any(d.startswith("decode graphs: cut at about") for d in p.decisions), key
