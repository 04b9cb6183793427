"""Every registered kernel compiles on this CPU for the GPUs users run (sm_90 H100/H200 and sm_120
RTX 50), in each configuration its wrapper launches there, with the wrapper's launch options and the
alignment the launcher specializes (registry.KernelSpec.launch_options, compile_attrs); the PTX holds
the matrix instructions we meant, and the cubin fits the arch: shared memory within what a block may opt in to (else the launch fails with "out of
resources" on the card) and register spills (local-memory stack, read from the cubin with
cuobjdump -res-usage) no larger than STACK_BUDGET.

The builds run in one child process without TRITON_INTERPRET (conftest.py sets it for this
process, where @triton.jit yields interpreter functions that cannot be compiled). ptxas ships in
the triton wheel (triton/backends/nvidia/bin), so the checks reach a cubin.

What triton 3.7.1 emits (asserted below):
- fp8_gemm on sm_90: `wgmma.mma_async ... .e4m3.e4m3` for prefill (m64n128k32) and, with SWAP_AB,
  for decode (m64n16k32). Without the swap a 16-row tile falls back to `mma.sync ... f16.f16`
  (the fp8 tiles are widened to f16 in registers, still exact): that is why decode swaps A and B.
- fp8_gemm on sm_120: no wgmma there; `mma.sync.aligned.m16n8k32 ... e4m3.e4m3` (native fp8 mma).
- fp4_moe_gemm: weights are dequantized to bf16 in registers (no FP4 MMA on sm_90) and the tile is
  computed transposed (out^T = W @ A^T), so the weight rows fill the MMA's M side: sm_90 uses
  `wgmma ... bf16` for every block (m64n16k16 for 16-slot decode blocks, m64n64k16 for prefill);
  sm_120 uses `mma.sync ... bf16`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

MMA = re.compile(r"\b(wgmma\.mma_async\.sync\.aligned\.\w+\.\w+\.\w+\.\w+|mma\.sync\.aligned\.[\w.]+)")
RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")

# (kernel, config, arch) -> a substring one of the PTX's matrix instructions must contain
EXPECTED = {
    ("fp8_gemm", "prefill", 90): "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3",
    ("fp8_gemm", "decode", 90): "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3",
    ("fp8_gemm", "decode_noswap", 90): "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
    ("fp8_gemm", "prefill", 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
    ("fp8_gemm", "decode", 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
    ("fp8_gemm", "decode_noswap", 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
    # P @ V of 64 heads: [64, BLOCK_N] @ [BLOCK_N, 512] on bf16 operands; 32-key blocks on sm_90, 16 on sm_120
    ("paged_sparse_attention", "decode_csa_bn32", 90): "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
    ("paged_sparse_attention", "prefill_csa_bn32", 90): "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
    ("paged_sparse_attention", "decode_hca_bn32", 90): "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",
    ("paged_sparse_attention", "decode_csa_bn16", 120): "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    ("paged_sparse_attention", "prefill_csa_bn16", 120): "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    ("paged_sparse_attention", "decode_hca_bn16", 120): "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    ("paged_sparse_attention", "combine_bn32", 90): "",  # the split-K merge
    ("paged_sparse_attention", "combine_bn16", 120): "",
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

# local-memory stack bytes (register spills) each launched build may have, as measured with triton 3.7.1;
# absent = 0. A ratchet: lower an entry when a change cuts the spill, never raise one without a GPU timing
# (bench/gpu_check.py) that shows the spill costs nothing.
STACK_BUDGET = {
    # the [64 heads, 512] fp32 accumulator alone is 128 registers a thread at 8 warps; the key tiles,
    # their row pointers and the softmax state come on top
    ("paged_sparse_attention", "decode_csa_bn32", 90): 72, ("paged_sparse_attention", "prefill_csa_bn32", 90): 64,
    ("paged_sparse_attention", "decode_csa_bn16", 120): 16, ("paged_sparse_attention", "prefill_csa_bn16", 120): 48,
}

# rough cold build seconds on the 2-core CI machine, only to balance the two child processes
BUILD_SECONDS = {("fp4_moe_gemm", "gate_up_prefill", 120): 18, ("fp4_moe_gemm", "down_prefill", 120): 6}


def _compile(jobs: list[str]) -> dict:
    """Child process: build each "kernel|config|arch" job with its launch options; report the matrix
    instructions in the PTX and the cubin's resource usage."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv4_kernels.registry import KERNELS_BY_NAME

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    results = {}
    for key in jobs:
        name, config, arch = key.split("|")
        spec = KERNELS_BY_NAME[name]
        signature, constexprs = {c: (sig, cx) for c, sig, cx in spec.load_compile_configs()}[config]
        try:
            source = ASTSource(fn=spec.load_kernel(), signature=signature, constexprs=constexprs,
                               attrs=spec.compile_attrs(signature))
            built = triton.compile(source, target=GPUTarget("cuda", int(arch), 32),
                                   options=spec.launch_options(config, int(arch)))
            ptx = built.asm["ptx"]
            with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
                cubin.write(built.asm["cubin"])
                cubin.flush()
                usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True)
            regs, stack, _, _ = map(int, RES_USAGE.search(usage.stdout).groups())
            results[key] = {"mma": sorted(set(MMA.findall(ptx))), "cubin_bytes": len(built.asm["cubin"]),
                            "target": re.search(r"\.target\s+(\w+)", ptx).group(1),
                            "shared": built.metadata.shared, "regs": regs, "stack": stack}
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
    """(kernel, config, arch) for every build a wrapper launches."""
    from dsv4_kernels.registry import ARCHS, KERNELS

    for spec in KERNELS:
        for config, _, _ in spec.load_compile_configs():
            for arch in ARCHS:
                if spec.launch_options(config, arch) is not None:
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
        wanted = "wgmma" if arch == 90 else "mma.sync"
        assert any(wanted in m and "bf16" in m for m in result["mma"]), result["mma"]
    else:
        assert any(expected in m for m in result["mma"]), result["mma"]


@pytest.mark.parametrize(("name", "config", "arch"), list(_cases()))
def test_fits_the_arch_without_new_spills(compiled: dict, name: str, config: str, arch: int) -> None:
    from dsv4_kernels.registry import SHARED_PER_BLOCK

    result = compiled[f"{name}|{config}|{arch}"]
    assert "error" not in result, result.get("error")
    assert result["shared"] <= SHARED_PER_BLOCK[arch], f"{result['shared']} B of shared memory on sm_{arch}"
    budget = STACK_BUDGET.get((name, config, arch), 0)
    assert result["stack"] <= budget, f"{result['stack']} B of spill stack (budget {budget}), {result['regs']} regs"


def test_every_budget_names_a_launched_build() -> None:
    launched = {tuple(p.values) for p in _cases()}
    assert set(STACK_BUDGET) <= launched and set(EXPECTED) <= launched, \
        (set(STACK_BUDGET) | set(EXPECTED)) - launched


if __name__ == "__main__":
    print(json.dumps(_compile(json.loads(sys.argv[1]))))
