"""FP8 block-scaled projections (dsv4_kernels.fp8_gemm: act quant + GEMM) at DeepSeek-V4-Flash's sizes.

Shapes from the real config: wq_b (q_lora_rank -> n_heads * head_dim, the largest attention
projection) and the shared expert's w1 (dim -> moe_inter_dim); each at decode (m=1, memory-bound)
and prefill (m=2048, compute-bound). Weights are random e4m3 with random e8m0 block scales, made on
the device (no CPU quantization pass). Reference: `fp8_linear_ref` (fp64 sum of the exact products,
rounded once); run and reference differ only by fp32 summation order, then one bf16 rounding, hence
rtol 2^-7 (one bf16 ulp is 2^-8 relative) and a small atol for outputs near zero.
Baselines: torch bf16 matmul on the dequantized weight; flashinfer's SM90 block-scaled FP8 GEMM
(bf16 input, FP8 weight) as a second row when flashinfer is importable.
"""

from __future__ import annotations

from functools import partial

import torch

from bench.gpu_cases import GpuCase, real_config_dir

FP8_BLOCK = 128
SCALE_BYTES = (119, 123)  # e8m0 exponents 2^-8 .. 2^-5: outputs of order one for N(0, 1) inputs


def real_shapes() -> list[tuple[str, int, int]]:
    """(label, N, K) of the projections measured, from the real config.json."""
    from dsv4serve.model.args import read_model_args

    a = read_model_args(real_config_dir())
    return [("wq_b", a.n_heads * a.head_dim, a.q_lora_rank), ("shared w1", a.moe_inter_dim, a.dim)]


def random_fp8_weight(n: int, k: int, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], e8m0 [ceil(N/128), ceil(K/128)]) drawn on `device`."""
    w = torch.randn(n, k, device=device, generator=gen).clamp(-448, 448).to(torch.float8_e4m3fn)
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    s = torch.randint(*SCALE_BYTES, (nb, kb), device=device, generator=gen, dtype=torch.uint8)
    return w, s.view(torch.float8_e8m0fnu)


def flashinfer_linear():
    """flashinfer's Hopper block-scaled FP8 GEMM, or None when flashinfer is not installed."""
    try:
        from flashinfer.gemm import fp8_blockscale_gemm_sm90
    except ImportError:
        return None
    return fp8_blockscale_gemm_sm90


def build(device: torch.device, shapes: list[tuple[str, int, int]], ms: tuple[int, ...]) -> list[GpuCase]:
    from dsv4_kernels.formats import dequant_fp8_block, e8m0_to_float
    from dsv4_kernels.fp8_gemm import fp8_linear
    from dsv4_kernels.fp8_gemm_ref import fp8_linear_ref

    gen = torch.Generator(device=device).manual_seed(0)
    fi = flashinfer_linear()
    out: list[GpuCase] = []
    for label, n, k in shapes:
        w, s = random_fp8_weight(n, k, device, gen)
        with torch.device(device):
            w_bf16 = dequant_fp8_block(w, s, dtype=torch.bfloat16)
        s_fp32 = e8m0_to_float(s)
        for m in ms:
            x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
            # bytes: weight + its scales, bf16 activations in, bf16 out
            nbytes = n * k + s.numel() + 2 * m * k + 2 * m * n
            common = dict(
                reference=partial(_on_device, device, fp8_linear_ref, x, w, s),
                atol=1e-3,
                rtol=2.0**-7,
                bytes_moved=nbytes,
                flops=2 * m * n * k,
                bound="memory" if m <= 16 else "compute",
            )
            run = partial(fp8_linear, x, w, s)
            name = f"fp8_gemm {label} {n}x{k} m={m}"
            out.append(
                GpuCase(name, run, baseline=partial(torch.matmul, x, w_bf16.t()), baseline_name="torch bf16", **common)
            )
            if fi is not None and device.type == "cuda":
                out.append(
                    GpuCase(
                        name + " [vs flashinfer]",
                        run,
                        baseline=partial(fi, x, w, None, s_fp32),
                        baseline_name="flashinfer sm90",
                        **common,
                    )
                )
    return out


def _on_device(device: torch.device, fn, *args) -> torch.Tensor:
    """Run a torch reference with `device` as the default for tensors it creates itself."""
    with torch.device(device):
        return fn(*args)


def cases(device: torch.device) -> list[GpuCase]:
    return build(device, real_shapes(), (1, 2048))


def smoke_cases(device: torch.device) -> list[GpuCase]:
    """Tiny shapes for the CPU interpreter (a ragged N and K included)."""
    return build(device, [("tiny", 320, 256), ("ragged", 200, 160)], (1, 40))
