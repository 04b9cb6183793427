"""GPU cases for the per-token chains (dsv4_kernels.token_ops) at DeepSeek-V4-Flash's dimensions: 4096
hidden, 64 heads x 512 (rope 64, nope 448), 64 index heads x 128; a decode step of 32 tokens and a
prefill chunk of 8192. Angles come from positions (cos / sin evaluated in the kernel), as the model would
call them; the baseline is the torch reference, i.e. today's chain of small torch ops (fp64 cos / sin).

Tolerance: an unquantized output may differ by one bf16 ulp (rtol 2^-7; the RMS sums run in another
order, cos / sin are fp32, and on a GPU the rotation's products fuse into FMAs). A quantized channel may
then move by one step of its block's grid: at most amax / 8 for e4m3 and 2 amax / 3 for e2m1, which is
what atol allows there (loose; the interpreter tests, tests/kernels/test_token_ops.py, also bound how
many elements may move and hold the quantizers to torch bit for bit).
"""

from __future__ import annotations

import torch

from bench.gpu_cases import GpuCase
from dsv4_kernels import token_ops as ops
from dsv4_kernels import token_ops_ref as ref

EPS = 1e-6
ONE_ULP = 2.0**-7


def _freqs(rope_dim: int) -> torch.Tensor:
    return 1.0 / (160000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))


def _cases(n: int, label: str, dims: dict, device: torch.device, seed: int) -> list[GpuCase]:
    gen = torch.Generator(device=device).manual_seed(seed)
    dim, h, d, rd, hi, di = (dims[k] for k in ("dim", "heads", "head_dim", "rope", "index_heads", "index_dim"))
    positions = torch.randint(0, 1 << 20, (n,), generator=gen, device=device, dtype=torch.int32)
    freqs = _freqs(rd).to(device)
    at, entry_at = ref.Angles.at(positions, freqs), ref.Angles.at(positions, freqs, window=4)
    bf16 = torch.bfloat16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    x, kv, iq = randn(n, dim).to(bf16), randn(n, d).to(bf16), randn(n, hi, di).to(bf16)
    q, o = randn(n, h, d).to(bf16), randn(n, h, d).to(bf16)
    w, wk, wi = 1 + 0.1 * randn(dim), 1 + 0.1 * randn(d), 1 + 0.1 * randn(di)
    pooled, ipooled = randn(n, d), randn(n, di)
    nope = d - rd
    chains = [  # (name, kernel call, reference call, bytes moved, atol: the quantization step bound or 1e-3)
        (f"rms_norm {dim}", lambda: ops.rms_norm(x, w, EPS), lambda: ref.rms_norm_ref(x, w, EPS), 4 * n * dim, 1e-3),
        ("q_head_norm_rope", lambda: ops.q_head_norm_rope(q, at, EPS), lambda: ref.q_head_norm_rope_ref(q, at, EPS),
         4 * n * h * d, 1e-3),
        ("kv_norm_rope_quant", lambda: ops.kv_norm_rope_quant(kv, wk, EPS, at, nope),
         lambda: ref.kv_norm_rope_quant_ref(kv, wk, EPS, at, nope, 64, True), 4 * n * d, 8.0 / 8),
        ("rope inverse", lambda: ops.rope(o, at, inverse=True), lambda: ref.rope_ref(o, at, True), 4 * n * h * d, 1e-3),
        ("indexer_q", lambda: ops.indexer_q(iq, at), lambda: ref.indexer_q_ref(iq, at, True), 4 * n * hi * di,
         2 * 6.0 / 3),
        ("entry kv", lambda: ops.compressed_entry(pooled, wk, EPS, entry_at, "kv", bf16, nope),
         lambda: ref.compressed_entry_ref(pooled, wk, EPS, entry_at, "kv", bf16, nope), 6 * n * d, 8.0 / 8),
        ("entry index", lambda: ops.compressed_entry(ipooled, wi, EPS, entry_at, "index", bf16),
         lambda: ref.compressed_entry_ref(ipooled, wi, EPS, entry_at, "index", bf16), 6 * n * di, 2 * 6.0 / 3),
    ]  # fmt: skip
    # atol: unit-normal rows give |values| < ~8 after the norm (one e4m3 step <= 8 / 8) and < ~6 after the
    # orthonormal Hadamard (one e2m1 step <= 2 * 6 / 3)
    return [
        GpuCase(
            name=f"token_ops {name} {label}",
            run=run,
            reference=reference,
            atol=atol,
            rtol=ONE_ULP,
            bytes_moved=nbytes,
            baseline=reference,
            baseline_name="torch ops",
        )
        for name, run, reference, nbytes, atol in chains
    ]


REAL = {"dim": 4096, "heads": 64, "head_dim": 512, "rope": 64, "index_heads": 64, "index_dim": 128}
TINY = {"dim": 128, "heads": 4, "head_dim": 128, "rope": 64, "index_heads": 4, "index_dim": 128}


def cases(device: torch.device) -> list[GpuCase]:
    return _cases(32, "decode b=32", REAL, device, seed=1) + _cases(8192, "prefill 8192", REAL, device, seed=2)


def smoke_cases(device: torch.device) -> list[GpuCase]:
    """dsv4-tiny's dims, three tokens, for the CPU interpreter."""
    return _cases(3, "tiny", TINY, device, seed=3)
