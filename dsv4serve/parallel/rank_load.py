"""One tensor-parallel rank's part of the model, read from the checkpoint as that part alone.

    load_rank_dense(ckpt, partition, tp, device, include_mtp) -> Transformer

The model is built on the meta device (no memory), cut to the rank's shapes (shard_model.py, which also hands
the modules `tp` and their local sizes), given memory on `device`, and filled from the dense loader with the
rank's cut (checkpoint/loader.iter_dense `cut`: from the official layout only the rank's bytes are read, a
weight's slice dequantized with its scale's slice): no rank reads, or holds, the whole checkpoint.
"""

from __future__ import annotations

import dataclasses

import torch

from dsv4serve.checkpoint.loader import Checkpoint, iter_dense
from dsv4serve.memory.weights import model_specs
from dsv4serve.model.layers import TensorParallel
from dsv4serve.model.packed_load import compute_buffers
from dsv4serve.model.transformer import Transformer
from dsv4serve.parallel.partition import Partition
from dsv4serve.parallel.shard_model import shard_model


def load_rank_dense(
    ckpt: Checkpoint,
    partition: Partition,
    tp: TensorParallel,
    device: torch.device,
    include_mtp: bool,
    progress: bool = True,
) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ckpt.args, include_mtp=include_mtp)
    shard_model(model, partition, tp)
    model.to_empty(device=device)
    compute_buffers(model, device)
    ckpt = dataclasses.replace(ckpt, specs=tuple(model_specs(ckpt.specs, ckpt.args, include_mtp)))

    def cut(name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        return partition.shard_slice(name, shape, tp.rank)

    model.load_state_dict(dict(iter_dense(ckpt, torch.float32, progress, cut)), strict=True)
    return model.eval()
