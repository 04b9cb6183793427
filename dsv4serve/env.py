"""The one module that reads environment variables; each is typed, and a malformed one is an error.

Every serve option can also come from `DSV4SERVE_<OPTION>` (e.g. DSV4SERVE_MAX_PREFILL_LENGTH=4096);
a command-line flag wins over its variable. Other variables:
- DSV4SERVE_CACHE_DIR: where built-in models such as dsv4-tiny are built [~/.cache/dsv4serve,
  or $XDG_CACHE_HOME/dsv4serve].
- DSV4SERVE_TESTING_OOM_ABOVE_BYTES (TESTING ONLY): the worker raises a real torch.OutOfMemoryError
  in any step whose activations would pass this many bytes (tests/e2e: out-of-memory recovery).
- DSV4SERVE_FLASHINFER_SAMPLING [1]: 0 keeps a CUDA worker's draws on torch even when flashinfer is
  installed (worker/sampling_flashinfer.py; for comparing the two).
Hugging Face's own variables (HF_HOME, HF_HUB_OFFLINE, HF_TOKEN, ...) are read by huggingface_hub.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PREFIX = "DSV4SERVE_"


@dataclass(frozen=True)
class Environment:
    options: Mapping[str, str]  # option name (max_prefill_length) -> raw text, for DSV4SERVE_* set
    cache_dir: Path
    testing_oom_above_bytes: int | None = None  # TESTING ONLY: fault injection in the worker
    flashinfer_sampling: bool = True  # a CUDA worker draws with flashinfer's kernels when installed


def option_env_name(option: str) -> str:
    return PREFIX + option.upper()


def read_environment(environ: Mapping[str, str] | None = None, option_names: tuple[str, ...] = ()) -> Environment:
    env = os.environ if environ is None else environ
    options = {name: env[option_env_name(name)] for name in option_names if env.get(option_env_name(name), "") != ""}
    if env.get(PREFIX + "CACHE_DIR"):
        cache = Path(env[PREFIX + "CACHE_DIR"]).expanduser()
    elif env.get("XDG_CACHE_HOME"):
        cache = Path(env["XDG_CACHE_HOME"]) / "dsv4serve"
    else:
        cache = Path.home() / ".cache" / "dsv4serve"
    return Environment(
        options=options,
        cache_dir=cache,
        testing_oom_above_bytes=_int(env, PREFIX + "TESTING_OOM_ABOVE_BYTES"),
        flashinfer_sampling=_int(env, PREFIX + "FLASHINFER_SAMPLING") != 0,
    )


def _int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "")
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected an integer") from None
