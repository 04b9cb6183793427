"""The one resolution pass: defaults -> env -> cli -> model rules -> measured.

Model rules and measurements only ever replace values whose source is `default`. An explicit value
(cli or env) is honoured as given, or resolution stops with a ConfigError that names the flag, the
limit and the reason. This is what makes the seed bug (a server silently overwriting an explicit
--max-prefill-length) impossible: no code path assigns a new value to an explicit setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsv4serve.config import ConfigError, ServeConfig, Setting, Source, options
from dsv4serve.env import Environment, option_env_name


@dataclass(frozen=True)
class ModelFacts:
    """What the model's config says, as far as the settings need it."""

    name: str  # folder name or alias: the default served model name
    max_position_embeddings: int


@dataclass(frozen=True)
class MachineFacts:
    """What was measured about this machine before the settings are resolved."""

    cuda_available: bool
    simulated: bool = False  # `dsv4serve plan --gpu-memory`: planning for a GPU that is not here


def who(name: str, setting: Setting[Any]) -> str:
    """How the user set a value: the flag, or the environment variable."""
    if setting.source is Source.ENV:
        return option_env_name(name)
    return options()[name].flag(name)


def user_values(cli: Mapping[str, Any], env: Environment) -> dict[str, Setting[Any]]:
    """Defaults overlaid by DSV4SERVE_* variables, overlaid by flags (already parsed by argparse)."""
    out: dict[str, Setting[Any]] = {}
    for name, opt in options().items():
        if cli.get(name) is not None:
            out[name] = Setting(cli[name], Source.CLI)
        elif name in env.options:
            text = env.options[name]
            try:
                out[name] = Setting(opt.parse(text), Source.ENV)
            except ValueError as exc:
                raise ConfigError(f"{option_env_name(name)}={text!r}: {exc}") from exc
            if opt.choices and text.lower() not in opt.choices:
                raise ConfigError(f"{option_env_name(name)}={text!r}: must be one of {', '.join(opt.choices)}")
        else:
            out[name] = Setting(opt.default, Source.DEFAULT)
    return out


def resolve(cli: Mapping[str, Any], env: Environment, model: ModelFacts, machine: MachineFacts) -> ServeConfig:
    values = user_values(cli, env)
    if not values["model"].value:
        raise ConfigError(
            "--model is required: a model folder, a Hugging Face repo id, DeepSeek-V4-Flash, or dsv4-tiny"
        )
    for rule in (_served_model_name, _device, _max_model_len, _max_prefill_length):
        name, setting = rule(values, model, machine)
        values[name] = setting
    return ServeConfig(**values)


Rule = tuple[str, Setting[Any]]


def _served_model_name(v: dict[str, Setting[Any]], model: ModelFacts, _: MachineFacts) -> Rule:
    s = v["served_model_name"]
    if s.source.explicit:
        return "served_model_name", s
    return "served_model_name", Setting(model.name, Source.MODEL_RULE, "the model's folder name or alias")


def _device(v: dict[str, Setting[Any]], _: ModelFacts, machine: MachineFacts) -> Rule:
    s = v["device"]
    if s.value == "cuda" and not machine.cuda_available:
        raise ConfigError(
            f"{who('device', s)} cuda: no CUDA device is visible to torch "
            "(torch.cuda.is_available() is False); run `dsv4serve doctor`, or use --device cpu"
        )
    if s.value != "auto":
        return "device", s
    if machine.cuda_available:
        seen = "planned for the GPU given by --gpu-memory" if machine.simulated else "a CUDA device is visible"
        return "device", Setting("cuda", Source.MEASURED, f"auto: {seen}")
    return "device", Setting("cpu", Source.MEASURED, "auto: no CUDA device is visible; PyTorch reference path")


def _max_model_len(v: dict[str, Setting[Any]], model: ModelFacts, _: MachineFacts) -> Rule:
    s, limit = v["max_model_len"], model.max_position_embeddings
    if s.source.explicit:
        if s.value > limit:
            raise ConfigError(
                f"{who('max_model_len', s)} {s.value} exceeds the model's context limit of "
                f"{limit} tokens (max_position_embeddings in config.json): positions beyond it "
                "were never trained"
            )
        return "max_model_len", Setting(s.value, s.source, "honoured; the KV plan must hold it or startup stops")
    return "max_model_len", Setting(
        limit, Source.MODEL_RULE, "max_position_embeddings in config.json; capped by KV capacity once planned"
    )


def _max_prefill_length(v: dict[str, Setting[Any]], _: ModelFacts, __: MachineFacts) -> Rule:
    s = v["max_prefill_length"]
    if not s.source.explicit:
        return "max_prefill_length", Setting(None, s.source, "the chunk planner sizes it from measured free memory")
    note = "honoured as given: the chunk planner may never raise or ignore it"
    if s.value > v["max_model_len"].value:
        note = f"honoured; above max_model_len ({v['max_model_len'].value}), so it never binds"
    return "max_prefill_length", Setting(s.value, s.source, note)
