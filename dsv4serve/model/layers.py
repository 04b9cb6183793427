"""Small building blocks: the projection module and RMSNorm (statistics and weight product in fp32), and the
`TensorParallel` interface through which a model split over ranks reduces its partial sums."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from dsv4_kernels.formats import dequant_fp8_block, quant_fp8_block
from dsv4serve.model.numerics import ACT_BLOCK, Numerics, fp8_quant_dequant, linear, row_product


class TensorParallel(Protocol):
    """The collectives of a model split over `size` ranks (dsv4serve.parallel.collectives.Collectives). The
    model holds one only when split (size > 1); unsplit, no module calls any of this."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def all_reduce_sum(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """The element-wise sum of every rank's x (same shape and dtype); x may be reduced in place, so the
        model passes tensors it made for this."""
        ...

    def all_gather(self, x: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        """Every rank's x concatenated along `dim`, in rank order."""
        ...

    def reset(self) -> None:
        """A step starts: the calls counted so far are forgotten (what is counted is the last step's)."""
        ...


class Linear(nn.Module):
    """A bias-free projection; `fp8_act` marks one the checkpoint stores in FP8 or FP4 (`fp4_weight`:
    MXFP4, the routed experts). With `num.backends.fp8_gemm == "triton"` an FP8-stored projection runs
    the FP8 block-scaled GEMM kernel on the packed copy that `pack_fp8` made, or that `load_fp8` took
    from the checkpoint; in the latter case there is no dense `weight` (None) and only the kernel runs."""

    def __init__(self, in_dim: int, out_dim: int, fp8_act: bool, fp4_weight: bool = False, row_parallel: bool = False):
        super().__init__()
        self.fp8_act, self.fp4_weight = fp8_act, fp4_weight
        # split over ranks along its input (parallel/partition.py): the torch path sums it as numerics.row_product
        # does, split or not, so that a split's shares add up to the unsplit product bit for bit
        self.row_parallel = row_parallel
        self.weight = nn.Parameter(torch.empty(out_dim, in_dim))
        # e4m3 [out, in] and e8m0 [ceil(out/128), ceil(in/128)]; not part of the state dict
        self.register_buffer("weight_fp8", None, persistent=False)
        self.register_buffer("weight_fp8_scale", None, persistent=False)

    @property
    def fp8_stored(self) -> bool:
        return self.fp8_act and not self.fp4_weight

    def pack_fp8(self) -> None:
        """Hold the weight as the checkpoint's FP8 blocks as well. The dense weight must be exactly such a
        dequantization (it is, when loaded from an FP8 checkpoint): re-quantizing must give it back."""
        w8, scale = quant_fp8_block(self.weight.detach())
        if not torch.equal(dequant_fp8_block(w8, scale), self.weight.detach().float()):
            raise ValueError(f"weight {tuple(self.weight.shape)} is not an exact FP8 128x128-block dequantization")
        self.weight_fp8, self.weight_fp8_scale = w8, scale

    def load_fp8(self, w8: torch.Tensor, scale: torch.Tensor) -> None:
        """Hold only the checkpoint's FP8 blocks (e4m3 [out, in], e8m0 [ceil(out/128), ceil(in/128)]), as
        `pack_fp8` would make them, and no dense weight: the packed loader's path, which never dequantizes."""
        if not self.fp8_stored:
            raise ValueError("only a projection the checkpoint stores in FP8 can hold packed FP8 weights")
        shape = tuple(self.weight.shape)
        if w8.dtype != torch.float8_e4m3fn or tuple(w8.shape) != shape:
            raise ValueError(f"packed FP8 weight {w8.dtype} {tuple(w8.shape)} does not fit {shape}")
        # typed Parameter for every reader: only an FP8-stored projection (read by the kernel alone, see
        # `forward`) drops it, a value-dependent fact that the attribute's type cannot carry
        self.weight = None  # type: ignore[assignment]
        self.weight_fp8, self.weight_fp8_scale = w8, scale

    def hold_k_major(self) -> None:
        """Re-store the dense weight [out, in] with `in` as the outer dimension (a transposed copy, viewed
        back as [out, in]: the same shape and values for every reader). For a wide fp32 projection on the CPU
        (the head: 129,280 x dim) MKL then streams the weight once per few rows of x (its axpy form) instead
        of taking one short dot product per output: 2.5 ms instead of 7 ms for one row of dsv4-tiny's head,
        and never slower up to 64 rows. For one or two rows the sums run in another order (logits move by
        ~1e-5); from a few rows on, MKL gives the same bits in both layouts."""
        w = self.weight
        if w is None or w.dim() != 2 or w.stride(0) == 1:
            return  # packed only, or K-major already
        with torch.inference_mode(False), torch.no_grad():
            self.weight = nn.Parameter(w.detach().t().contiguous().t(), requires_grad=w.requires_grad)

    def quantizes_in_kernel(self, num: Numerics) -> bool:
        """True when `forward` quantizes its input to FP8 inside its one kernel launch (an FP8-stored
        projection with fp8_gemm on Triton). A caller that feeds only such projections should then pass
        the raw activations instead of running `act_quant` first: the result is the same (quantizing
        is idempotent), minus ~15 torch launches."""
        return self.fp8_stored and num.backends.fp8_gemm == "triton"

    def forward(
        self, x: torch.Tensor | Normed, num: Numerics, x_quantized: bool = False, partial: bool = False
    ) -> torch.Tensor:
        """`partial`: a row-parallel shard's share of a sum over ranks, returned uncast (the dense torch path:
        fp64 under numerics.exact_sums, else the weight's dtype; the FP8 kernel: its fp32 accumulator) so that
        the all-reduce adds unrounded shares and the one cast to the compute dtype comes after it, as an
        unsplit GEMM's does (`row_parallel`: the unsplit projection takes the same path, numerics.row_product).
        x `Normed`: the projection of its norm's output, the FP8 kernel applying the norm itself on bf16 input."""
        if self.quantizes_in_kernel(num):
            out_dtype = torch.float32 if partial else torch.bfloat16
            if isinstance(x, Normed):
                if x.x.dtype != torch.bfloat16:  # the fused norm rounds to bf16, the norm to x's dtype
                    return self._fp8_kernel(x.value(), out_dtype)
                return self._fp8_kernel(x.x, out_dtype, (x.norm.weight, x.norm.eps))
            return self._fp8_kernel(x, out_dtype)
        if isinstance(x, Normed):
            x = x.value()
        if self.weight is None:
            raise RuntimeError(
                "this projection was loaded packed for fp8_gemm=triton and holds no dense weight: "
                "fp8_gemm=torch needs the model loaded dense (iter_dense)"
            )
        if partial or self.row_parallel:
            if self.fp8_act and num.fp8_act and not x_quantized:
                x = fp8_quant_dequant(x, ACT_BLOCK)
            return row_product(x, self.weight, num, partial)
        return linear(x, self.weight, num, self.fp8_act, x_quantized)

    def _fp8_kernel(
        self, x: torch.Tensor, out_dtype: torch.dtype, norm: tuple[torch.Tensor, float] | None = None
    ) -> torch.Tensor:
        """x [..., in] bf16 -> [..., out] out_dtype in one launch: the kernel quantizes x per token per 128
        channels itself (idempotent on an input the caller quantized already; `x_quantized` is moot), after an
        RMSNorm of x with `norm` (weight, eps) when given."""
        if self.weight_fp8 is None:
            raise RuntimeError("fp8_gemm=triton needs packed FP8 weights: call Transformer.use_kernels first")
        from dsv4_kernels.fp8_gemm import fp8_linear  # lazy: kernel modules build their kernels on import

        rows = x.reshape(-1, x.shape[-1])
        out = fp8_linear(rows, self.weight_fp8, self.weight_fp8_scale, out_dtype=out_dtype, norm=norm)
        return out.view(*x.shape[:-1], out.shape[-1])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, num: Numerics | None = None) -> torch.Tensor:
        if num is not None and num.backends.token_ops == "triton" and x.dim() == 2:
            from dsv4_kernels.token_ops import rms_norm  # lazy: kernel modules build their kernels on import

            return rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


@dataclass
class Normed:
    """norm(x), for the projections that read it: an FP8-stored Linear on the Triton kernel applies the norm in
    its own launch (fp8_gemm's fused norm: the normed tensor is never stored, one launch fewer), every other
    reader gets the norm module's output, computed once (`value`). The attention's q_norm before wq_b and
    the indexer's wq_b."""

    x: torch.Tensor
    norm: RMSNorm
    num: Numerics
    _value: torch.Tensor | None = None

    def value(self) -> torch.Tensor:
        if self._value is None:
            self._value = self.norm(self.x, self.num)
        return self._value
