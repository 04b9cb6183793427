"""The command line as users run it: a real `dsv4serve` process."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

CONTRACT_FLAGS = [
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--device",
    "--max-model-len",
    "--max-num-seqs",
    "--max-queued-requests",
    "--max-prefill-length",
    "--memory-ratio",
    "--moe-cache-size",
    "--num-tokens",
    "--api-key",
    "--default-thinking",
]
REAL_BYTES = 159_609_485_896


def run(args, env=None, **kwargs):
    full_env = {**os.environ, **(env or {})}
    exe = shutil.which("dsv4serve") or pytest.fail("dsv4serve is not on PATH: install the package first")
    return subprocess.run([exe, *args], capture_output=True, text=True, env=full_env, timeout=120, **kwargs)


def test_help_shows_the_contract_flags():
    out = run(["--help"])
    assert out.returncode == 0
    for flag in CONTRACT_FLAGS:
        assert flag in out.stdout, flag
    assert "plan" in out.stdout and "doctor" in out.stdout
    plan = run(["plan", "--help"])
    for flag in CONTRACT_FLAGS + ["--gpu-memory", "--host-memory", "--platform", "--json"]:
        assert flag in plan.stdout, flag


def test_plan_on_the_real_config_honours_the_prefill_cap(real_model_dir):
    out = run(
        [
            "plan",
            "--model",
            str(real_model_dir),
            "--gpu-memory",
            "32GiB",
            "--host-memory",
            "128GiB",
            "--platform",
            "wsl2",
            "--max-prefill-length",
            "4096",
            "--json",
        ]
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["weights"]["total_bytes"] == REAL_BYTES
    assert plan["prefill_chunk"]["requested"] == 4096 and plan["prefill_chunk"]["source"] == "cli"
    assert plan["settings"]["max_prefill_length"] == {
        "value": 4096,
        "source": "cli",
        "note": plan["prefill_chunk"]["note"],
    }
    assert plan["machine"]["gpu_memory_bytes"] == 32 * 1024**3


def test_plan_text_report(real_model_dir):
    out = run(["plan", "--model", str(real_model_dir)])
    assert out.returncode == 0, out.stderr
    assert "routed_experts" in out.stdout and "159,609,485,896" in out.stdout
    assert "--max-prefill-length" in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", "--model", "/no/such/folder"], "not a folder, not a Hugging Face repo id"),
        (["plan", "--model", "dsv4-tiny", "--max-model-len", "99999999"], "--max-model-len 99999999 exceeds"),
        (["--model", "dsv4-tiny", "--device", "cuda"], "--device cuda: no CUDA device"),
        (["plan"], "--model is required"),
    ],
)
def test_errors_are_one_clear_line(args, message, tiny_cache):
    out = run(args, env={"DSV4SERVE_CACHE_DIR": str(tiny_cache)})
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def test_bad_flag_values_are_rejected_by_the_parser():
    out = run(["--model", "x", "--port", "0"])
    assert out.returncode == 2 and "--port" in out.stderr and "TCP port" in out.stderr


def test_serve_reports_serves_and_stops_cleanly_on_ctrl_c(tiny_cache, tmp_path):
    from tests.e2e.api_server import ServerProcess

    srv = ServerProcess(tiny_cache, tmp_path / "serve.log", "--max-prefill-length", "512", "--max-model-len", "1024")
    try:
        srv.wait_healthy()
    finally:
        code = srv.stop()
    log = srv.log()
    assert re.search(r"--max-prefill-length +512 ", log) and "checkpoint validated" in log
    assert "prefill chunk          requested 512, effective 512 tokens, bound by user-cap" in log
    assert code == 0 and "the worker was shut down" in log and "Traceback" not in log


def test_offline_hub_model_says_what_to_do(tmp_path):
    out = run(["plan", "--model", "DeepSeek-V4-Flash"], env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2
    assert "hf download deepseek-ai/DeepSeek-V4-Flash" in out.stderr and "--model DIR" in out.stderr


def test_hub_model_resolves_from_the_normal_hf_cache(tmp_path, real_model_dir):
    """A snapshot in the standard HF cache layout is found by huggingface_hub, with no network."""
    repo = tmp_path / "hf" / "hub" / "models--deepseek-ai--DeepSeek-V4-Flash"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    (snapshot / "inference").mkdir(parents=True)
    shutil.copy(real_model_dir / "config.json", snapshot / "config.json")
    shutil.copy(real_model_dir / "inference" / "config.json", snapshot / "inference" / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    out = run(
        ["plan", "--model", "DeepSeek-V4-Flash", "--json"], env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["model"]["path"] == str(snapshot)
    assert plan["settings"]["served_model_name"]["value"] == "DeepSeek-V4-Flash"
    assert plan["weights"]["total_bytes"] == REAL_BYTES


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "dsv4serve", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("dsv4serve ")
