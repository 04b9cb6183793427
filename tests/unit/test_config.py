"""Settings: one resolution pass, provenance on every value, explicit values always honoured."""

import dataclasses
import subprocess
from pathlib import Path

import pytest

from dsv4serve.cli import build_parser
from dsv4serve.config import ConfigError, ServeConfig, Source, options
from dsv4serve.env import read_environment
from dsv4serve.report import format_settings
from dsv4serve.resolve import MachineFacts, ModelFacts, resolve
from dsv4serve.resolve_cli import resolve_from_cli

FACTS = ModelFacts(name="DeepSeek-V4-Flash", max_position_embeddings=1_048_576)
CPU = MachineFacts(cuda_available=False)


def _env(**variables):
    return read_environment(variables, option_names=tuple(options()))


def _resolve(argv, env=None, machine=CPU):
    ns = build_parser("serve").parse_args(argv)
    cli = {name: getattr(ns, name) for name in options()}
    return resolve(cli, env or _env(), FACTS, machine)


def test_seed_bug_explicit_prefill_length_is_honoured_on_the_real_config(real_model_dir):
    """The bug this project exists for: an explicit --max-prefill-length must be the effective one."""
    ns = build_parser("plan").parse_args(
        ["--model", str(real_model_dir), "--max-prefill-length", "4096", "--gpu-memory", "32GiB", "--platform", "wsl2"]
    )
    cfg, _, args = resolve_from_cli(ns, _env(), config_only=True, simulate_gpu=True)
    assert args.n_layers == 43
    assert cfg.max_prefill_length.value == 4096
    assert cfg.max_prefill_length.source is Source.CLI


def test_defaults_and_model_rules():
    cfg = _resolve(["--model", "x"])
    assert cfg.port.value == 8000 and cfg.port.source is Source.DEFAULT
    assert cfg.host.value == "127.0.0.1"
    assert cfg.max_queued_requests.value == 256
    assert cfg.max_model_len.value == 1_048_576 and cfg.max_model_len.source is Source.MODEL_RULE
    assert cfg.served_model_name.value == "DeepSeek-V4-Flash"
    assert cfg.served_model_name.source is Source.MODEL_RULE
    assert cfg.device.value == "cpu" and cfg.device.source is Source.MEASURED
    assert cfg.max_prefill_length.value is None and cfg.max_prefill_length.source is Source.DEFAULT
    assert cfg.default_thinking.value is True


def test_cli_beats_env_and_env_beats_default():
    env = _env(DSV4SERVE_PORT="9001", DSV4SERVE_MAX_NUM_SEQS="4", DSV4SERVE_API_KEY="secret")
    cfg = _resolve(["--model", "x", "--port", "9002"], env)
    assert (cfg.port.value, cfg.port.source) == (9002, Source.CLI)
    assert (cfg.max_num_seqs.value, cfg.max_num_seqs.source) == (4, Source.ENV)
    assert (cfg.api_key.value, cfg.api_key.source) == ("secret", Source.ENV)


def test_model_rules_never_override_explicit_values():
    cfg = _resolve(
        ["--model", "x", "--served-model-name", "mine", "--max-model-len", "8192", "--max-prefill-length", "100000"]
    )
    assert (cfg.served_model_name.value, cfg.served_model_name.source) == ("mine", Source.CLI)
    assert (cfg.max_model_len.value, cfg.max_model_len.source) == (8192, Source.CLI)
    assert (cfg.max_prefill_length.value, cfg.max_prefill_length.source) == (100000, Source.CLI)
    assert "never binds" in cfg.max_prefill_length.note


def test_impossible_explicit_values_stop_startup_naming_flag_and_limit():
    with pytest.raises(ConfigError, match=r"--max-model-len 2000000 exceeds .* 1048576 .*max_position_embeddings"):
        _resolve(["--model", "x", "--max-model-len", "2000000"])
    with pytest.raises(ConfigError, match=r"DSV4SERVE_MAX_MODEL_LEN 2000000 exceeds"):
        _resolve(["--model", "x"], _env(DSV4SERVE_MAX_MODEL_LEN="2000000"))
    with pytest.raises(ConfigError, match=r"--device cuda: no CUDA device"):
        _resolve(["--model", "x", "--device", "cuda"])


def test_malformed_environment_is_a_startup_error():
    with pytest.raises(ConfigError, match="DSV4SERVE_PORT='eighty'"):
        _resolve(["--model", "x"], _env(DSV4SERVE_PORT="eighty"))
    with pytest.raises(ConfigError, match="DSV4SERVE_DEVICE='tpu': must be one of"):
        _resolve(["--model", "x"], _env(DSV4SERVE_DEVICE="tpu"))
    with pytest.raises(ConfigError, match="DSV4SERVE_MEMORY_RATIO='1.5'"):
        _resolve(["--model", "x"], _env(DSV4SERVE_MEMORY_RATIO="1.5"))


def test_config_is_frozen_and_every_field_is_a_setting():
    cfg = _resolve(["--model", "x"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = None  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port.value = 1  # type: ignore[misc]
    assert [f.name for f in dataclasses.fields(ServeConfig)] == list(options())


def test_report_shows_every_setting_with_its_source_and_hides_secrets():
    cfg = _resolve(["--model", "x", "--api-key", "hunter2", "--max-prefill-length", "4096"])
    text = format_settings(cfg)
    for name, opt in options().items():
        assert opt.flag(name) in text
    assert "hunter2" not in text
    line = next(line for line in text.splitlines() if line.startswith("--max-prefill-length"))
    assert "4096" in line and " cli " in line


def test_nothing_writes_to_frozen_objects():
    package = Path(__file__).resolve().parents[2] / "dsv4serve"
    out = subprocess.run(["grep", "-rn", "object.__setattr__", str(package)], capture_output=True, text=True)
    assert out.stdout == ""
