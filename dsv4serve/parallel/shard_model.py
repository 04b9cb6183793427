"""Cut a model built whole (model/random_init.random_model, or the dense loader's) down to one rank's part.

    shard_model(model, partition, tp) -> the same model, holding only rank `tp.rank`'s parts

Which part of every tensor a rank keeps is partition.py's alone (`Partition.shard_slice` on the model's
state-dict names, which are the checkpoint's): attention heads (wq_b rows, attn_sink, wo_a groups, wo_b input
columns), the shared expert's w1 / w3 rows and w2 columns, the routed experts owned (expert parallel: the
others are dropped) or split like the shared expert, embed and head by vocabulary rows; the rest whole. Then
the modules learn their local sizes (heads, groups, experts not owned) and get `tp`, through which their
partial sums are reduced (model/attention.py, moe.py, transformer.py).

Shard before `use_kernels` or any packing: the packed FP8 / MXFP4 copies are not state-dict tensors.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from dsv4serve.model.attention import Attention
from dsv4serve.model.layers import Linear, TensorParallel
from dsv4serve.model.moe import MoE
from dsv4serve.model.transformer import Transformer
from dsv4serve.parallel.partition import Partition

_EXPERT_RE = re.compile(r"^(.*\.ffn)\.experts\.(\d+)\.")


def shard_model(model: Transformer, partition: Partition, tp: TensorParallel) -> Transformer:
    """Keep rank `tp.rank`'s part of every tensor of `model` (in place) and hand its modules `tp`."""
    if partition.tp_size != tp.size:
        raise ValueError(f"a partition for {partition.tp_size} ranks cannot serve a group of {tp.size}")
    _refuse_packed(model)
    dropped: dict[str, set[int]] = {}  # MoE module path -> experts another rank owns
    with torch.no_grad():
        for name, tensor in list(model.state_dict().items()):
            cut = partition.shard_slice(name, tuple(tensor.shape), tp.rank)
            if cut is None:
                m = _EXPERT_RE.match(name)
                if m is None:
                    raise ValueError(f"{name}: only routed experts may be held by another rank alone")
                dropped.setdefault(m.group(1), set()).add(int(m.group(2)))
            elif any((s.start, s.stop) != (0, n) for s, n in zip(cut, tensor.shape)):
                _replace(model, name, tensor[cut].contiguous())
    for path, experts in dropped.items():
        moe = model.get_submodule(path)
        assert isinstance(moe, MoE)
        for e in experts:
            moe.experts[e] = nn.Module()  # a placeholder keeps the others' indices; it holds nothing
        moe.not_owned = frozenset(experts)
    _localize(model, tp)
    return model


def _refuse_packed(model: Transformer) -> None:
    for name, module in model.named_modules():
        packed = isinstance(module, Linear) and module.weight_fp8 is not None
        if packed or (isinstance(module, MoE) and module.w1_fp4 is not None):
            raise ValueError(f"{name}: holds packed weights; shard the dense model, then call use_kernels")


def _replace(model: Transformer, name: str, value: torch.Tensor) -> None:
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    old = getattr(module, attr)
    if isinstance(old, nn.Parameter):
        setattr(module, attr, nn.Parameter(value, requires_grad=old.requires_grad))
    else:
        raise ValueError(f"{name}: a split buffer ({type(old).__name__}) is not expected by the partition")


def _localize(model: Transformer, tp: TensorParallel) -> None:
    """Tell the modules their local sizes and give them `tp`; check the sizes against the cut weights."""
    model.tp = tp
    model.embed.num_embeddings = model.embed.weight.shape[0]
    for module in model.modules():
        if isinstance(module, Attention):
            heads = module.attn_sink.shape[0]
            module.n_groups = module.n_groups * heads // module.n_heads
            module.n_heads = heads
            if module.wq_b.weight.shape[0] != heads * module.head_dim:
                raise ValueError(f"layer {module.layer_id}: wq_b rows do not hold the rank's {heads} heads")
            if module.wo_a.weight.shape[0] != module.n_groups * module.o_lora_rank:
                raise ValueError(f"layer {module.layer_id}: wo_a rows do not hold the rank's {module.n_groups} groups")
            module.tp = tp
        elif isinstance(module, MoE):
            module.tp = tp
            module.experts_split = not module.not_owned and tp.size > 1
