"""Loading an official FP8 / MXFP4 checkpoint for the Triton kernel path, packed as stored, never dense.

    model, cache = load_packed(ckpt, backends, device, include_mtp, expert_cache_slots)

The model is built on the meta device (no memory); then every tensor is read from the memory-mapped
shards one at a time and placed on `device`:
- FP8-stored projections (e4m3 + ue8m0 128x128 `.scale`), when `fp8_gemm` is on Triton: as the
  packed pair `Linear.pack_fp8` would make, with no dense weight (`Linear.load_fp8`);
- resident routed experts (MXFP4), when `fp4_moe` is on Triton: straight into the stacked copies
  `MoE.pack_fp4` would make (`MoE.use_packed_experts`); with expert slots asked for, the experts go
  to the host bank behind an expert-slot cache instead (`attach_expert_cache`, as the engine does);
- everything else as the dense loader (`iter_dense`) gives it, in DENSE_DTYPE: norms, head, HC,
  router, compressor / indexer weights, and any FP8 projection or routed expert whose kernel is on
  torch; except the tensors of HELD_BF16 (the head with its kernel on Triton, the compressors' wkv / wgate
  with theirs), held in bf16 (exact: see there).
Buffers computed in `__init__` (the RoPE frequencies) are recomputed, and the result is checked to
hold no meta tensor. Host memory stays near one tensor: each is moved to `device` as soon as read.

What this path allocates on `device` is computed from the checkpoint schema alone by
dsv4serve/memory/weights.py (`device_bytes`), from the same placement rules (`spec_kind`, `held_bf16`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from tqdm import tqdm

from dsv4serve.checkpoint.loader import Checkpoint, Cut, iter_dense
from dsv4serve.checkpoint.source import CheckpointError
from dsv4serve.experts.attach import attach_expert_cache
from dsv4serve.experts.slot_cache import ExpertSlotCache
from dsv4serve.memory.weights import DENSE_DTYPE, held_bf16, model_specs, spec_kind
from dsv4serve.model.attention import Attention
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.layers import Linear
from dsv4serve.model.moe import MoE
from dsv4serve.model.rope import inv_freq
from dsv4serve.model.schema import TORCH_DTYPES, TensorSpec
from dsv4serve.model.transformer import Transformer


def check_packable(ckpt: Checkpoint, backends: KernelBackends) -> None:
    if ckpt.layout != "official" or ckpt.args.dtype != "fp8":
        raise CheckpointError(
            f"{ckpt.folder}: the packed loader reads official FP8 checkpoints "
            f"(this one: {ckpt.layout} layout, dtype {ckpt.args.dtype}); load it dense"
        )
    if backends.fp4_moe == "triton" and ckpt.args.expert_dtype != "fp4":
        raise CheckpointError(
            f"{ckpt.folder}: fp4_moe=triton needs MXFP4 routed experts, this checkpoint "
            f"stores them as {ckpt.args.expert_dtype}"
        )


def load_packed(
    ckpt: Checkpoint,
    backends: KernelBackends,
    device: torch.device,
    include_mtp: bool,
    expert_cache_slots: int | None = None,
    progress: bool = True,
    bank_ram_bytes: int | None = None,
) -> tuple[Transformer, ExpertSlotCache | None]:
    """The model for `backends` on `device`, loaded packed (see the module doc), and its expert-slot
    cache (None: the routed experts are resident). `expert_cache_slots` and `bank_ram_bytes` (its
    `ram_bytes`) as for attach_expert_cache."""
    check_packable(ckpt, backends)
    with torch.device("meta"):
        model = Transformer(ckpt.args, include_mtp=include_mtp)
    cache = attach_expert_cache(model, ckpt, expert_cache_slots, device, ram_bytes=bank_ram_bytes, progress=progress)
    specs = model_specs(ckpt.specs, ckpt.args, include_mtp)
    fill_packed(model, ckpt, specs, backends, device, cache is None, progress)
    return model.eval(), cache


def fill_packed(
    model: Transformer,
    ckpt: Checkpoint,
    specs: list[TensorSpec],
    backends: KernelBackends,
    device: torch.device,
    experts_resident: bool,
    progress: bool,
    cut: Cut | None = None,
) -> None:
    """Read `specs` into the meta `model`, packed where the kernels read them so. With `cut` (a tensor-parallel
    rank's part: parallel/rank_load.py, on a model cut to the rank's shapes, `specs` at their shard shapes), each
    tensor is read as that part alone; a rank's owned experts stack in global order (MoE.local_expert maps)."""
    kinds = {s.name: spec_kind(s, backends, experts_resident) for s in specs}
    with tqdm(
        total=sum(s.nbytes for s in specs if kinds[s.name] != "bank"),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"loading {ckpt.folder.name} packed",
        disable=not progress,
    ) as bar:
        read = _reader(ckpt, cut)
        _load_fp8(model, read, [s for s in specs if kinds[s.name] == "fp8_packed"], device, bar)
        _load_fp4(model, read, [s for s in specs if kinds[s.name] == "fp4_stacked"], device, bar)
        dense = [s for s in specs if kinds[s.name] == "dense"]
        _load_dense(model, ckpt, dense, backends, device, bar, cut)
    compute_buffers(model, device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"the packed load left {len(left)} tensors unloaded: {left[:5]}")


def _reader(ckpt: Checkpoint, cut: Cut | None) -> Callable[[str], torch.Tensor]:
    """name -> the tensor as stored, or a rank's part of it (its slice of the stored shape)."""
    if cut is None:
        return ckpt.source.read
    stored = {s.name: s.shape for s in ckpt.specs}
    return lambda name: ckpt.source.read(name, cut(name, stored[name]))


def compute_buffers(model: Transformer, device: torch.device) -> None:
    """The buffers `__init__` computes (the RoPE frequencies), for a model built on the meta device: as
    `__init__` computes them (on the CPU, like the dense path), then placed."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.freqs = inv_freq(model.args, bool(module.compress_ratio)).to(device)


def _placed(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy of `t` in memory of its own on `device`, as load_state_dict's copy into allocated parameters
    gives: `t.to(device)` would alias the reader's buffer on the CPU, whose alignment can change which
    code path (and so which summation order) a CPU GEMM takes, and the logits with it."""
    return torch.empty(t.shape, dtype=dtype or t.dtype, device=device).copy_(t)


def _load_fp8(
    model: Transformer, read: Callable[[str], torch.Tensor], specs: list[TensorSpec], device: torch.device, bar: tqdm
) -> None:
    """Each FP8-stored projection's e4m3 weight and e8m0 scale, as read, on `device`."""
    weights: dict[str, torch.Tensor] = {}
    for spec in specs:
        t = _placed(read(spec.name), device)
        bar.update(spec.nbytes)
        path, leaf = spec.name.rsplit(".", 1)
        if leaf == "weight":
            weights[path] = t
            continue
        linear = model.get_submodule(path)
        if not isinstance(linear, Linear) or not linear.fp8_stored:
            raise RuntimeError(
                f"{spec.name}: the packed loader took {path} for an FP8-stored projection (update FP8_RUN_DENSE)"
            )
        linear.load_fp8(weights.pop(path), t)


def _load_fp4(
    model: Transformer, read: Callable[[str], torch.Tensor], specs: list[TensorSpec], device: torch.device, bar: tqdm
) -> None:
    """Each layer's routed experts, copied one by one into stacked [E, out, in/2] int8 codes and
    [E, out, in/32] e8m0 scales on `device` (expert parallel: E = the rank's own, in global order)."""
    stacks: dict[str, dict[str, torch.Tensor]] = {}  # MoE path -> {"w1_fp4": ..., "w1_fp4_scale": ...}
    rows: dict[str, dict[int, int]] = {}  # MoE path -> {global expert: its row in the stacks}
    for spec in specs:
        moe_path, rest = spec.name.split(".experts.")  # "layers.3.ffn", "5.w1.weight"
        _, part, leaf = rest.split(".")
        key = f"{part}_fp4" + ("_scale" if leaf == "scale" else "")
        moe = model.get_submodule(moe_path)
        assert isinstance(moe, MoE) and spec.expert is not None
        if moe_path not in rows:
            rows[moe_path] = {e: i for i, e in enumerate(moe.owned_experts)}
        row = rows[moe_path]
        layer = stacks.setdefault(moe_path, {})
        if key not in layer:
            layer[key] = torch.empty((len(row), *spec.shape), dtype=TORCH_DTYPES[spec.dtype], device=device)
        layer[key][row[spec.expert]].copy_(read(spec.name))
        bar.update(spec.nbytes)
    for moe_path, layer in stacks.items():
        moe = model.get_submodule(moe_path)
        assert isinstance(moe, MoE)
        moe.use_packed_experts(layer)


def _load_dense(
    model: Transformer,
    ckpt: Checkpoint,
    specs: list[TensorSpec],
    backends: KernelBackends,
    device: torch.device,
    bar: tqdm,
    cut: Cut | None = None,
) -> None:
    """The dense loader's tensors (FP8 / FP4 dequantized exactly), each cast to the dtype of the meta
    tensor it replaces (bf16 if `held_bf16`, checked exact) and placed on `device`."""
    read_bytes = {s.name: s.nbytes for s in specs}
    stored = {s.name: s for s in ckpt.specs if s.name in read_bytes}  # iter_dense cuts the stored shapes
    whole = dataclasses.replace(ckpt, specs=tuple(stored.values()))
    for name, t in iter_dense(whole, DENSE_DTYPE, progress=False, cut=cut):
        bar.update(read_bytes[name] + read_bytes.get(name.removesuffix(".weight") + ".scale", 0))
        path, _, leaf = name.rpartition(".")  # top-level tensors (hc_head_fn) have no module path
        module = model.get_submodule(path)
        meta = getattr(module, leaf)
        if meta is None or tuple(meta.shape) != tuple(t.shape):
            raise CheckpointError(
                f"{name}: shape {tuple(t.shape)} does not fit the model's {None if meta is None else tuple(meta.shape)}"
            )
        dtype = torch.bfloat16 if held_bf16(name, backends) else meta.dtype
        if dtype != t.dtype and not torch.equal(t.to(dtype).to(t.dtype), t):
            raise CheckpointError(f"{name}: values not exact in {dtype}; load this checkpoint dense")
        value = _placed(t, device, dtype)
        if leaf in dict(module.named_parameters(recurse=False)):
            setattr(module, leaf, nn.Parameter(value, requires_grad=False))
        else:
            setattr(module, leaf, value)
