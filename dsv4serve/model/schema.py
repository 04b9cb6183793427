"""Every tensor a DeepSeek-V4 checkpoint holds, derived from ModelArgs alone.

This is the one list of parameters: the loader validates checkpoints against it, the memory planner
sums its bytes, and the model registers its parameters from it. Names are the official checkpoint
names (`layers.7.attn.wq_a.weight`, `mtp.0.e_proj.weight`); shapes are storage shapes (FP4 experts
are [out, in/2] int8). Source: dsv4-model.md §3.2, checked against the real 69,187-tensor list.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from dsv4serve.model.args import ModelArgs

# safetensors dtype name -> torch dtype
TORCH_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "I32": torch.int32,
    "I64": torch.int64,
}
SAFETENSORS_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}
DTYPE_BYTES = {name: torch.empty((), dtype=dt).element_size() for name, dt in TORCH_DTYPES.items()}

Role = Literal["dense", "fp8_weight", "fp8_scale", "fp4_weight", "fp4_scale", "index"]
Group = Literal[
    "embed",
    "head",
    "attention",
    "compressor",
    "indexer",
    "hc_norm",
    "router",
    "routed_experts",
    "shared_experts",
    "mtp_proj",
]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    role: Role
    group: Group
    layer: int | None  # block index (MTP blocks follow the main layers); None for top-level tensors
    expert: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Builder:
    """Emits specs for one block or the top level, knowing how the checkpoint stores each kind."""

    def __init__(self, args: ModelArgs, layer: int | None, prefix: str):
        self.a, self.layer, self.prefix = args, layer, prefix
        self.dense_dtype = "BF16" if args.dtype in ("fp8", "bf16") else "F32"

    def spec(
        self, name: str, dtype: str, shape: tuple[int, ...], role: Role, group: Group, expert: int | None = None
    ) -> TensorSpec:
        return TensorSpec(self.prefix + name, dtype, shape, role, group, self.layer, expert)

    def dense(self, name: str, shape: tuple[int, ...], group: Group) -> Iterator[TensorSpec]:
        yield self.spec(name, self.dense_dtype, shape, "dense", group)

    def fp32(self, name: str, shape: tuple[int, ...], group: Group) -> Iterator[TensorSpec]:
        yield self.spec(name, "F32", shape, "dense", group)

    def linear(self, name: str, out_dim: int, in_dim: int, group: Group) -> Iterator[TensorSpec]:
        """A projection that the official checkpoint stores in FP8 with 128x128 block scales."""
        if self.a.dtype != "fp8":
            yield from self.dense(f"{name}.weight", (out_dim, in_dim), group)
            return
        bo, bi = self.a.weight_block_size
        yield self.spec(f"{name}.weight", "F8_E4M3", (out_dim, in_dim), "fp8_weight", group)
        yield self.spec(f"{name}.scale", "F8_E8M0", (_cdiv(out_dim, bo), _cdiv(in_dim, bi)), "fp8_scale", group)

    def expert_linear(self, name: str, out_dim: int, in_dim: int, expert: int) -> Iterator[TensorSpec]:
        kind = self.a.expert_dtype
        if kind == "fp4":
            yield self.spec(f"{name}.weight", "I8", (out_dim, in_dim // 2), "fp4_weight", "routed_experts", expert)
            yield self.spec(f"{name}.scale", "F8_E8M0", (out_dim, in_dim // 32), "fp4_scale", "routed_experts", expert)
        elif kind == "fp8":
            bo, bi = self.a.weight_block_size
            yield self.spec(f"{name}.weight", "F8_E4M3", (out_dim, in_dim), "fp8_weight", "routed_experts", expert)
            yield self.spec(
                f"{name}.scale",
                "F8_E8M0",
                (_cdiv(out_dim, bo), _cdiv(in_dim, bi)),
                "fp8_scale",
                "routed_experts",
                expert,
            )
        else:
            yield self.spec(f"{name}.weight", self.dense_dtype, (out_dim, in_dim), "dense", "routed_experts", expert)


def _hc(b: _Builder, name: str, n_mix: int, n_scales: int) -> Iterator[TensorSpec]:
    """Hyper-connection mixing: a site mixes (2 + hc) * hc values with 3 scales; the head hc with 1."""
    a = b.a
    yield from b.fp32(f"{name}_fn", (n_mix, a.hc_mult * a.dim), "hc_norm")
    yield from b.fp32(f"{name}_base", (n_mix,), "hc_norm")
    yield from b.fp32(f"{name}_scale", (n_scales,), "hc_norm")


def _compressor(b: _Builder, prefix: str, ratio: int, head_dim: int, group: Group) -> Iterator[TensorSpec]:
    coff = 2 if ratio == 4 else 1  # CSA windows overlap: each token feeds two windows
    yield from b.dense(f"{prefix}.wkv.weight", (coff * head_dim, b.a.dim), group)
    yield from b.dense(f"{prefix}.wgate.weight", (coff * head_dim, b.a.dim), group)
    yield from b.fp32(f"{prefix}.ape", (ratio, coff * head_dim), group)
    yield from b.dense(f"{prefix}.norm.weight", (head_dim,), group)


def _block(a: ModelArgs, layer: int, prefix: str) -> Iterator[TensorSpec]:
    b = _Builder(a, layer, prefix)
    n_mix = (2 + a.hc_mult) * a.hc_mult
    yield from b.dense("attn_norm.weight", (a.dim,), "hc_norm")
    yield from b.dense("ffn_norm.weight", (a.dim,), "hc_norm")
    yield from _hc(b, "hc_attn", n_mix, 3)
    yield from _hc(b, "hc_ffn", n_mix, 3)
    # attention
    yield from b.fp32("attn.attn_sink", (a.n_heads,), "attention")
    yield from b.linear("attn.wq_a", a.q_lora_rank, a.dim, "attention")
    yield from b.dense("attn.q_norm.weight", (a.q_lora_rank,), "attention")
    yield from b.linear("attn.wq_b", a.n_heads * a.head_dim, a.q_lora_rank, "attention")
    yield from b.linear("attn.wkv", a.head_dim, a.dim, "attention")
    yield from b.dense("attn.kv_norm.weight", (a.head_dim,), "attention")
    yield from b.linear("attn.wo_a", a.o_groups * a.o_lora_rank, a.n_heads * a.head_dim // a.o_groups, "attention")
    yield from b.linear("attn.wo_b", a.dim, a.o_groups * a.o_lora_rank, "attention")
    ratio = a.compress_ratios[layer]
    if ratio:
        yield from _compressor(b, "attn.compressor", ratio, a.head_dim, "compressor")
    if a.kind(layer) == "csa":
        yield from b.linear("attn.indexer.wq_b", a.index_n_heads * a.index_head_dim, a.q_lora_rank, "indexer")
        yield from b.dense("attn.indexer.weights_proj.weight", (a.index_n_heads, a.dim), "indexer")
        yield from _compressor(b, "attn.indexer.compressor", ratio, a.index_head_dim, "indexer")
    # MoE
    yield from b.dense("ffn.gate.weight", (a.n_routed_experts, a.dim), "router")
    if a.is_hash_layer(layer):
        yield b.spec("ffn.gate.tid2eid", "I64", (a.vocab_size, a.n_activated_experts), "index", "router")
    else:
        yield from b.fp32("ffn.gate.bias", (a.n_routed_experts,), "router")
    for e in range(a.n_routed_experts):
        yield from b.expert_linear(f"ffn.experts.{e}.w1", a.moe_inter_dim, a.dim, e)
        yield from b.expert_linear(f"ffn.experts.{e}.w3", a.moe_inter_dim, a.dim, e)
        yield from b.expert_linear(f"ffn.experts.{e}.w2", a.dim, a.moe_inter_dim, e)
    shared = a.n_shared_experts * a.moe_inter_dim
    yield from b.linear("ffn.shared_experts.w1", shared, a.dim, "shared_experts")
    yield from b.linear("ffn.shared_experts.w3", shared, a.dim, "shared_experts")
    yield from b.linear("ffn.shared_experts.w2", a.dim, shared, "shared_experts")


def _mtp_extras(a: ModelArgs, layer: int, prefix: str) -> Iterator[TensorSpec]:
    b = _Builder(a, layer, prefix)
    yield from b.linear("e_proj", a.dim, a.dim, "mtp_proj")
    yield from b.linear("h_proj", a.dim, a.dim, "mtp_proj")
    yield from b.dense("enorm.weight", (a.dim,), "mtp_proj")
    yield from b.dense("hnorm.weight", (a.dim,), "mtp_proj")
    yield from b.dense("norm.weight", (a.dim,), "mtp_proj")
    yield from _hc(b, "hc_head", a.hc_mult, 1)


def checkpoint_schema(args: ModelArgs, include_mtp: bool = True) -> list[TensorSpec]:
    """Every tensor of a checkpoint for `args`, in checkpoint order (embed, layers, head, MTP)."""
    top = _Builder(args, None, "")
    specs: list[TensorSpec] = []
    specs += top.dense("embed.weight", (args.vocab_size, args.dim), "embed")
    for i in range(args.n_layers):
        specs += _block(args, i, f"layers.{i}.")
    specs += top.dense("head.weight", (args.vocab_size, args.dim), "head")
    specs += top.dense("norm.weight", (args.dim,), "hc_norm")
    specs += _hc(top, "hc_head", args.hc_mult, 1)
    if include_mtp:
        for j in range(args.n_mtp_layers):
            layer = args.n_layers + j
            specs += _block(args, layer, f"mtp.{j}.")
            specs += _mtp_extras(args, layer, f"mtp.{j}.")
    return specs


def schema_bytes(specs: list[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)
