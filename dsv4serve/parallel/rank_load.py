"""One tensor-parallel rank's part of the model, read from the checkpoint as that part alone.

    load_rank_dense(ckpt, partition, tp, device, include_mtp) -> Transformer
    load_rank_packed(ckpt, partition, tp, backends, device, include_mtp) -> Transformer   (the Triton GEMMs' path)

The model is built on the meta device (no memory), cut to the rank's shapes (shard_model.py, which also hands
the modules `tp` and their local sizes), given memory on `device`, and filled from the dense loader with the
rank's cut (checkpoint/loader.iter_dense `cut`: from the official layout only the rank's bytes are read, a
weight's slice dequantized with its scale's slice): no rank reads, or holds, the whole checkpoint. The packed
load (model/packed_load.fill_packed) takes the same cut: FP8 projections as their e4m3 / e8m0 slices, the routed
experts' MXFP4 stacks of the rank's slices (or, expert parallel, of its own experts), the rest dense.
"""

from __future__ import annotations

import dataclasses

import torch

from dsv4serve.checkpoint.loader import Checkpoint, iter_dense
from dsv4serve.memory.weights import model_specs
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.layers import TensorParallel
from dsv4serve.model.packed_load import check_packable, compute_buffers, fill_packed
from dsv4serve.model.transformer import Transformer
from dsv4serve.parallel.partition import Partition, rank_specs
from dsv4serve.parallel.shard_model import shard_model


def load_rank_dense(
    ckpt: Checkpoint,
    partition: Partition,
    tp: TensorParallel,
    device: torch.device,
    include_mtp: bool,
    progress: bool = True,
) -> Transformer:
    model = _cut_meta_model(ckpt, partition, tp, include_mtp)
    model.to_empty(device=device)
    compute_buffers(model, device)
    ckpt = dataclasses.replace(ckpt, specs=tuple(model_specs(ckpt.specs, ckpt.args, include_mtp)))

    def cut(name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        return partition.shard_slice(name, shape, tp.rank)

    model.load_state_dict(dict(iter_dense(ckpt, torch.float32, progress, cut)), strict=True)
    return model.eval()


def load_rank_packed(
    ckpt: Checkpoint,
    partition: Partition,
    tp: TensorParallel,
    backends: KernelBackends,
    device: torch.device,
    include_mtp: bool,
    progress: bool = True,
) -> Transformer:
    check_packable(ckpt, backends)
    model = _cut_meta_model(ckpt, partition, tp, include_mtp)
    specs = rank_specs(model_specs(ckpt.specs, ckpt.args, include_mtp), partition, tp.rank)

    def cut(name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        return partition.shard_slice(name, shape, tp.rank)

    fill_packed(model, ckpt, specs, backends, device, True, progress, cut)
    return model.eval()


def _cut_meta_model(ckpt: Checkpoint, partition: Partition, tp: TensorParallel, include_mtp: bool) -> Transformer:
    """The model at the rank's shapes, on the meta device (no memory yet), its modules holding `tp`."""
    with torch.device("meta"):
        model = Transformer(ckpt.args, include_mtp=include_mtp)
    return shard_model(model, partition, tp)
