"""Every registered kernel compiles on this CPU for the GPUs users run (sm_90 H100/H200 and sm_120
RTX 50), in each of its configurations, and the PTX holds the matrix instructions we meant.

The builds run in one child process without TRITON_INTERPRET (conftest.py sets it for this
process, where @triton.jit yields interpreter functions that cannot be compiled). ptxas ships in
the triton wheel (triton/backends/nvidia/bin), so the checks reach a cubin.

What triton 3.7.1 emits (asserted below):
- fp8_gemm on sm_90: `wgmma.mma_async ... .e4m3.e4m3` for prefill (m64n128k32) and, with SWAP_AB,
  for decode (m64n16k32). Without the swap a 16-row tile falls back to `mma.sync ... f16.f16`
  (the fp8 tiles are widened to f16 in registers, still exact): that is why decode swaps A and B.
- fp8_gemm on sm_120: no wgmma there; `mma.sync.aligned.m16n8k32 ... e4m3.e4m3` (native fp8 mma).
- fp4_moe_gemm: weights are dequantized to bf16 in registers (no FP4 MMA on sm_90); sm_90 uses
  `wgmma ... bf16` for 64-row blocks and `mma.sync ... bf16` for 16-row decode blocks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ARCHS = (90, 120)
MMA = re.compile(r"\b(wgmma\.mma_async\.sync\.aligned\.\w+\.\w+\.\w+\.\w+|mma\.sync\.aligned\.[\w.]+)")

# (kernel, config, arch) -> a substring one of the PTX's matrix instructions must contain
EXPECTED = {
    ("fp8_gemm", "prefill", 90): "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3",
    ("fp8_gemm", "decode", 90): "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3",
    ("fp8_gemm", "decode_noswap", 90): "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
    ("fp8_gemm", "prefill", 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
    ("fp8_gemm", "decode", 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
    ("fp8_gemm", "decode_noswap", 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
    # P @ V of 64 heads: [64, BLOCK_N] @ [BLOCK_N, 512] on bf16 operands
    ("paged_sparse_attention", "decode_csa", 90): "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
    ("paged_sparse_attention", "prefill_csa", 90): "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
    ("paged_sparse_attention", "decode_hca_bn16", 90): "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
    ("paged_sparse_attention", "decode_csa", 120): "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    ("paged_sparse_attention", "prefill_csa", 120): "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    ("paged_sparse_attention", "decode_hca_bn16", 120): "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    ("paged_sparse_attention", "combine", 90): "", ("paged_sparse_attention", "combine", 120): "",  # split-K merge
    ("indexer_topk", "decode", 90): "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
    ("indexer_topk", "decode_small", 90): "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16",
    ("indexer_topk", "prefill", 90): "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
    ("indexer_topk", "decode", 120): "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    ("indexer_topk", "decode_small", 120): "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    ("indexer_topk", "prefill", 120): "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    # "": no tensor-core instruction at all (a per-channel softmax pooling has no matrix product)
    ("compressor_pool", "csa", 90): "", ("compressor_pool", "csa", 120): "",
    ("compressor_pool", "csa_indexer", 90): "", ("compressor_pool", "csa_indexer", 120): "",
    ("compressor_pool", "hca", 90): "", ("compressor_pool", "hca", 120): "",
}


# rough cold build seconds on the 2-core CI machine, only to balance the two child processes
BUILD_SECONDS = {("fp4_moe_gemm", "gate_up_prefill", 120): 18, ("fp4_moe_gemm", "down_prefill", 120): 6}


def _compile(jobs: list[str]) -> dict:
    """Child process: build each "kernel|config|arch" job; report the matrix instructions found."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv4_kernels.registry import KERNELS_BY_NAME

    results = {}
    for key in jobs:
        name, config, arch = key.split("|")
        spec = KERNELS_BY_NAME[name]
        signature, constexprs = {c: (sig, cx) for c, sig, cx in spec.load_compile_configs()}[config]
        try:
            built = triton.compile(ASTSource(fn=spec.load_kernel(), signature=signature, constexprs=constexprs),
                                   target=GPUTarget("cuda", int(arch), 32))
            ptx = built.asm["ptx"]
            results[key] = {"mma": sorted(set(MMA.findall(ptx))), "cubin_bytes": len(built.asm["cubin"]),
                            "target": re.search(r"\.target\s+(\w+)", ptx).group(1)}
        except Exception as exc:  # reported per config by the test
            results[key] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    return results


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Two children side by side, jobs split longest first (a cold build of everything takes ~55 s on
    one core; the Triton cache makes reruns take a few seconds)."""
    jobs = sorted(((name, config, arch) for name, config, arch in (p.values for p in _cases())),
                  key=lambda job: -BUILD_SECONDS.get(job, 3))
    shares: list[list[str]] = [[], []]
    loads = [0, 0]
    for job in jobs:
        child = loads.index(min(loads))
        shares[child].append("|".join(map(str, job)))
        loads[child] += BUILD_SECONDS.get(job, 3)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = [subprocess.Popen([sys.executable, __file__, json.dumps(share)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for share in shares]
    results = {}
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        results.update(json.loads(out.strip().splitlines()[-1]))
    return results


def _cases():
    from dsv4_kernels.registry import KERNELS

    for spec in KERNELS:
        for config, _, _ in spec.load_compile_configs():
            for arch in ARCHS:
                yield pytest.param(spec.name, config, arch, id=f"{spec.name}-{config}-sm{arch}")


@pytest.mark.parametrize(("name", "config", "arch"), list(_cases()))
def test_compiles_with_tensor_core_mma(compiled: dict, name: str, config: str, arch: int) -> None:
    result = compiled[f"{name}|{config}|{arch}"]
    assert "error" not in result, result.get("error")
    assert result["target"] == f"sm_{arch}a"  # triton targets the arch-specific ISA (wgmma needs sm_90a)
    assert result["cubin_bytes"] > 0
    expected = EXPECTED.get((name, config, arch))
    if expected == "":  # a kernel without a matrix product (compressor pooling): the PTX must hold none
        assert not result["mma"], result["mma"]
        return
    assert result["mma"], f"no tensor-core instruction in the PTX of {name}/{config} for sm_{arch}"
    if expected is None:  # the MoE GEMM: bf16 operands on every arch
        wanted = "wgmma" if arch == 90 and "prefill" in config else "mma.sync"
        assert any(wanted in m and "bf16" in m for m in result["mma"]), result["mma"]
    else:
        assert any(expected in m for m in result["mma"]), result["mma"]


if __name__ == "__main__":
    print(json.dumps(_compile(json.loads(sys.argv[1]))))
