"""`dsv4serve plan` without --gpu-memory plans for the machine it runs on (issue #17.5): on this CPU-only
machine, the CPU and the RAM /proc/meminfo reports; the prefill chunk and its binding limit are printed."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from dsv4serve.cli import build_parser
from dsv4serve.config import options
from dsv4serve.env import read_environment
from dsv4serve.memory.decode_speed import MEASURED_KERNEL_EFFICIENCY
from dsv4serve.plan_cli import build_plan, run_plan
from dsv4serve.units import gib


def _mem_total_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def _ns(tiny_cache: Path, *extra: str):
    env = read_environment({"DSV4SERVE_CACHE_DIR": str(tiny_cache)}, tuple(options()))
    return build_parser("plan").parse_args(["--model", "dsv4-tiny", *extra]), env


def test_plan_without_gpu_memory_is_for_the_cpu_and_its_measured_ram(tiny_cache):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the plan is for GPU 0")
    ns, env = _ns(tiny_cache)
    plan = build_plan(ns, env)
    machine, chunk = plan["machine"], plan["prefill_chunk"]
    assert machine["device"] == "cpu" and machine["gpu_memory_bytes"] == _mem_total_bytes()
    assert machine["plan_for"].startswith("the CPU") and gib(_mem_total_bytes()) in machine["plan_for"]
    assert chunk["effective"] > 0 and chunk["binding"] and chunk["reason"]
    assert plan["decode_speed"] is None  # the projection models a GPU beside its host
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run_plan(ns, env) == 0
    text = out.getvalue()
    assert "plan for the CPU" in text and "host RAM, CPU" in text
    assert "projected decode speed: none for the CPU worker" in text
    assert (
        f"prefill chunk: requested auto, effective {chunk['effective']:,} tokens, bound by {chunk['binding']}" in text
    )


def test_an_explicit_gpu_memory_still_plans_for_that_gpu(tiny_cache):
    ns, env = _ns(tiny_cache, "--gpu-memory", "24GiB")
    plan = build_plan(ns, env)
    assert plan["machine"]["device"] == "cuda" and plan["machine"]["gpu_memory_bytes"] == 24 * 2**30
    assert "--gpu-memory" in plan["machine"]["plan_for"] and plan["prefill_chunk"]["binding"]


# ------------------------------------------------------------------ projected batch-1 decode speed


def _run_text(ns, env) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run_plan(ns, env) == 0
    return out.getvalue()


def test_a_32gb_plan_projects_decode_term_by_term_with_the_given_bandwidths(real_model_dir, tmp_path):
    env = read_environment({"DSV4SERVE_CACHE_DIR": str(tmp_path)}, tuple(options()))
    # host RAM for kt-kernel's copy (1.3x) and the bank, all pinned: one class of layers, read in place
    flags = ["--gpu-memory", "32GiB", "--host-memory", "384GiB", "--h2d-bandwidth", "25", "--host-bandwidth", "60"]
    ns = build_parser("plan").parse_args(["--model", str(real_model_dir), *flags])
    plan = build_plan(ns, env)
    d, experts = plan["decode_speed"], plan["memory_plan"]["experts"]
    assert d["bandwidths"]["h2d_gbps"] == {"value": 25.0, "source": "--h2d-bandwidth"}
    assert d["bandwidths"]["host_gbps"] == {"value": 60.0, "source": "--host-bandwidth"}
    assert d["bandwidths"]["gpu_gbps"]["source"].startswith("assumed: RTX 5090")  # not given: a stated assumption
    assert set(d["projections"]) == {"offload", "hybrid"} and d["expert_slots"] == experts["slots"]
    offload, hybrid = d["projections"]["offload"], d["projections"]["hybrid"]
    # by hand from the plan's own slots: 258 uses, hits = 258 x slots / 11008, each miss one slot's bytes
    misses = 258 * (1 - experts["slots"] / experts["total"])
    assert offload["parallel_ms"]["PCIe copies"] == pytest.approx(misses * experts["slot_bytes"] / 25e9 * 1e3, 1e-4)
    # hybrid: CPU 60 GB/s x 0.5 beside PCIe 25 GB/s, the two lanes balanced: 30/55 of the misses on the CPU
    assert hybrid["cpu_fraction_of_misses"] == pytest.approx(30 / 55, abs=1e-4)
    for p in (offload, hybrid):
        serial = sum(p["serial_ms"].values())
        assert p["step_ms"] == pytest.approx(serial + max(p["parallel_ms"].values()), abs=1e-2)
        assert p["tokens_per_second"] == pytest.approx(1e3 / p["step_ms"], abs=0.01)
    assert offload["tokens_per_second"] < hybrid["tokens_per_second"]
    # the bank all pinned: both replay graphs (hybrid with its CPU split fixed between steps)
    for p in (offload, hybrid):
        assert p["serial_ms"]["kernel launches"] == pytest.approx(1144 * 1e-3)
    assert d["eager"] == {} and d["faster"] == "hybrid"

    ns_json = build_parser("plan").parse_args(["--model", str(real_model_dir), *flags, "--json"])
    emitted = json.loads(_run_text(ns_json, env))
    assert emitted["decode_speed"] == d and "decode_speed_text" not in emitted
    text = _run_text(ns, env)
    assert "projected batch-1 decode" in text and "host-to-device 25 GB/s (--h2d-bandwidth)" in text
    tokens_row = next(ln for ln in text.splitlines() if ln.startswith("tokens/s "))
    shown = [float(v) for v in tokens_row.split()[1:]]  # one decimal of the value the JSON gives to two
    assert shown == [pytest.approx(p["tokens_per_second"], abs=0.051) for p in (offload, hybrid)]
    for term in ("dense weights", "KV cache", "kernel launches", "CPU handoffs", "PCIe copies", "CPU experts"):
        assert any(ln.startswith(term) for ln in text.splitlines()), term
    today = d["with_todays_kernels"]  # the same step with the decode kernels as fast as the H200 measured them
    assert today["kernel_efficiency"] == MEASURED_KERNEL_EFFICIENCY and "H200" in today["source"]
    assert today["tokens_per_second"]["hybrid"] < hybrid["tokens_per_second"]
    assert f"hybrid {today['tokens_per_second']['hybrid']:.1f} tokens/s" in text
    assert "--moe-backend auto with kt-kernel installed runs hybrid on a CUDA worker" in text
    # a cold prefill's expert transfers: each chunk streams the experts in no slot once at the given 25 GB/s
    cold, chunk = d["cold_prefill"], plan["prefill_chunk"]["effective"]
    streamed = (11008 - experts["slots"]) * experts["slot_bytes"]
    assert cold["chunk_tokens"] == chunk and cold["streamed_bytes_per_chunk"] == pytest.approx(streamed, abs=1)
    assert cold["streamed_tokens_per_second"] == pytest.approx(chunk / (streamed / 25e9), abs=0.1)
    assert cold["in_place_tokens_per_second"] < cold["streamed_tokens_per_second"]
    assert f"{chunk:,}-token chunks stream" in text and "(--h2d-bandwidth)" in text.split("projected cold prefill")[1]
    assert plan["memory_plan"]["experts"]["prefill_stream_bytes"] == 32 * experts["slot_bytes"]
    # a measured hit rate (the server's expert_cache_hits_total / expert_cache_queries_total) replaces uniform's
    ns_hits = build_parser("plan").parse_args(["--model", str(real_model_dir), *flags, "--expert-hit-rate", "0.5"])
    hits = build_plan(ns_hits, env)["decode_speed"]
    assert hits["expert_hit_rate"] == {"value": 0.5, "source": "--expert-hit-rate"} and d["expert_hit_rate"] is None
    for p in hits["projections"].values():
        assert p["hits_per_token"] == pytest.approx(129) and p["misses_per_token"] == pytest.approx(129)
    assert hits["projections"]["hybrid"]["tokens_per_second"] > hybrid["tokens_per_second"]


def test_a_card_that_holds_every_expert_projects_the_gpu_backend_only(tiny_cache):
    ns, env = _ns(tiny_cache, "--gpu-memory", "24GiB")
    plan = build_plan(ns, env)
    d = plan["decode_speed"]
    assert set(d["projections"]) == {"gpu"} and d["projections"]["gpu"]["misses_per_token"] == 0
    assert d["cold_prefill"] is None and plan["memory_plan"]["experts"]["prefill_stream_bytes"] == 0


def test_a_bandwidth_must_be_a_positive_number(capsys):
    with pytest.raises(SystemExit):
        build_parser("plan").parse_args(["--model", "dsv4-tiny", "--h2d-bandwidth", "0"])
    assert "not a positive number" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser("plan").parse_args(["--model", "dsv4-tiny", "--expert-hit-rate", "1.5"])
    assert "not a fraction" in capsys.readouterr().err


# ------------------------------------------------------------------ --gpus N: a plan per tensor-parallel rank


def _real(real_model_dir, tmp_path, *extra: str):
    env = read_environment({"DSV4SERVE_CACHE_DIR": str(tmp_path)}, tuple(options()))
    return build_parser("plan").parse_args(["--model", str(real_model_dir), "--gpu-memory", "139GiB", *extra]), env


def test_two_h200_hold_every_expert_one_holds_a_slot_cache(real_model_dir, tmp_path):
    """Issue 21: DeepSeek-V4-Flash on 1 x H200 streams experts; on 2 x H200 each rank holds its 128 experts of
    every layer (43 x 128 of 12.75 MiB each: w1, w3 [2048, 4096] and w2 [4096, 2048] MXFP4 with scales)."""
    one = build_plan(*_real(real_model_dir, tmp_path))["memory_plan"]["experts"]
    assert not one["all_resident"] and one["slots"] < one["total"] == 43 * 256
    plan = build_plan(*_real(real_model_dir, tmp_path, "--gpus", "2"))
    ranks = plan["parallel"]["ranks"]
    assert plan["parallel"]["gpus"] == 2 and plan["parallel"]["expert_parallel"] and len(ranks) == 2
    expert_bytes = 3 * (2048 * 2048 + 2048 * 128)
    for r in ranks:
        e = r["memory_plan"]["experts"]
        assert e["all_resident"] and e["total"] == e["slots"] == 43 * 128 and e["slot_bytes"] == expert_bytes
        assert e["gpu_bytes"] == 43 * 128 * expert_bytes
    # each rank reads half the experts, half the embed and head, and the replicated parts whole
    assert sum(r["checkpoint_read_bytes"] for r in ranks) > 159_609_485_896
    assert all(r["checkpoint_read_bytes"] < 0.5 * 159_609_485_896 * 1.02 for r in ranks)
    assert plan["decode_speed"] is None
    text = _run_text(*_real(real_model_dir, tmp_path, "--gpus", "2"))
    rows = [ln for ln in text.splitlines() if ln.startswith(("0 ", "1 "))]
    assert len(rows) == 2 and all("all 5,504 resident" in ln for ln in rows)
    assert "experts expert-parallel: rank r owns experts [128r, 128(r+1))" in text
    emitted = json.loads(_run_text(*_real(real_model_dir, tmp_path, "--gpus", "2", "--json")))
    assert emitted["parallel"]["ranks"][1]["memory_plan"]["experts"]["all_resident"]


def test_a_gpu_count_the_model_cannot_split_is_refused_naming_why(real_model_dir, tmp_path):
    from dsv4serve.config import ConfigError

    with pytest.raises(ConfigError, match=r"--gpus 3: .*wo_a has 8 output groups"):
        build_plan(*_real(real_model_dir, tmp_path, "--gpus", "3"))
    with pytest.raises(SystemExit):
        build_parser("plan").parse_args(["--model", "dsv4-tiny", "--gpus", "0"])


def test_a_hybrid_plan_gives_kt_kernel_the_layers_the_projection_prefers(real_model_dir, tmp_path):
    """On 192 GiB kt-kernel's copy of every layer (1.3x) would leave the bank 98% on disk; the plan holds the count
    decode_choice.best_kt_layers projects fastest (13 of 43 here, beside a bank 93% pinned), says so in the memory
    plan, and projects hybrid past offload (offload 14.3; all 43 layers gave 12.0)."""
    env = read_environment({"DSV4SERVE_CACHE_DIR": str(tmp_path)}, tuple(options()))
    flags = ["--gpu-memory", "32GiB", "--host-memory", "192GiB", "--moe-backend", "hybrid"]
    ns = build_parser("plan").parse_args(["--model", str(real_model_dir), *flags])
    plan = build_plan(ns, env)
    tiers, speed = plan["decode_speed"]["bank_tiers"]["hybrid"], plan["decode_speed"]["projections"]
    k = round(tiers["cpu_layers"] * 43)
    assert 1 <= k < 43 and tiers["pinned"] > 0.9
    assert speed["hybrid"]["tokens_per_second"] > speed["offload"]["tokens_per_second"]
    decision = next(d for d in plan["memory_plan"]["decisions"] if d.startswith("hybrid experts:"))
    assert f"kt-kernel's copy of the first {k} of 43 MoE layers" in decision
    ram_gib = float(decision.split("then ")[1].split(" GiB of the bank")[0])
    assert ram_gib == pytest.approx(tiers["pinned"] * 137.06, abs=0.05)  # the memory plan's bank is the projection's
    assert f"kt-kernel holds {100 * tiers['cpu_layers']:.0f}% of the layers" in _run_text(ns, env)
