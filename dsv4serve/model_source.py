"""Turning the --model argument into a local checkpoint folder.

MODEL is a local folder (official or transformers layout), a Hugging Face repo id, the alias
`DeepSeek-V4-Flash`, or the built-in `dsv4-tiny` (and `dsv4-tiny-split`, its variant that 2 or 4
tensor-parallel ranks can split). Repo ids are fetched with huggingface_hub into the
normal HF cache (HF_HOME / HF_HUB_CACHE), with its progress bars; a snapshot already in the cache is
used without the network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dsv4serve.tiny.builder import ensure_tiny
from dsv4serve.tiny.spec import TINY_NAME, TINY_SPLIT_NAME

ALIASES = {"DeepSeek-V4-Flash": "deepseek-ai/DeepSeek-V4-Flash"}
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
CONFIG_PATTERNS = [
    "config.json",
    "inference/config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
]
WEIGHT_PATTERNS = CONFIG_PATTERNS + ["model.safetensors.index.json", "*.safetensors"]
Origin = Literal["local", "builtin", "hub"]


class ModelSourceError(ValueError):
    """The model could not be found or fetched; the message says what to do."""


@dataclass(frozen=True)
class ModelLocation:
    name: str  # the folder name or the alias as given: the default served model name
    path: Path
    origin: Origin
    repo_id: str | None = None


def locate_model(spec: str, cache_dir: Path, config_only: bool = False) -> ModelLocation:
    """Find (or build, or download) the model; `config_only` fetches no weights from the hub."""
    if spec in (TINY_NAME, TINY_SPLIT_NAME):
        return ModelLocation(spec, ensure_tiny(cache_dir, split=spec == TINY_SPLIT_NAME), "builtin")
    local = Path(spec).expanduser()
    if local.is_dir():
        return ModelLocation(local.resolve().name, local.resolve(), "local")
    repo_id = ALIASES.get(spec, spec)
    if not REPO_ID.match(repo_id) or spec.startswith((".", "/", "~")):
        raise ModelSourceError(
            f"--model {spec}: not a folder, not a Hugging Face repo id (owner/name), and not "
            f"one of {', '.join([TINY_NAME, TINY_SPLIT_NAME, *ALIASES])}"
        )
    path = _download(repo_id, CONFIG_PATTERNS if config_only else WEIGHT_PATTERNS)
    return ModelLocation(spec.split("/")[-1], path, "hub", repo_id)


def _download(repo_id: str, patterns: list[str]) -> Path:
    import huggingface_hub
    from huggingface_hub import errors

    try:
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns))
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as exc:
        raise ModelSourceError(
            f"--model {repo_id}: the Hugging Face Hub refused it ({type(exc).__name__}); "
            "check the repo id, and HF_TOKEN for a gated repo"
        ) from exc
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, errors.HfHubHTTPError, OSError) as exc:
        raise ModelSourceError(
            f"--model {repo_id}: could not download it from the Hugging Face Hub and it is not in the local HF "
            f"cache ({type(exc).__name__}: {exc}). Without network access here: download it on a machine with "
            f"access (`hf download {repo_id} --local-dir DIR`), copy DIR to this machine, and pass "
            "--model DIR"
        ) from exc
