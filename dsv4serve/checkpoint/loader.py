"""Opening a checkpoint folder: config, layout, validation, then streaming its tensors.

`open_checkpoint` reads only config files and safetensors headers, and fails with a message naming
every tensor that does not fit the config. `iter_dense` then reads the tensors one at a time
(memory-mapped), dequantizing FP8 and FP4 weights, with a progress bar over bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dsv4_kernels.formats import dequant_fp4, dequant_fp8_block
from dsv4serve.checkpoint import hf_names
from dsv4serve.checkpoint.source import CheckpointError, SafetensorsFolder
from dsv4serve.checkpoint.validate import Layout, check_tensors, detect_layout
from dsv4serve.model.args import ExpertDtype, ModelArgs, ModelConfigError, read_model_args
from dsv4serve.model.schema import DTYPE_BYTES, TensorSpec, checkpoint_schema

PROBE_EXPERT = "layers.0.ffn.experts.0.w1.weight"
_EXPERT_DTYPE_BY_STORAGE: dict[str, ExpertDtype] = {"I8": "fp4", "F8_E4M3": "fp8"}


@dataclass(frozen=True)
class Checkpoint:
    folder: Path
    layout: Layout
    args: ModelArgs
    specs: tuple[TensorSpec, ...]
    source: SafetensorsFolder

    @property
    def total_bytes(self) -> int:
        return sum(_nbytes(i.dtype, i.shape) for i in self.source.infos.values())


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = DTYPE_BYTES.get(dtype, 0)
    for d in shape:
        n *= d
    return n


def open_checkpoint(folder: str | Path) -> Checkpoint:
    """Read config + headers and validate every tensor name, dtype and shape (no tensor data read)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder")
    source = SafetensorsFolder(folder)
    layout = detect_layout(set(source.infos))
    probe = source.infos.get(PROBE_EXPERT)
    hint = _EXPERT_DTYPE_BY_STORAGE.get(probe.dtype) if (layout == "official" and probe) else None
    try:
        args = read_model_args(folder, expert_dtype_hint=hint)
    except ModelConfigError as exc:
        raise CheckpointError(f"{folder}/config.json: {exc}") from exc
    if layout == "hf" and args.dtype == "fp8":
        raise CheckpointError(
            f"{folder}: transformers-named tensors with an FP8 quantization_config are not "
            "supported; pass the official checkpoint folder instead"
        )
    specs = tuple(checkpoint_schema(args, include_mtp=layout == "official"))
    check_tensors(source.infos, layout, list(specs), str(folder))
    return Checkpoint(folder, layout, args, specs, source)


def iter_dense(
    ckpt: Checkpoint, dtype: torch.dtype = torch.float32, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(official parameter name, dense tensor) for every weight; `.scale` tensors are consumed.

    FP8 and FP4 weights are dequantized exactly and cast to `dtype`; bf16/f16 tensors are cast to
    `dtype`; tensors the checkpoint keeps in fp32 (HC, sinks, ape, gate bias) stay fp32 so the
    reference's fp32 parts keep their precision; integer tensors (tid2eid) are returned as stored.
    """
    bar = tqdm(
        total=ckpt.total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"loading {ckpt.folder.name}",
        disable=not progress,
    )
    try:
        if ckpt.layout == "official":
            yield from _iter_official(ckpt, dtype, bar)
        else:
            yield from _iter_hf(ckpt, dtype, bar)
    finally:
        bar.close()


def _cast(t: torch.Tensor, dtype: torch.dtype, spec_dtype: str) -> torch.Tensor:
    if not t.is_floating_point() or spec_dtype == "F32":
        return t if not t.is_floating_point() else t.float()
    return t.to(dtype)


def _iter_official(ckpt: Checkpoint, dtype: torch.dtype, bar: tqdm) -> Iterator[tuple[str, torch.Tensor]]:
    src, block = ckpt.source, ckpt.args.weight_block_size
    pending: dict[str, torch.Tensor] = {}
    for spec in ckpt.specs:
        t = src.read(spec.name)
        bar.update(t.numel() * t.element_size())
        if spec.role in ("fp8_weight", "fp4_weight"):
            pending[spec.name] = t
            continue
        if spec.role == "fp8_scale":
            name = spec.name[: -len(".scale")] + ".weight"
            yield name, dequant_fp8_block(pending.pop(name), t, block, dtype)
        elif spec.role == "fp4_scale":
            name = spec.name[: -len(".scale")] + ".weight"
            yield name, dequant_fp4(pending.pop(name), t, dtype)
        else:
            yield spec.name, _cast(t, dtype, spec.dtype)
    if pending:  # the schema always pairs a weight with its scale; this guards that invariant
        raise CheckpointError(f"weights without scales: {sorted(pending)[:5]}")


def _iter_hf(ckpt: Checkpoint, dtype: torch.dtype, bar: tqdm) -> Iterator[tuple[str, torch.Tensor]]:
    spec_dtype = {s.name: s.dtype for s in ckpt.specs}
    src = ckpt.source
    for name in sorted(src.infos, key=lambda n: (src.infos[n].file, n)):
        t = src.read(name)
        bar.update(t.numel() * t.element_size())
        official = hf_names.hf_to_official(name)
        if official is not None:
            yield official, _cast(t, dtype, spec_dtype[official])
            continue
        stacked = hf_names.hf_stacked_experts(name)
        assert stacked is not None  # check_tensors rejected every other name
        for part, tensor in hf_names.split_stacked(*stacked, t).items():
            yield part, tensor.to(dtype).clone()


def load_dense_state_dict(
    folder: str | Path, dtype: torch.dtype = torch.float32, progress: bool = False
) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Open, validate and read a whole checkpoint into memory (for small models and tests)."""
    ckpt = open_checkpoint(folder)
    try:
        return ckpt.args, dict(iter_dense(ckpt, dtype, progress))
    finally:
        ckpt.source.close()
