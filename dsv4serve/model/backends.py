"""Which implementation runs each kernel-backed step of the model: the torch reference or Triton.

One field per kernel of kernels/dsv4_kernels: `attention` (paged sparse attention), `indexer`
(lightning-indexer scores + top-k), `compressor` (the compressor's softmax pooling), `fp8_gemm`
(projections stored in FP8), `fp4_moe` (the routed experts, MXFP4), `head` (the output head, fp32
logits from the bf16 weight as stored), `hc` (the mHC mixing: hc_pre, hc_post and the HC head, one
launch each instead of ~120 small torch ops), `token_ops` (the per-token chains around the GEMMs: RMSNorm,
q / kv norm + RoPE + FP8 simulation, the indexer query, inverse RoPE, compressor entries; one launch each),
`router` (the MoE gate: logits, scores, top-k with bias or hash ids, normalized weights; two launches,
one on a hash layer). The shared expert has no field of its own: it is FP8-stored, and with `fp8_gemm`
on Triton it runs as two FP8 launches (w1 + w3 with the SwiGLU epilogue, then w2).
The setting travels inside
`Numerics`, the frozen value every model function already receives, so dispatch needs no model
state beyond the packed weights that `Transformer.use_kernels` prepares.

A setting string names kernels left to right: "all=triton,fp4_moe=torch" puts every kernel on
Triton but the MoE; a kernel not named keeps the base (the device default unless given).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Literal, cast

import torch

Backend = Literal["torch", "triton"]
BACKENDS: tuple[str, ...] = ("torch", "triton")


@dataclass(frozen=True)
class KernelBackends:
    attention: Backend = "torch"
    indexer: Backend = "torch"
    compressor: Backend = "torch"
    fp8_gemm: Backend = "torch"
    fp4_moe: Backend = "torch"
    head: Backend = "torch"
    hc: Backend = "torch"
    token_ops: Backend = "torch"
    router: Backend = "torch"

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) not in BACKENDS:
                raise ValueError(f"kernel backend {f.name}={getattr(self, f.name)!r}: expected one of {BACKENDS}")

    @classmethod
    def every(cls, backend: Backend) -> KernelBackends:
        return cls(**{name: backend for name in kernel_names()})

    def uses_triton(self) -> bool:
        return any(getattr(self, name) == "triton" for name in kernel_names())


TORCH = KernelBackends()


def kernel_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(KernelBackends))


def default_backends(device: torch.device | str) -> KernelBackends:
    """Triton for every kernel on a CUDA device; torch elsewhere (Triton needs a GPU outside tests)."""
    return KernelBackends.every("triton" if torch.device(device).type == "cuda" else "torch")


def parse_backends(spec: str, base: KernelBackends = TORCH) -> KernelBackends:
    """ "attention=triton,fp4_moe=torch" or "all=triton" (applied left to right over `base`).

    Raises ValueError naming the part that is malformed, the unknown kernel or the unknown backend.
    """
    names = kernel_names()
    result = base
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            if spec.strip():
                raise ValueError(f"kernel backends {spec!r}: empty part (a stray comma?)")
            continue
        kernel, sep, backend = (s.strip() for s in part.partition("="))
        if not sep or not kernel or not backend:
            raise ValueError(f"kernel backends {spec!r}: part {part!r} is not KERNEL=BACKEND")
        if backend not in BACKENDS:
            raise ValueError(
                f"kernel backends {spec!r}: part {part!r} names backend {backend!r}; expected one of {BACKENDS}"
            )
        if kernel == "all":
            result = KernelBackends.every(backend)  # type: ignore[arg-type]
        elif kernel in names:
            result = replace(result, **{kernel: cast(Backend, backend)})
        else:
            raise ValueError(
                f"kernel backends {spec!r}: part {part!r} names kernel {kernel!r}; expected 'all' or one of {names}"
            )
    return result


def resolve_backends(spec: str, base: KernelBackends) -> KernelBackends:
    """--kernels as given: "auto" is `base` (the device default), anything else `parse_backends` over it."""
    return base if spec.strip() == "auto" else parse_backends(spec, base)


def named_kernels(spec: str) -> frozenset[str]:
    """The kernels a setting string names explicitly ("all" names every one; "auto" none), for the
    start-up kernel check: a kernel the user asked for by name is never swapped behind their back."""
    if spec.strip() == "auto":
        return frozenset()
    named = {part.partition("=")[0].strip() for part in spec.split(",") if part.strip()}
    return frozenset(kernel_names()) if "all" in named else frozenset(named & set(kernel_names()))
