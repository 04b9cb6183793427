"""Opening a checkpoint folder: config, layout, validation, then streaming its tensors.

`open_checkpoint` reads only config files and safetensors headers, and fails with a message naming
every tensor that does not fit the config. `iter_dense` then reads the tensors one at a time
(memory-mapped), dequantizing FP8 and FP4 weights, with a progress bar over bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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


# what a tensor-parallel rank reads of a tensor, by official name and stored shape (parallel/partition.py's
# Partition.shard_slice for one rank): the slices, or None when the rank holds none of it
Cut = Callable[[str, tuple[int, ...]], "tuple[slice, ...] | None"]


def iter_dense(
    ckpt: Checkpoint, dtype: torch.dtype = torch.float32, progress: bool = True, cut: Cut | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(official parameter name, dense tensor) for every weight; `.scale` tensors are consumed.

    FP8 and FP4 weights are dequantized exactly and cast to `dtype`; bf16/f16 tensors are cast to
    `dtype`; tensors the checkpoint keeps in fp32 (HC, sinks, ape, gate bias) stay fp32 so the
    reference's fp32 parts keep their precision; integer tensors (tid2eid) are returned as stored.
    With `cut` (a tensor-parallel rank's part), each tensor is yielded as that part, or not at all: from the
    official layout only those bytes are read (a weight's slice and its scale's slice dequantize alone, as the
    partition cuts on whole quantization blocks); transformers-named tensors are read whole and then cut.
    """
    bar = tqdm(
        total=ckpt.total_bytes if cut is None else _cut_bytes(ckpt, cut),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"loading {ckpt.folder.name}",
        disable=not progress,
    )
    try:
        if ckpt.layout == "official":
            yield from _iter_official(ckpt, dtype, bar, cut)
        else:
            yield from _iter_hf(ckpt, dtype, bar, cut)
    finally:
        bar.close()


def _cast(t: torch.Tensor, dtype: torch.dtype, spec_dtype: str) -> torch.Tensor:
    if not t.is_floating_point() or spec_dtype == "F32":
        return t if not t.is_floating_point() else t.float()
    return t.to(dtype)


def _cut_bytes(ckpt: Checkpoint, cut: Cut) -> int:
    """The bytes a rank reads of the checkpoint's specs (the progress bar's total)."""
    wanted = {s.name for s in ckpt.specs}
    total = 0
    for name, info in ckpt.source.infos.items():
        official = hf_names.hf_to_official(name) if ckpt.layout == "hf" else name
        if official is None:  # stacked experts (transformers' layout): read whole, then cut
            total += _nbytes(info.dtype, info.shape)
            continue
        sl = cut(official, tuple(info.shape)) if official in wanted else None
        if sl is not None:
            total += _nbytes(info.dtype, tuple(s.stop - s.start for s in sl))
    return total


def _iter_official(
    ckpt: Checkpoint, dtype: torch.dtype, bar: tqdm, cut: Cut | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    src, block = ckpt.source, ckpt.args.weight_block_size
    pending: dict[str, torch.Tensor] = {}
    for spec in ckpt.specs:
        part = None if cut is None else cut(spec.name, spec.shape)
        if cut is not None and part is None:
            continue  # another rank's (a routed expert it owns, and its scale)
        t = src.read(spec.name, part)
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


def _iter_hf(
    ckpt: Checkpoint, dtype: torch.dtype, bar: tqdm, cut: Cut | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    spec_dtype = {s.name: s.dtype for s in ckpt.specs}
    src = ckpt.source
    for name in sorted(src.infos, key=lambda n: (src.infos[n].file, n)):
        official = hf_names.hf_to_official(name)
        if official is not None:
            part = None if cut is None else cut(official, tuple(src.infos[name].shape))
            if cut is not None and part is None:
                continue
            t = src.read(name, part)
            bar.update(t.numel() * t.element_size())
            yield official, _cast(t, dtype, spec_dtype[official])
            continue
        t = src.read(name)
        bar.update(t.numel() * t.element_size())
        stacked = hf_names.hf_stacked_experts(name)
        assert stacked is not None  # check_tensors rejected every other name
        for part_name, tensor in hf_names.split_stacked(*stacked, t).items():
            sl = None if cut is None else cut(part_name, tuple(tensor.shape))
            if cut is not None and sl is None:
                continue
            yield part_name, (tensor if sl is None else tensor[sl]).to(dtype).clone()


def load_dense_state_dict(
    folder: str | Path, dtype: torch.dtype = torch.float32, progress: bool = False
) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Open, validate and read a whole checkpoint into memory (for small models and tests)."""
    ckpt = open_checkpoint(folder)
    try:
        return ckpt.args, dict(iter_dense(ckpt, dtype, progress))
    finally:
        ckpt.source.close()
