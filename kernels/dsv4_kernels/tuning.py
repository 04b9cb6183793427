"""Launch choices measured on a GPU model, read at launch: one JSON file per device name in tuned/.

The decode GEMMs' best K-loop form, tile and split differ by card (an H200's 132 SMs and 4.8 TB/s against an
RTX 5090's 170 SMs and 1.8 TB/s), so they are timed there, not guessed: bench/gpu_fp4_sweep.py and
bench/gpu_fp8_sweep.py time every choice at decode sizes and `--write-tuning` records the fastest one that
checks against the default, per GEMM and size, with the run that measured it. Without a file for the card
(or off CUDA: the interpreter, the CPU) the wrappers keep their built-in defaults.

    tuned/NVIDIA_H200.json = {
      "device": "NVIDIA H200", "measured": "<date, command>",
      "fp4_moe": {"gate_up": {"6": {"even_odd": true, "split_k": 4, "block_k": 64, ...}}, "down": {...}},
      "fp8_gemm": {"1024x4096": {"1": 4, "8": 2}, ...}
    }

Sizes are keys ("6": routes for fp4_moe, rows for fp8_gemm); a launch takes the largest key not above its
size, so a file measured at 1 and 8 tokens serves 1-7 from the first and 8 up from the second. `DSV4_TUNING_DIR`
names another folder (the sweeps' tests write to a temporary one).
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

TUNED_DIR = Path(__file__).with_name("tuned")


def tuning_dir() -> Path:
    return Path(os.environ.get("DSV4_TUNING_DIR") or TUNED_DIR)


def file_for(device_name: str) -> Path:
    """tuned/<device name, non-alphanumerics as _>.json"""
    return tuning_dir() / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def device_name(device: torch.device) -> str | None:
    """The CUDA device's model name (None off CUDA); asked once per device: the wrappers look it up per launch."""
    if device.type != "cuda":
        return None
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.cache
def _load(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def table(device: torch.device) -> dict[str, Any]:
    """The card's tuning file ({} when there is none, or off CUDA)."""
    name = device_name(device)
    return {} if name is None else _load(file_for(name))


def nearest(by_size: dict[str, Any], size: int) -> Any:
    """The entry of the largest size key <= size; None when every key is larger (or there are none)."""
    fits = [int(k) for k in by_size if int(k) <= size]
    return by_size[str(max(fits))] if fits else None


def lookup(device: torch.device, *keys: str, size: int) -> Any:
    """table[keys...] at `size` (nearest), or None."""
    node: Any = table(device)
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return nearest(node, size) if isinstance(node, dict) else None


def record(path: Path, keys: tuple[str, ...], size: int, choice: Any, device: str, measured: str) -> None:
    """Write (merge) one measured choice into a tuning file: table[keys...][size] = choice."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data["device"], data["measured"] = device, measured
    node = data
    for key in keys:
        node = node.setdefault(key, {})
    node[str(size)] = choice
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    _load.cache_clear()
