"""Seeded random dense weights for a `ModelArgs`, under the official names (tests, benchmarks, the
worker's start-up kernel check): `random_dense_state` on the CPU, `random_model` drawn on a device.

Shapes come from `checkpoint_schema`; FP8/FP4 tensors are given dense (an FP4 [out, in/2] int8
weight becomes [out, in]) and `.scale` tensors are skipped, as the model holds dequantized weights.
Parameters that transformers initializes to constants (HC scale/base, sinks, `ape`, router bias,
norm weights) are randomized too, so a parity test exercises them.
"""

from __future__ import annotations

import torch

from dsv4serve.model.args import ModelArgs
from dsv4serve.model.schema import TensorSpec, checkpoint_schema


def dense_shape(spec: TensorSpec) -> tuple[int, ...]:
    if spec.role == "fp4_weight":
        return (spec.shape[0], 2 * spec.shape[1])
    return spec.shape


def _sample(spec: TensorSpec, shape: tuple[int, ...], args: ModelArgs, g: torch.Generator) -> torch.Tensor:
    name = spec.name
    normal = torch.randn(shape, generator=g)
    if name.endswith("tid2eid"):
        ranks = torch.rand(args.vocab_size, args.n_routed_experts, generator=g).argsort(dim=-1)
        return ranks[:, : args.n_activated_experts].contiguous()
    if name == "embed.weight":
        return normal
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * normal
    if name.endswith("_fn"):
        return normal * shape[1] ** -0.5
    if name.endswith("_base"):
        return 0.5 * normal
    if name.endswith("_scale"):
        return 0.5 + torch.rand(shape, generator=g)
    if name.endswith(("attn_sink", "ape")):
        return 0.5 * normal
    if name.endswith("gate.bias"):
        return 0.3 * normal
    return normal * shape[-1] ** -0.5  # projections: unit-variance outputs for unit inputs


def random_dense_state(args: ModelArgs, seed: int, include_mtp: bool = True) -> dict[str, torch.Tensor]:
    """{official name: dense fp32 tensor (int64 for tid2eid)} for every non-`.scale` tensor."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for spec in checkpoint_schema(args, include_mtp=include_mtp):
        if spec.role in ("fp8_scale", "fp4_scale"):
            continue
        out[spec.name] = _sample(spec, dense_shape(spec), args, g)
    return out


def random_model(args: ModelArgs, device: torch.device | str, seed: int, include_mtp: bool = True):
    """A Transformer on `device` with these rules' weights, drawn one tensor at a time on the device (a
    CPU state dict at real dimensions would take minutes and ~100 GB), each rounded to what its storage
    holds, as a real checkpoint's are: FP8 / FP4 weights (the Triton kernels' packing checks that they
    are exact) and bf16 ones (the head kernel reads the head so)."""
    from dsv4_kernels.formats import dequant_fp4, dequant_fp8_block, quant_fp4, quant_fp8_block
    from dsv4serve.model.transformer import Transformer  # lazy: the model imports none of this module

    with torch.device(device):
        model = Transformer(args, include_mtp=include_mtp).eval()
        params = model.state_dict()
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for spec in checkpoint_schema(args, include_mtp=include_mtp):
                if spec.role in ("fp8_scale", "fp4_scale"):
                    continue
                value = _sample(spec, dense_shape(spec), args, gen)
                if spec.role == "fp8_weight":
                    value = dequant_fp8_block(*quant_fp8_block(value))
                elif spec.role == "fp4_weight":
                    value = dequant_fp4(*quant_fp4(value))
                elif spec.dtype == "BF16":
                    value = value.to(torch.bfloat16)
                params[spec.name].copy_(value)
    return model
