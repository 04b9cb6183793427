"""Which part of every checkpoint tensor each of T tensor-parallel ranks holds (pure: no tensor is read).

    make_partition(args, tp_size, expert_parallel) -> Partition     refuses a T that breaks a rule, naming it
    Partition.shard_slice(name, shape, rank) -> tuple[slice, ...] | None   what `rank` reads (None: nothing)
    rank_specs(specs, partition, rank) -> list[TensorSpec]           the specs at their shard shapes
    rank_bytes(args, tp_size, expert_parallel) -> [{kind: bytes}]   checkpoint bytes each rank reads
    shard_byte_ranges(shape, itemsize, slices) -> [(start, end)]    where a shard lies in the safetensors data

The rules (dsv4-model.md §2.2-2.9; the head layout is the reference's: wq_b's rows are head-major, wo_a is
o_groups blocks of o_lora_rank rows, each block projecting its own n_heads / o_groups heads):
- attention heads split: `wq_b` column parallel (rows of whole heads), `attn_sink` by head, `wo_a` by whole
  output groups (its rows; a group's input is its own heads, so a rank holding groups [g0, g1) holds exactly
  the heads its wq_b rows made), `wo_b` row parallel (its input is the concatenated groups); one all-reduce.
- `wq_a` and `q_norm` replicated: q_norm is an RMSNorm over the whole q_lora_rank vector, so a column split
  would need an all-gather before the norm; and qr feeds the replicated indexer too. 4 MiB a layer.
- `wkv` / `kv_norm` replicated: the single K=V head is read by every query head (MQA), so every rank needs
  all of it; the KV cache is therefore whole on every rank too, not 1/T.
- compressors and the indexer replicated: the compressors pool that single head. The indexer could split
  by indexer head (DeepSeek's reference does, then sums the partial scores across ranks before the top-k),
  but that sum is an all-reduce of [tokens, compressed entries] per CSA layer (growing with the context)
  and its order makes the top-k differ from one rank's at ties: replicated is exact and communication-free.
- routed experts: with expert parallelism owned whole, contiguously (rank r owns [r*E/T, (r+1)*E/T));
  without it each expert split like the shared expert. Shared expert: w1 / w3 column, w2 row parallel.
- router (`gate`), norms, hyper-connection mixing, MTP's e_proj / h_proj: replicated (tiny, or their
  outputs must be whole on every rank: the residual streams are).
- `embed` and `head` by vocabulary rows (a masked lookup + all-reduce; logits gathered for sampling).

A split must fall on every block boundary of the tensor's quantization: FP8 weights' 128x128 scale blocks
(the split dim's shard a multiple of 128, so each rank's `.scale` rows or columns are whole and its per-128
activation quantization is the single-GPU one), MXFP4's 32-wide K scale groups (16 packed bytes); and on
whole heads / groups / experts. A T that breaks one is refused with the tensor, dim and block named.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from dsv4serve.model.args import ModelArgs
from dsv4serve.model.schema import TensorSpec, checkpoint_schema

Placement = Literal["replicated", "split", "owned"]


class PartitionError(ValueError):
    """A tensor-parallel size this model cannot be split into exactly."""


@dataclass(frozen=True)
class Rule:
    placement: Placement
    dim: int | None = None  # split: the storage dim cut into T equal contiguous parts
    owner: int | None = None  # owned: the one rank holding the whole tensor
    why: str = ""


REPLICATED = Rule("replicated", why="replicated")
_BLOCK_RE = re.compile(r"^(?:layers|mtp)\.\d+\.")
_EXPERT_RE = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
# suffix within a block -> (dim, why); `.scale` tensors follow their weight
_SPLIT_IN_BLOCK = {
    "attn.attn_sink": (0, "attention heads"),
    "attn.wq_b": (0, "column parallel: attention heads"),
    "attn.wo_a": (0, "whole output groups (their heads)"),
    "attn.wo_b": (1, "row parallel: output groups"),
    "ffn.shared_experts.w1": (0, "column parallel"),
    "ffn.shared_experts.w3": (0, "column parallel"),
    "ffn.shared_experts.w2": (1, "row parallel"),
}
_SPLIT_TOP = {"embed.weight": (0, "vocabulary"), "head.weight": (0, "vocabulary")}


def _base(name: str) -> str:
    """`layers.7.attn.wq_b.scale` -> `attn.wq_b`; top-level names are kept whole."""
    inner = _BLOCK_RE.sub("", name)
    if inner == name:
        return name
    return inner.rsplit(".", 1)[0] if inner.endswith((".weight", ".scale")) else inner


def tensor_rule(spec: TensorSpec, args: ModelArgs, tp_size: int, expert_parallel: bool) -> Rule:
    """The placement of one checkpoint tensor (no divisibility checked here: make_partition does)."""
    if tp_size == 1:
        return REPLICATED
    if spec.name in _SPLIT_TOP:
        dim, why = _SPLIT_TOP[spec.name]
        return Rule("split", dim, why=why)
    inner = _BLOCK_RE.sub("", spec.name)
    m = _EXPERT_RE.match(inner)
    if m:
        if expert_parallel:
            per_rank = args.n_routed_experts // tp_size
            return Rule("owned", owner=int(m.group(1)) // per_rank, why="expert parallel")
        dim = 1 if m.group(2) == "w2" else 0
        return Rule("split", dim, why="row parallel" if dim else "column parallel")
    hit = _SPLIT_IN_BLOCK.get(_base(spec.name))
    return Rule("split", hit[0], why=hit[1]) if hit else REPLICATED


def _unit(spec: TensorSpec, args: ModelArgs, dim: int) -> int:
    """Storage elements along `dim` a shard must hold whole multiples of: the structure's unit (a head of
    wq_b's rows, an output group of wo_a's rows or wo_b's columns) and the quantization block (an FP8
    weight's 128 x 128 scale block, MXFP4's 32 K values per scale = 16 packed bytes along dim 1)."""
    base, scale = _base(spec.name), spec.role in ("fp8_scale", "fp4_scale")
    structure = 1
    if not scale and base == "attn.wq_b":
        structure = args.head_dim
    elif not scale and base in ("attn.wo_a", "attn.wo_b"):
        structure = args.o_lora_rank
    block = 1
    if spec.role == "fp8_weight":
        block = args.weight_block_size[dim]
    elif spec.role == "fp4_weight" and dim == 1:
        block = 16
    return math.lcm(structure, block)


def _check_split(spec: TensorSpec, rule: Rule, args: ModelArgs, tp_size: int) -> None:
    """Each shard whole units (scale tensors: an equal share of blocks, so they line up with the weight's)."""
    assert rule.dim is not None
    n, unit = spec.shape[rule.dim], _unit(spec, args, rule.dim)
    if n % tp_size or (n // tp_size) % unit:
        what = "block / unit" if unit > 1 else "element"
        raise PartitionError(
            f"--tensor-parallel-size {tp_size}: {spec.name} {list(spec.shape)} split along dim {rule.dim} "
            f"({rule.why}) gives shards of {n / tp_size:g}, not whole multiples of its {unit}-element {what}; "
            "use a size that divides it"
        )


@dataclass(frozen=True)
class Partition:
    args: ModelArgs
    tp_size: int
    expert_parallel: bool
    rules: Mapping[str, Rule]

    def shard_slice(self, name: str, shape: tuple[int, ...], rank: int) -> tuple[slice, ...] | None:
        """The slice of the stored tensor `rank` reads (safetensors get_slice order); None: it holds none."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} out of range for {self.tp_size} ranks")
        rule = self.rules[name]
        whole = tuple(slice(0, d) for d in shape)
        if rule.placement == "replicated":
            return whole
        if rule.placement == "owned":
            return whole if rule.owner == rank else None
        assert rule.dim is not None
        step = shape[rule.dim] // self.tp_size
        return whole[: rule.dim] + (slice(rank * step, (rank + 1) * step),) + whole[rule.dim + 1 :]

    def shard_shape(self, spec: TensorSpec, rank: int) -> tuple[int, ...] | None:
        sl = self.shard_slice(spec.name, spec.shape, rank)
        return None if sl is None else tuple(s.stop - s.start for s in sl)


def make_partition(
    args: ModelArgs, tp_size: int, expert_parallel: bool, specs: Iterable[TensorSpec] | None = None
) -> Partition:
    """Rules for every tensor of `specs` (the checkpoint schema by default), checked for exact splits."""
    if tp_size < 1:
        raise PartitionError(f"--tensor-parallel-size must be at least 1, got {tp_size}")
    if expert_parallel and args.n_routed_experts % tp_size:
        raise PartitionError(
            f"--expert-parallel over {tp_size} ranks: {args.n_routed_experts} routed experts do not divide "
            "evenly (each rank owns a contiguous, equal range)"
        )
    if tp_size > 1 and args.o_groups % tp_size:
        raise PartitionError(
            f"--tensor-parallel-size {tp_size}: attn.wo_a has {args.o_groups} output groups; a rank must hold "
            "whole groups (their heads), so the size must divide o_groups"
        )
    rules: dict[str, Rule] = {}
    for spec in checkpoint_schema(args) if specs is None else specs:
        rule = tensor_rule(spec, args, tp_size, expert_parallel)
        if rule.placement == "split":
            _check_split(spec, rule, args, tp_size)
        rules[spec.name] = rule
    return Partition(args, tp_size, expert_parallel, rules)


def rank_specs(specs: Iterable[TensorSpec], partition: Partition, rank: int) -> list[TensorSpec]:
    """The specs `rank` holds, at their shard shapes: the memory plan's weight sums work on them unchanged."""
    out = []
    for spec in specs:
        shape = partition.shard_shape(spec, rank)
        if shape is not None:
            out.append(dataclasses.replace(spec, shape=shape))
    return out


def weight_kind(spec: TensorSpec, args: ModelArgs) -> str:
    """The bytes-by-kind key: the schema group, with everything of the MTP block as 'mtp' (as `plan` prints)."""
    return "mtp" if spec.layer is not None and spec.layer >= args.n_layers else spec.group


def rank_bytes(args: ModelArgs, tp_size: int, expert_parallel: bool) -> list[dict[str, int]]:
    """Checkpoint bytes each rank reads, by kind: element [r] is rank r's {kind: bytes}."""
    specs = checkpoint_schema(args)
    part = make_partition(args, tp_size, expert_parallel, specs)
    out: list[dict[str, int]] = []
    for rank in range(tp_size):
        kinds: dict[str, int] = defaultdict(int)
        for spec in rank_specs(specs, part, rank):
            kinds[weight_kind(spec, args)] += spec.nbytes
        out.append(dict(kinds))
    return out


def shard_byte_ranges(shape: tuple[int, ...], itemsize: int, slices: tuple[slice, ...]) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of a row-major tensor's data that a slice cut along one dim covers, in order,
    adjacent runs merged: one range for a dim-0 cut, one per leading row for a dim-1 cut."""
    dims = [i for i, (s, d) in enumerate(zip(slices, shape)) if (s.start, s.stop) != (0, d)]
    if len(dims) > 1:
        raise ValueError(f"a shard is cut along one dim, not {dims}")
    if not dims:
        total = itemsize
        for d in shape:
            total *= d
        return [(0, total)] if total else []
    d = dims[0]
    inner = itemsize
    for n in shape[d + 1 :]:
        inner *= n
    outer = 1
    for n in shape[:d]:
        outer *= n
    stride, s = shape[d] * inner, slices[d]
    ranges: list[tuple[int, int]] = []
    for i in range(outer):
        start, end = i * stride + s.start * inner, i * stride + s.stop * inner
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], end)
        elif end > start:
            ranges.append((start, end))
    return ranges
