"""Weight bytes, from the checkpoint schema alone (pure: no tensor is read or allocated).

    weight_bytes(specs, args) -> WeightBytes        the checkpoint's bytes, split as the plan places them
    device_bytes(specs, args, backends, ...) -> PackedBytes   what the packed loader holds on the device
    loaded_weight_bytes(specs, args, backends) -> WeightBytes  the plan's split with the loaded sizes
    include_mtp(args, speculative_tokens) -> bool   whether the MTP block is loaded at all

The placement rules (`spec_kind`, `held_bf16`, the HELD_BF16 list) are the ones model/packed_load.py
follows when it loads, so the plan, the worker's fits check and what the worker really allocates are
one computation (tests/unit/test_memory_weights.py holds them equal).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch

from dsv4serve.model.args import ModelArgs
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.schema import DTYPE_BYTES, TensorSpec


def include_mtp(args: ModelArgs, speculative_tokens: int = 0) -> bool:
    """The one decision whether the MTP block (its weights, its experts, its KV) is loaded: only when
    speculative decoding drafts with it (--speculative-tokens N > 0) and the checkpoint has one."""
    return speculative_tokens > 0 and args.n_mtp_layers > 0


@dataclass(frozen=True)
class WeightBytes:
    non_expert_bytes: int  # main model, everything but routed experts
    routed_expert_bytes: int  # main model's routed experts
    mtp_bytes: int  # the whole MTP block (its experts included)
    expert_bytes: int  # one expert: w1 + w3 + w2 with scales = one slot
    n_experts: int  # routed experts over all main layers


def weight_bytes(specs: list[TensorSpec], args: ModelArgs) -> WeightBytes:
    non_expert = routed = mtp = 0
    one: dict[tuple[int | None, int | None], int] = {}  # (layer, expert) -> bytes; only counted and maxed
    for s in specs:
        if s.layer is not None and s.layer >= args.n_layers:
            mtp += s.nbytes
        elif s.group == "routed_experts":
            routed += s.nbytes
            one[(s.layer, s.expert)] = one.get((s.layer, s.expert), 0) + s.nbytes
        else:
            non_expert += s.nbytes
    per_expert = max(one.values(), default=0)
    return WeightBytes(non_expert, routed, mtp, per_expert, len(one))


# the dtype of every tensor loaded dense: the model's parameters are fp32 (the dense loader's default,
# which the engine uses), so the torch paths compute exactly as on a dense-loaded model
DENSE_DTYPE = torch.float32
# FP8-stored projections that the model runs dense (attention.py: the reference dequantizes wo_a and
# runs it as a grouped einsum); load_packed checks this list against the modules it fills
FP8_RUN_DENSE = (".attn.wo_a.weight", ".attn.wo_a.scale")
# dense tensors held in bf16 instead of DENSE_DTYPE, each exact in bf16 and used at bf16 by the model: the
# embedding (stored bf16; its rows are looked up, then cast to the compute dtype) and wo_a (FP8 stored:
# e4m3 times a power of two has at most 4 significant bits, exact in bf16; attention._project_out runs
# the grouped einsum in the weight's dtype, bf16, as the reference runs its dequantized wo_a). Together
# 3.7 GiB less than fp32 on DeepSeek-V4-Flash; `_load_dense` checks the exactness of every value. The head
# (stored bf16) joins them when its kernel is on Triton, which reads it as stored (HEAD_BF16; 0.99 GiB), and
# the compressors' wkv / wgate (stored bf16) when the compressor is on Triton, whose projection then runs on
# the head's kernel (model/compressor.py; COMPRESSOR_BF16: 0.49 GiB less on DeepSeek-V4-Flash), with the CSA
# indexer's head weights (stored bf16), which ride in its compressor's launch there (10.5 MiB less).
HELD_BF16 = ("embed.weight", ".attn.wo_a.weight")
HEAD_BF16 = "head.weight"
COMPRESSOR_BF16 = (".compressor.wkv.weight", ".compressor.wgate.weight", ".indexer.weights_proj.weight")

Kind = Literal["fp8_packed", "fp4_stacked", "dense", "bank"]


@dataclass(frozen=True)
class PackedBytes:
    """Device bytes of the packed path, split as the memory plan splits the checkpoint's bytes."""

    non_expert_bytes: int  # main model, everything but routed experts (buffers included)
    routed_expert_bytes: int  # main model's resident routed experts (0 with an expert-slot cache)
    mtp_bytes: int  # the MTP blocks, their experts included

    @property
    def total_bytes(self) -> int:
        return self.non_expert_bytes + self.routed_expert_bytes + self.mtp_bytes


def spec_kind(spec: TensorSpec, backends: KernelBackends, experts_resident: bool) -> Kind:
    """How the packed path places one checkpoint tensor (a `.scale` goes where its weight goes)."""
    if spec.group == "routed_experts":
        if not experts_resident:
            return "bank"
        return "fp4_stacked" if backends.fp4_moe == "triton" and spec.role in ("fp4_weight", "fp4_scale") else "dense"
    if (
        backends.fp8_gemm == "triton"
        and spec.role in ("fp8_weight", "fp8_scale")
        and not spec.name.endswith(FP8_RUN_DENSE)
    ):
        return "fp8_packed"
    return "dense"


def held_bf16(name: str, backends: KernelBackends) -> bool:
    """True for a dense tensor the packed path holds in bf16 (HELD_BF16; HEAD_BF16 with head=triton;
    COMPRESSOR_BF16 with compressor=triton)."""
    return (
        name == HELD_BF16[0]
        or name.endswith(HELD_BF16[1:])
        or (name == HEAD_BF16 and backends.head == "triton")
        or (name.endswith(COMPRESSOR_BF16) and backends.compressor == "triton")
    )


def model_specs(ckpt_specs: Iterable[TensorSpec], args: ModelArgs, include_mtp: bool) -> list[TensorSpec]:
    """The checkpoint tensors a model with or without its MTP blocks holds."""
    return [s for s in ckpt_specs if include_mtp or s.layer is None or s.layer < args.n_layers]


def _dense_bytes(spec: TensorSpec, backends: KernelBackends) -> int:
    """Device bytes of one tensor loaded dense: float tensors in DENSE_DTYPE (bf16 if `held_bf16`) at their
    dense shape (FP4 packs two values a byte), scales consumed, integers (tid2eid) as the model holds
    them (int64)."""
    if spec.role in ("fp8_scale", "fp4_scale"):
        return 0
    numel = spec.numel * (2 if spec.role == "fp4_weight" else 1)
    if spec.role == "index":
        return numel * torch.empty((), dtype=torch.int64).element_size()
    dtype = torch.bfloat16 if held_bf16(spec.name, backends) else DENSE_DTYPE
    return numel * torch.empty((), dtype=dtype).element_size()


def device_bytes(
    specs: Iterable[TensorSpec],
    args: ModelArgs,
    backends: KernelBackends,
    include_mtp: bool,
    experts_resident: bool = True,
) -> PackedBytes:
    """The bytes `load_packed` allocates on the device for these checkpoint specs (headers or schema,
    no data read); the expert-slot cache's own slots (experts_resident=False) are not included."""
    split = {"non_expert": 0, "routed": 0, "mtp": 0}
    for spec in model_specs(specs, args, include_mtp):
        kind = spec_kind(spec, backends, experts_resident)
        n = {"bank": 0, "dense": _dense_bytes(spec, backends)}.get(kind, spec.nbytes)
        part = (
            "mtp"
            if spec.layer is not None and spec.layer >= args.n_layers
            else "routed"
            if spec.group == "routed_experts"
            else "non_expert"
        )
        split[part] += n
    freqs_bytes = (args.rope_head_dim // 2) * DTYPE_BYTES["F32"]  # Attention.freqs, one per block
    n_mtp = args.n_mtp_layers if include_mtp else 0
    return PackedBytes(
        split["non_expert"] + args.n_layers * freqs_bytes, split["routed"], split["mtp"] + n_mtp * freqs_bytes
    )


ALL_TRITON = KernelBackends.every("triton")


def loaded_weight_bytes(specs: list[TensorSpec], args: ModelArgs, backends: KernelBackends = ALL_TRITON) -> WeightBytes:
    """The memory plan's weight split (weight_bytes) with the resident non-expert and MTP
    bytes as the CUDA worker loads them with `backends` (on CUDA by default every kernel on Triton):
    packed for the Triton kernels, the rest in fp32 or bf16 (held_bf16)."""
    loaded = device_bytes(specs, args, backends, include_mtp=True, experts_resident=False)
    return dataclasses.replace(
        weight_bytes(specs, args), non_expert_bytes=loaded.non_expert_bytes, mtp_bytes=loaded.mtp_bytes
    )
