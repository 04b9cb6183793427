"""The prefill chunk planner: pure, honours an explicit cap, never grows with the KV pool (the seed bug)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4serve.config import ConfigError, Setting, Source
from dsv4serve.memory.chunk_planner import (
    GEOMETRY_SAFETY_FACTOR,
    PLATFORM_MARGIN_BYTES,
    MemorySnapshot,
    PlannerLimits,
    PrefillGeometry,
    alignment_tokens,
    plan_chunk,
    prefill_geometry,
    shrink_after_oom,
)
from dsv4serve.memory.probe import SimulatedBudget, detect_platform, measure_activation_bytes, take_snapshot
from dsv4serve.model.args import read_model_args

PACKAGE = Path(__file__).resolve().parents[2] / "dsv4serve"
MIB, GIB = 1024**2, 1024**3
UNIT = 128
PER_TOKEN = 1000  # measured bytes per token in these tests: no safety factor applies to a measurement
AUTO = Setting(None, Source.DEFAULT)
GEO = PrefillGeometry(activation_bytes_per_token=800, fixed_bytes=0, alignment_tokens=UNIT)


def snap(room_tokens: int, platform="native", measured=PER_TOKEN, total=80 * GIB) -> MemorySnapshot:
    """Free memory that holds exactly `room_tokens` tokens of activations above the platform margin."""
    return MemorySnapshot(PLATFORM_MARGIN_BYTES[platform] + room_tokens * PER_TOKEN, total, platform, measured)


def limits(cap=AUTO, kv=10**9, model_len=10**9) -> PlannerLimits:
    return PlannerLimits(cap, kv, model_len)


def cli(n: int) -> Setting:
    return Setting(n, Source.CLI)


# ------------------------------------------------------------------------------------- purity


def test_same_inputs_same_plan():
    a = plan_chunk(snap(1000), GEO, limits())
    b = plan_chunk(snap(1000), GEO, limits())
    assert a == b


def test_only_the_probe_asks_the_device():
    users = sorted(
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if "mem_get_info" in p.read_text(encoding="utf-8")
    )
    assert users == ["memory/probe.py"]
    for pure in ("memory/chunk_planner.py", "memory/plan.py"):
        text = (PACKAGE / pure).read_text(encoding="utf-8")
        assert "import torch" not in text and "torch.cuda" not in text, pure


# ------------------------------------------------------------------------------------- auto rules


def test_auto_is_the_largest_aligned_chunk_that_fits():
    plan = plan_chunk(snap(1000), GEO, limits())
    assert (plan.effective_tokens, plan.binding, plan.warning) == (896, "memory", None)  # 1000 -> 7 x 128
    assert plan.requested is None and "free" in plan.reason


def test_geometry_estimate_gets_the_safety_factor_and_a_measurement_replaces_it():
    s = snap(1000, measured=None)
    plan = plan_chunk(s, GEO, limits())
    assert plan.activation_bytes_per_token == int(800 * GEOMETRY_SAFETY_FACTOR)
    assert plan.effective_tokens == (1000 * PER_TOKEN // plan.activation_bytes_per_token) // UNIT * UNIT


def test_fixed_bytes_come_off_the_top():
    geo = PrefillGeometry(800, fixed_bytes=300 * PER_TOKEN, alignment_tokens=UNIT)
    assert plan_chunk(snap(1000), geo, limits()).effective_tokens == 640  # 700 tokens -> 5 x 128


def test_wsl2_keeps_a_larger_margin():
    free = PLATFORM_MARGIN_BYTES["wsl2"] + 1000 * PER_TOKEN
    native = plan_chunk(MemorySnapshot(free, 32 * GIB, "native", PER_TOKEN), GEO, limits())
    wsl2 = plan_chunk(MemorySnapshot(free, 32 * GIB, "wsl2", PER_TOKEN), GEO, limits())
    assert wsl2.effective_tokens == 896 < native.effective_tokens
    assert PLATFORM_MARGIN_BYTES["wsl2"] >= 2 * GIB  # users.md: WSL2 refuses residency with ~2 GB "free"


def test_below_one_unit_binds_alignment_and_warns():
    plan = plan_chunk(snap(50), GEO, limits())
    assert (plan.effective_tokens, plan.binding) == (UNIT, "alignment")
    assert plan.warning and "out of memory" in plan.warning


def test_kv_pool_and_model_len_bind_when_smaller():
    assert plan_chunk(snap(1000), GEO, limits(kv=500)).binding == "kv-pool"
    assert plan_chunk(snap(1000), GEO, limits(kv=500)).effective_tokens == 500
    plan = plan_chunk(snap(1000), GEO, limits(kv=10_000, model_len=300))
    assert (plan.effective_tokens, plan.binding, plan.warning) == (300, "model-len", None)


def test_the_chunk_never_grows_with_the_kv_pool_beyond_memory():
    """The seed bug: a chunk cap derived from KV-pool geometry grew with --num-tokens until it OOMed."""
    memory_bound = plan_chunk(snap(13_000), GEO, limits()).effective_tokens
    chunks = [
        plan_chunk(snap(13_000), GEO, limits(kv=kv)).effective_tokens
        for kv in (1_000, 8_192, 65_536, 262_144, 1_048_576, 10**8)
    ]
    assert chunks == sorted(chunks) and max(chunks) == memory_bound
    assert all(c * PER_TOKEN + PLATFORM_MARGIN_BYTES["native"] <= snap(13_000).free_bytes for c in chunks)


# ------------------------------------------------------------------------------- explicit cap


def test_explicit_cap_below_safe_binds_as_user_cap():
    plan = plan_chunk(snap(1000), GEO, limits(cli(300)))
    assert (plan.requested, plan.effective_tokens, plan.binding, plan.warning) == (300, 300, "user-cap", None)
    assert "--max-prefill-length 300" in plan.reason


def test_explicit_cap_above_safe_is_honoured_loudly():
    plan = plan_chunk(snap(1000), GEO, limits(cli(5000)))
    assert (plan.effective_tokens, plan.binding, plan.safe_tokens) == (5000, "user-cap", 896)
    assert "--max-prefill-length 5000" in plan.warning and "896" in plan.warning


def test_explicit_cap_from_the_environment_names_the_variable():
    plan = plan_chunk(snap(1000), GEO, limits(Setting(5000, Source.ENV)))
    assert plan.effective_tokens == 5000 and "DSV4SERVE_MAX_PREFILL_LENGTH 5000" in plan.warning


def test_explicit_cap_that_no_card_of_this_size_can_run_is_refused():
    with pytest.raises(ConfigError) as err:
        plan_chunk(snap(1000, total=1 * GIB), GEO, limits(cli(2_000_000)))
    msg = str(err.value)
    assert "--max-prefill-length 2000000" in msg and "use at most" in msg and "never run" in msg


def test_explicit_cap_above_model_len_is_kept_and_explained():
    plan = plan_chunk(snap(1000), GEO, limits(cli(256), model_len=200))
    assert (plan.effective_tokens, plan.binding) == (256, "user-cap") and "never binds" in plan.reason


def test_an_unaligned_cap_is_kept_exactly():
    assert plan_chunk(snap(1000), GEO, limits(cli(777))).effective_tokens == 777


# ----------------------------------------------------------------------------------- OOM learning


def test_shrink_after_oom_lowers_the_ceiling():
    plan = plan_chunk(snap(13_000), GEO, limits())
    lowered = shrink_after_oom(plan, plan.effective_tokens)
    assert lowered.effective_tokens == plan.effective_tokens // 2 // UNIT * UNIT
    assert lowered.binding == "memory" and "out of memory" in lowered.reason
    seen, cur = [], lowered
    for _ in range(20):
        nxt = shrink_after_oom(cur, cur.effective_tokens)
        seen.append(nxt.effective_tokens)
        cur = nxt
    assert seen[-1] == 1 and all(b < a for a, b in zip([lowered.effective_tokens] + seen, seen) if a > 1)


def test_shrink_after_oom_below_a_user_cap_still_honours_it_as_a_ceiling():
    plan = plan_chunk(snap(1000), GEO, limits(cli(4096)))
    lowered = shrink_after_oom(plan, 4096)
    assert lowered.effective_tokens == 2048 and lowered.requested == 4096


# ------------------------------------------------------------------------------------ geometry


def test_alignment_is_one_window_page(real_model_dir, tiny_dir):
    assert alignment_tokens(read_model_args(real_model_dir)) == 128
    assert alignment_tokens(read_model_args(tiny_dir)) == 16  # window 16, HCA ratio 16, CSA 4


def test_geometry_terms_for_the_real_model(real_model_dir):
    args = read_model_args(real_model_dir)
    geo = prefill_geometry(args, context_tokens=65536, max_rows=1)
    terms = dict(geo.terms)
    assert terms["hc streams in [hc, D] fp32"] == 4 * 4096 * 4  # 4 streams of 4096 fp32
    assert terms["attention: attention scores [H, window+topk] fp32"] == 64 * (128 + 512) * 4
    assert geo.activation_bytes_per_token == sum(terms.values())
    # the indexer logits tile: one page of queries x context/4 entries fp32, plus two fp32 vocab rows
    assert geo.fixed_bytes == 128 * (65536 // 4) * 4 + 2 * 129280 * 4
    # an independent anchor: FreeToken's fused engine measured ~3 GB for a 13K chunk (~230 KB/token);
    # this estimate is for an unfused engine, so it must not be below that
    assert geo.activation_bytes_per_token > 230_000


# ------------------------------------------------------------------------------------ the probe


def test_probe_detects_wsl2(tmp_path):
    wsl = tmp_path / "wsl"
    wsl.write_text("Linux version 5.15.153.1-microsoft-standard-WSL2 (root@1) #1 SMP")
    native = tmp_path / "native"
    native.write_text("Linux version 6.8.0-45-generic (buildd@lcy02) #45-Ubuntu SMP")
    assert detect_platform(wsl) == "wsl2" and detect_platform(native) == "native"
    assert detect_platform(tmp_path / "missing") == "native"


def test_probe_on_cpu_uses_a_simulated_budget():
    s = take_snapshot("cpu", simulated=SimulatedBudget(3 * GIB, 32 * GIB, "wsl2", 250_000))
    assert (s.free_bytes, s.total_bytes, s.platform, s.origin) == (3 * GIB, 32 * GIB, "wsl2", "simulated")
    assert plan_chunk(s, GEO, limits()).activation_bytes_per_token == 250_000
    with pytest.raises(ValueError):
        take_snapshot("cpu")
    assert measure_activation_bytes(lambda n: None, 4096, device="cpu") is None


def test_dense_reference_attention_bounds_the_chunk_by_its_square():
    """The CPU path's attention materializes [T, H, T] scores: a big KV pool must not let a chunk
    through whose T^2 term alone exceeds memory (the seed bug, on the reference path)."""
    geo = PrefillGeometry(activation_bytes_per_token=800, fixed_bytes=0, alignment_tokens=UNIT, pairwise_bytes=50)
    room = 2 * 1024**3
    snap = MemorySnapshot(room + PLATFORM_MARGIN_BYTES["native"], 4 * 1024**3, "native", PER_TOKEN)
    plan = plan_chunk(snap, geo, PlannerLimits(AUTO, kv_pool_tokens=131072, max_model_len=131072))
    t = plan.effective_tokens
    assert plan.binding == "memory" and t % UNIT == 0
    assert 50 * t * t + PER_TOKEN * t <= room < 50 * (t + UNIT) ** 2 + PER_TOKEN * (t + UNIT)
    assert "tokens^2" in plan.reason
    linear_only = plan_chunk(snap, PrefillGeometry(800, 0, UNIT), PlannerLimits(AUTO, 131072, 131072))
    assert linear_only.effective_tokens > 10 * t  # what a linear model would have allowed
    with pytest.raises(ConfigError, match="--max-prefill-length 100000"):
        plan_chunk(snap, geo, PlannerLimits(Setting(100000, Source.CLI), 131072, 131072))
