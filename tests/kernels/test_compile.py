"""Every registered kernel compiles on this CPU for the GPUs users run (sm_90 H100/H200 and sm_120
RTX 50), in each configuration its wrapper launches there, with the wrapper's launch options and the
alignment the launcher specializes (registry.KernelSpec.launch_options, compile_attrs); the PTX holds
the matrix instructions we meant, and the cubin fits the arch: shared memory within what a block
may opt in to (else the launch fails with "out of resources" on the card) and register spills
(local-memory stack, read from the cubin with cuobjdump -res-usage) no larger than STACK_BUDGET.

The builds run in child processes without TRITON_INTERPRET (dsv4_kernels.build_report, which also
prints the table: `python -m dsv4_kernels.build_report`).

What triton 3.7.1 emits (asserted below):
- fp8_gemm on sm_90: `wgmma.mma_async ... .e4m3.e4m3` for prefill (m64n128k32) and, with SWAP_AB,
  for decode (m64n16k32), in the fused form (bf16 activations quantized in the kernel) and the
  pre-quantized one (`*_prequant`). Without the swap a 16-row tile falls back to `mma.sync ... f16.f16`
  (the fp8 tiles are widened to f16 in registers, still exact): that is why decode swaps A and B.
- fp8_gemm on sm_120: no wgmma there; `mma.sync.aligned.m16n8k32 ... e4m3.e4m3` (native fp8 mma).
- fp4_moe_gemm: weights are dequantized to bf16 in registers (no FP4 MMA on sm_90) and the tile is
  computed transposed (out^T = W @ A^T), so the weight rows fill the MMA's M side: sm_90 uses
  `wgmma ... bf16` for every block (m64n16k16 for 16-slot decode blocks, m64n64k16 for prefill);
  sm_120 uses `mma.sync ... bf16`; the same with the expert-slot cache's second source (`*_slots`).
- moe_align (the routes' layout, one program), moe_combine (the MoE output's sums) and hc_post_combine (those sums
  inside the mHC post): no matrix instruction.
- hc_mix: one token a program (decode: the split-K partial sums, then the rest) and hc_post use no
  matrix instruction; 16-token blocks take `mma.sync ... bf16` on both arches, 64-token blocks `wgmma ... m64n32k16 ... bf16` on sm_90.
"""

from __future__ import annotations

import pytest

from dsv4_kernels.build_report import build_all, launched_builds, table

HC_MMA_SYNC = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"  # hc_mix
# token_rows (the per-token chains): the builds that rotate, and the two plain RMSNorms
TOKEN_ROPE = ("q_head_norm_rope", "kv_norm_rope_fp8", "kv_norm_rope_fp8_ring", "rope_inverse", "indexer_q_fp4",
              "entry_kv_fp8", "entry_index_fp4")  # fmt: skip
# (kernel, config, arch) -> a substring one of the PTX's matrix instructions must contain
EXPECTED = {
    ("fp8_gemm", "prefill", 90): "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3",
    ("fp8_gemm", "decode", 90): "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3",
    ("fp8_gemm", "decode_noswap", 90): "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
    ("fp8_gemm", "prefill_w8", 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
    ("fp8_gemm", "decode", 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
    ("fp8_gemm", "decode_noswap", 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
    ("fp8_gemm", "prefill_prequant", 90): "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3",
    ("fp8_gemm", "decode_prequant", 90): "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3",
    ("fp8_gemm", "decode_split8", 90): "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3",
    ("fp8_gemm", "decode_split8", 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
    ("fp8_gemm", "prefill_prequant_w8", 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
    ("fp8_gemm", "decode_prequant", 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
    # q_norm fused into wq_b's prologue: the same products
    **{
        ("fp8_gemm", c, 90): "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3"
        for c in ("decode_norm", "decode_norm_split4")
    },
    **{
        ("fp8_gemm", c, 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"
        for c in ("decode_norm", "decode_norm_split4")
    },
    ("fp8_gemm", "prefill_norm", 90): "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3",
    ("fp8_gemm", "prefill_norm_w8", 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
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
    # the head: [128 vocab, 64 K] bf16 weight tiles against the three bf16 parts of y^T (16 or 32 rows)
    ("head_logits", "decode", 90): "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16",
    ("head_logits", "batch", 90): "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16",
    ("head_logits", "decode", 120): "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    ("head_logits", "batch", 120): "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    # "": no tensor-core instruction at all (a per-channel softmax pooling has no matrix product)
    ("compressor_pool", "csa", 90): "",
    ("compressor_pool", "csa", 120): "",
    ("compressor_pool", "csa_indexer", 90): "",
    ("compressor_pool", "csa_indexer", 120): "",
    ("compressor_pool", "hca", 90): "",
    ("compressor_pool", "hca", 120): "",
    # the MoE route layout: one-hot sums and cumsums, no matrix product
    ("moe_align", "decode", 90): "",
    ("moe_align", "decode", 120): "",
    ("moe_align", "prefill", 90): "",
    ("moe_align", "prefill", 120): "",
    # the MoE output: the routes' sum, the shared expert (and CPU experts') add and the cast, elementwise
    **{("moe_combine", c, sm): "" for c in ("shared", "hybrid", "rank_sum") for sm in (90, 120)},
    **{("hc_post_combine", c, sm): "" for c in ("shared", "hybrid") for sm in (90, 120)},
    # mHC: one token a program sums on the FMA units ("" = no matrix instruction), as does hc_post; 16- and
    # 64-token blocks put [tokens, K] x [K, 32 mixes] on the tensor cores as three bf16 products
    **{("hc_mix", f"{form}_bn1", sm): "" for form in ("pre", "head") for sm in (90, 120)},
    **{("hc_mix", f"{form}_part", sm): "" for form in ("pre", "head") for sm in (90, 120)},  # its split-K sums
    **{("hc_mix", "post", sm): "" for sm in (90, 120)},
    **{("hc_mix", f"{form}_bn16", sm): HC_MMA_SYNC for form in ("pre", "head") for sm in (90, 120)},
    **{("hc_mix", f"{form}_bn64", 90): "wgmma.mma_async.sync.aligned.m64n32k16.f32" for form in ("pre", "head")},
    **{("hc_mix", f"{form}_bn64", 120): HC_MMA_SYNC for form in ("pre", "head")},
    # the per-token chains (norms, RoPE, FP8 / Hadamard + FP4 quantize-dequantize): elementwise, no matrix product
    **{("token_rows", c, sm): "" for c in ("rms_norm_4096", "rms_norm_1024", *TOKEN_ROPE) for sm in (90, 120)},
    # the compressor's decode update (pooling, norm, RoPE, quantization of one row) and the indexer's radix
    # select: elementwise work, reductions and a sort, no matrix product
    **{("compressor_decode", c, sm): "" for c in ("csa_kv", "csa_index", "hca_kv") for sm in (90, 120)},
    **{("indexer_topk_select", c, sm): "" for c in ("layout", "plain") for sm in (90, 120)},
    # the MoE router: fp32 logits as IEEE FMA sums (no TF32 tensor cores), then one token a program
    **{("router_logits", "logits", sm): "" for sm in (90, 120)},
    **{
        ("router_select", c, sm): ""
        for c in ("select_topk", "select_topk_bucket", "select_hash_bucket")
        for sm in (90, 120)
    },
    # the shared expert's w1 + w3 FP8 GEMM (two accumulators; the prefill tile's N split over 2 warpgroups)
    ("fp8_swiglu", "decode", 90): "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3",
    ("fp8_swiglu", "prefill", 90): "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3",
    ("fp8_swiglu", "decode", 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
    ("fp8_swiglu", "decode_split8", 90): "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3",
    ("fp8_swiglu", "decode_split8", 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
    ("fp8_swiglu", "prefill_s2", 120): "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
}

# local-memory stack bytes (register spills) each launched build may have, as measured with triton 3.7.1;
# absent = 0. A ratchet: lower an entry when a change cuts the spill, never raise one without a GPU timing
# (bench/gpu_check.py) that shows the spill costs nothing.
STACK_BUDGET = {
    # the [64 heads, 512] fp32 accumulator alone is 128 registers a thread at 8 warps; the key tiles,
    # their row pointers and the softmax state come on top
    ("paged_sparse_attention", "decode_csa_bn32", 90): 72,
    ("paged_sparse_attention", "prefill_csa_bn32", 90): 64,
    ("paged_sparse_attention", "decode_csa_bn16", 120): 16,
    ("paged_sparse_attention", "prefill_csa_bn16", 120): 48,
    # not a spill: libdevice's cosf / sinf keep their Payne-Hanek reduction words in a 28-byte local array
    # (a bare tl.cos kernel has it too), touched only for angles beyond ~1e5 rad (positions past ~100K)
    **{("token_rows", config, sm): 32 for config in TOKEN_ROPE for sm in (90, 120)},
    **{("compressor_decode", c, sm): 32 for c in ("csa_kv", "csa_index", "hca_kv") for sm in (90, 120)},  # the same
}

# rough cold build seconds on the 2-core CI machine, only to balance the two child processes
BUILD_SECONDS = {("fp4_moe_gemm", "gate_up_prefill_bk32", 120): 18, ("fp4_moe_gemm", "down_prefill", 120): 6}


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Every launched build, two child processes side by side (build_report.build_all)."""
    return build_all(list(launched_builds()), workers=2, cost=BUILD_SECONDS)


def _cases():
    return [pytest.param(*build, id=f"{build[0]}-{build[1]}-sm{build[2]}") for build in launched_builds()]


@pytest.mark.parametrize(("name", "config", "arch"), _cases())
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
    if expected is None:  # the MoE GEMM: bf16 operands on every arch; fp16 in the late-scale form (fp4_moe.py)
        wanted = "wgmma" if arch == 90 else "mma.sync"
        operands = ".f16.f16" if "_late" in config else ".bf16.bf16"
        assert any(wanted in m and operands in m for m in result["mma"]), result["mma"]
    else:
        assert any(expected in m for m in result["mma"]), result["mma"]


@pytest.mark.parametrize(("name", "config", "arch"), _cases())
def test_fits_the_arch_without_new_spills(compiled: dict, name: str, config: str, arch: int) -> None:
    from dsv4_kernels.registry import SHARED_PER_BLOCK

    result = compiled[f"{name}|{config}|{arch}"]
    assert "error" not in result, result.get("error")
    assert result["shared"] <= SHARED_PER_BLOCK[arch], f"{result['shared']} B of shared memory on sm_{arch}"
    budget = STACK_BUDGET.get((name, config, arch), 0)
    assert result["stack"] <= budget, f"{result['stack']} B of spill stack (budget {budget}), {result['regs']} regs"


def test_every_budget_names_a_launched_build() -> None:
    launched = set(launched_builds())
    assert set(STACK_BUDGET) <= launched and set(EXPECTED) <= launched, (set(STACK_BUDGET) | set(EXPECTED)) - launched


def test_the_printed_table_has_a_row_per_build(compiled: dict) -> None:
    rows = table(compiled).splitlines()[2:]
    assert len(rows) == len(compiled)
    assert {tuple(cell.strip() for cell in row.split("|")[1:4]) for row in rows} == {
        (name, config, f"sm_{arch}") for name, config, arch in launched_builds()
    }
