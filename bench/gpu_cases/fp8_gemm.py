"""FP8 block-scaled projections (dsv4_kernels.fp8_gemm: activation quantization fused into the GEMM) at
DeepSeek-V4-Flash's sizes.

Shapes from the real config: wq_b (q_lora_rank -> n_heads * head_dim, the largest attention
projection) and the shared expert's w1 (dim -> moe_inter_dim); each at decode (m = 1, 8: memory-bound),
m = 64 and a prefill of m = 4096 (compute-bound). Weights are random e4m3 with random e8m0 block scales,
made on the device (no CPU quantization pass). Reference: `fp8_linear_ref` (fp64 sum of the exact
products, rounded once); run and reference differ only by fp32 summation order, then one bf16 rounding,
hence rtol 2^-7 (one bf16 ulp is 2^-8 relative) and a small atol for outputs near zero.

Baselines, one row each: the two-step path the fused kernel replaces (torch `act_quant_fp8_ref`, about
17 launches, then the same kernel on pre-quantized input), torch bf16 matmul on the dequantized weight,
and flashinfer's SM90 block-scaled FP8 GEMM (bf16 input, FP8 weight) when flashinfer is importable.

The shared expert's fused gate / up launch (fp8_swiglu) at decode: its default K split against the unsplit
launch (`swiglu_cases`).

One more case per K checks the in-kernel quantization exactly: with the identity as weight the output
is the quantize-dequantize of x, which must equal torch's (atol = rtol = 0); on a GPU the e4m3
rounding is the hardware cast, not the bit method the CPU tests exercise.
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


def two_step(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The path before the fusion: torch quantization, then the kernel on the quantized input."""
    from dsv4_kernels.fp8_gemm import fp8_gemm
    from dsv4_kernels.fp8_gemm_ref import act_quant_fp8_ref

    q, q_scale = act_quant_fp8_ref(x)
    return fp8_gemm(q, q_scale, w, s)


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
                bound="memory" if m <= 64 else "compute",
            )
            run = partial(fp8_linear, x, w, s)
            name = f"fp8_gemm {label} {n}x{k} m={m}"
            baselines = [
                ("two-step", partial(_on_device, device, two_step, x, w, s)),
                ("torch bf16", partial(torch.matmul, x, w_bf16.t())),
            ]
            if fi is not None and device.type == "cuda":
                baselines.append(("flashinfer sm90", partial(fi, x, w, None, s_fp32)))
            for i, (baseline_name, baseline) in enumerate(baselines):
                case_name = name if i == 0 else f"{name} [vs {baseline_name}]"
                out.append(GpuCase(case_name, run, baseline=baseline, baseline_name=baseline_name, **common))
    return out


def norm_cases(device: torch.device, n: int, k: int, ms: tuple[int, ...]) -> list[GpuCase]:
    """wq_b with q_norm in its launch (fp8_linear's `norm`) against token_ops.rms_norm then fp8_linear: the pair
    it replaces, also the baseline (the same bf16 normed rows but for the order of the squares' sum)."""
    from dsv4_kernels.fp8_gemm import fp8_linear
    from dsv4_kernels.token_ops import rms_norm

    gen = torch.Generator(device=device).manual_seed(1)
    w, s = random_fp8_weight(n, k, device, gen)
    norm = (0.5 + torch.rand(k, device=device, generator=gen), 1e-6)
    out = []
    for m in ms:
        x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
        pair = partial(lambda x: fp8_linear(rms_norm(x, *norm), w, s), x)
        out.append(
            GpuCase(
                f"fp8_gemm +norm {n}x{k} m={m}",
                partial(fp8_linear, x, w, s, norm=norm),
                reference=pair,
                # where the two orders give r other bits, a normed value moves by a bf16 ulp and may cross an e4m3
                # rounding: one input's e4m3 step (2^-3 of it, ~0.1 here) times its weight, against outputs ~10
                atol=0.25,
                rtol=2.0**-6,
                bytes_moved=n * k + s.numel() + 2 * m * k + 2 * m * n,
                baseline=pair,
                baseline_name="rms_norm + fp8_linear",
            )
        )
    return out


def quant_exact_cases(device: torch.device, ks: list[int], ms: tuple[int, ...]) -> list[GpuCase]:
    """fp8_linear(x, identity) == the torch quantize-dequantize of x, bit for bit (see the module doc).
    x spans six decades per row, so blocks hit e4m3 subnormals, and bf16 inputs tie often (1 in 16)."""
    from dsv4_kernels.formats import quant_fp8_block
    from dsv4_kernels.fp8_gemm import fp8_linear
    from dsv4_kernels.fp8_gemm_ref import act_quant_fp8_ref, dequant_act_fp8_ref

    gen = torch.Generator(device=device).manual_seed(1)
    out: list[GpuCase] = []
    for k in sorted(set(ks)):
        eye, eye_scale = quant_fp8_block(torch.eye(k, device=device))  # e4m3 256 times 2^-8: exact
        for m in ms:
            x = torch.randn(m, k, device=device, generator=gen) * torch.logspace(-3, 3, k, device=device)
            x = x.to(torch.bfloat16)
            out.append(
                GpuCase(
                    f"fp8_gemm quant exact K={k} m={m}",
                    partial(fp8_linear, x, eye, eye_scale),
                    lambda x=x: dequant_act_fp8_ref(*act_quant_fp8_ref(x)).to(torch.bfloat16),
                    atol=0.0,
                    rtol=0.0,
                    bytes_moved=k * k + 4 * m * k,
                )
            )
    return out


def swiglu_cases(device: torch.device, inter: int, dim: int, ms: tuple[int, ...]) -> list[GpuCase]:
    """The shared expert's fused gate / up launch (dsv4_kernels.fp8_swiglu) at decode: its default K split (8 on a
    GPU for V4-Flash's 2,048 x 4,096: 16 channel tiles become 128 programs) against the unsplit launch, both as
    the dequantized act against the torch reference (one e4m3 step: a one-ulp change of gate or up can move an
    act value by one step, the test's bound). The clamp is V4-Flash's swiglu_limit, 10."""
    from dsv4_kernels.fp8_gemm_ref import dequant_act_fp8_ref
    from dsv4_kernels.fp8_swiglu import fp8_swiglu, pick_split_k
    from dsv4_kernels.fp8_swiglu_ref import fp8_swiglu_ref

    gen = torch.Generator(device=device).manual_seed(2)
    w1, s1 = random_fp8_weight(inter, dim, device, gen)
    w3, s3 = random_fp8_weight(inter, dim, device, gen)
    out: list[GpuCase] = []
    for m in ms:
        x = torch.randn(m, dim, device=device, generator=gen).to(torch.bfloat16)
        split = pick_split_k(m, inter, dim, device)
        out.append(
            GpuCase(
                f"fp8_swiglu shared gate/up {inter}x{dim} m={m} split={split} [vs split=1]",
                lambda x=x: dequant_act_fp8_ref(*fp8_swiglu(x, w1, s1, w3, s3, 10.0)),
                partial(_on_device, device, lambda x=x: dequant_act_fp8_ref(*fp8_swiglu_ref(x, w1, s1, w3, s3, 10.0))),
                atol=1e-3,
                rtol=2.0**-3,
                bytes_moved=2 * inter * dim + s1.numel() + s3.numel() + 2 * m * dim + m * inter,
                baseline=lambda x=x: dequant_act_fp8_ref(*fp8_swiglu(x, w1, s1, w3, s3, 10.0, split_k=1)),
                baseline_name="split=1",
            )
        )
    return out


def _on_device(device: torch.device, fn, *args) -> torch.Tensor:
    """Run a torch reference with `device` as the default for tensors it creates itself."""
    with torch.device(device):
        return fn(*args)


def cases(device: torch.device) -> list[GpuCase]:
    shapes = real_shapes()
    _, inter, dim = shapes[1]
    return (
        build(device, shapes, (1, 8, 64, 4096))
        + quant_exact_cases(device, [k for _, _, k in shapes], (1, 64))
        + swiglu_cases(device, inter, dim, (1, 8))
        + norm_cases(device, 32768, 1024, (1, 8))  # attn.wq_b [n_heads x head_dim, q_lora]
    )


def smoke_cases(device: torch.device) -> list[GpuCase]:
    """Tiny shapes for the CPU interpreter (a ragged N and K included)."""
    return (
        build(device, [("tiny", 320, 256), ("ragged", 200, 160)], (1, 40))
        + quant_exact_cases(device, [160], (1,))
        + swiglu_cases(device, 256, 512, (1,))
        + norm_cases(device, 256, 384, (1, 40))
    )
