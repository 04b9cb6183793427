"""From parsed command-line arguments to a resolved, frozen config (shared by serve and plan).

cfg, location, args = resolve_from_cli(ns, env, config_only=...)
"""

from __future__ import annotations

import argparse

from dsv4serve.config import ConfigError, options
from dsv4serve.env import Environment


def _cli_values(ns: argparse.Namespace) -> dict[str, object]:
    values = {name: getattr(ns, name) for name in options()}
    if values["default_thinking"] is not None:
        values["default_thinking"] = values["default_thinking"] == "on"
    return values


def resolve_from_cli(ns: argparse.Namespace, env: Environment, config_only: bool, simulate_gpu: bool = False):
    """Locate the model, read its config, and resolve the settings: (config, location, model args)."""
    from dsv4serve.model.args import read_model_args
    from dsv4serve.model_source import locate_model
    from dsv4serve.resolve import MachineFacts, ModelFacts, resolve, user_values

    cli = _cli_values(ns)
    model_spec = user_values(cli, env)["model"].value
    if not model_spec:
        raise ConfigError(
            "--model is required: a model folder, a Hugging Face repo id, DeepSeek-V4-Flash, or dsv4-tiny"
        )
    location = locate_model(model_spec, env.cache_dir, config_only=config_only)
    args = read_model_args(location.path) if config_only else None
    if args is None:
        from dsv4serve.checkpoint.loader import open_checkpoint

        ckpt = open_checkpoint(location.path)
        args = ckpt.args
    if simulate_gpu:
        machine = MachineFacts(cuda_available=True, simulated=True)
    else:
        import torch

        machine = MachineFacts(cuda_available=torch.cuda.is_available())
    facts = ModelFacts(name=location.name, max_position_embeddings=args.max_position_embeddings)
    cfg = resolve(cli, env, facts, machine)
    return cfg, location, args
