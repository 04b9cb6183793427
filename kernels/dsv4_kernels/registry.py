"""The table of Triton kernels: each names its kernel, its torch reference, its test file and the
configurations the CPU compile checks build (tests/kernels/test_registry.py, test_compile.py).

Entries are "module:attribute" strings resolved on demand, so reading the table imports neither
triton nor torch, and a test can set TRITON_INTERPRET before any kernel module is imported.

Besides COMPILE_CONFIGS, a kernel module may declare how its wrapper launches each config:
LAUNCH_OPTIONS {config: {"num_warps": .., "num_stages": ..}} (absent: Triton's defaults) and
LAUNCH_ARCHS {config: (sm, ...)} (absent: every arch in ARCHS), and ALIGNED_INTS, the integer
arguments that are multiples of 16 at DeepSeek-V4-Flash's dimensions: at launch Triton specializes
those, and every 16-byte-aligned pointer (any torch allocation), as divisible by 16, which lets it
vectorize loads; the compile checks mark the same (`compile_attrs`). Together the checks build exactly
what runs and hold it to the arch's limits.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


def resolve(target: str) -> Any:
    """'package.module:attr' -> the attribute."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


# the GPU generations we build for: sm_90 (H100 / H200) and sm_120 (RTX 50 series)
ARCHS = (90, 120)
# shared memory one block may opt in to, per arch (CUDA C++ Programming Guide, "Technical Specifications
# per Compute Capability": 227 KB on 9.0, 99 KB on 12.0)
SHARED_PER_BLOCK = MappingProxyType({90: 227 * 1024, 120: 99 * 1024})


@dataclass(frozen=True)
class KernelSpec:
    name: str
    kernel: str  # "module:attr" of the @triton.jit function
    references: tuple[str, ...]  # "module:attr" of the torch functions it must match (one per form)
    test_module: str  # repository-relative path of the test comparing them
    compile_configs: str  # "module:attr" of ((config name, signature, constexprs), ...)

    def load_kernel(self) -> Any:
        return resolve(self.kernel)

    def load_references(self) -> tuple[Any, ...]:
        return tuple(resolve(ref) for ref in self.references)

    def load_compile_configs(self) -> tuple[tuple[str, dict, dict], ...]:
        return resolve(self.compile_configs)

    def _configs_module(self) -> Any:
        """The kernel module holding COMPILE_CONFIGS and its optional launch declarations."""
        return importlib.import_module(self.compile_configs.partition(":")[0])

    def launch_options(self, config: str, arch: int) -> dict | None:
        """The Triton options the wrapper launches `config` with on sm_`arch` ({}: the defaults), or None
        when it never launches that config there (see the module doc)."""
        module = self._configs_module()
        if arch not in getattr(module, "LAUNCH_ARCHS", {}).get(config, ARCHS):
            return None
        return dict(getattr(module, "LAUNCH_OPTIONS", {}).get(config, {}))

    def compile_attrs(self, signature: dict[str, str]) -> dict[tuple[int], list]:
        """`attrs` for triton's ASTSource: pointers and the module's ALIGNED_INTS divisible by 16."""
        aligned = getattr(self._configs_module(), "ALIGNED_INTS", ())
        wrong = [a for a in aligned if signature.get(a) != "i32"]
        if wrong:
            raise ValueError(f"{self.name}: ALIGNED_INTS names no i32 argument: {wrong}")
        arg_names = self.load_kernel().arg_names
        return {
            (arg_names.index(a),): [["tt.divisibility", 16]]
            for a, kind in signature.items()
            if kind.startswith("*") or a in aligned
        }


KERNELS: tuple[KernelSpec, ...] = (
    KernelSpec(  # one kernel, two forms: bf16 / fp32 activations quantized in the kernel, and pre-quantized
        name="fp8_gemm",
        kernel="dsv4_kernels.fp8_gemm:fp8_gemm_kernel",
        references=("dsv4_kernels.fp8_gemm_ref:fp8_linear_ref", "dsv4_kernels.fp8_gemm_ref:fp8_gemm_ref"),
        test_module="tests/kernels/test_fp8_gemm.py",
        compile_configs="dsv4_kernels.fp8_gemm:COMPILE_CONFIGS",
    ),
    KernelSpec(  # one kernel, two forms: GATE_UP (w1, w3, SwiGLU, routing weight) and the w2 GEMM
        name="fp4_moe_gemm",
        kernel="dsv4_kernels.fp4_moe:fp4_moe_gemm_kernel",
        references=(
            "dsv4_kernels.fp4_moe_ref:gate_up_ref",
            "dsv4_kernels.fp4_moe_ref:down_ref",
            "dsv4_kernels.fp4_moe_ref:fp4_moe_ref",
        ),
        test_module="tests/kernels/test_fp4_moe.py",
        compile_configs="dsv4_kernels.fp4_moe_configs:COMPILE_CONFIGS",
    ),
    KernelSpec(  # the FP4 MoE's route layout on the device (no host sync), one program
        name="moe_align",
        kernel="dsv4_kernels.moe_align:moe_align_kernel",
        references=("dsv4_kernels.fp4_moe_ref:moe_align_ref",),
        test_module="tests/kernels/test_fp4_moe.py",
        compile_configs="dsv4_kernels.moe_align:COMPILE_CONFIGS",
    ),
    KernelSpec(  # the MoE output: the routes' fp32 sum, the shared expert's (and CPU experts') add, the cast
        name="moe_combine",
        kernel="dsv4_kernels.moe_combine:moe_combine_kernel",
        references=("dsv4_kernels.moe_combine_ref:moe_combine_ref",),
        test_module="tests/kernels/test_moe_combine.py",
        compile_configs="dsv4_kernels.moe_combine:COMPILE_CONFIGS",
    ),
    KernelSpec(  # the MoE output combined inside the mHC post launch that reads it (moe_combine, then hc_post)
        name="hc_post_combine",
        kernel="dsv4_kernels.hc_post_combine:hc_post_combine_kernel",
        references=("dsv4_kernels.moe_combine_ref:moe_combine_ref", "dsv4_kernels.hc_mix_ref:hc_post_ref"),
        test_module="tests/kernels/test_hc_post_combine.py",
        compile_configs="dsv4_kernels.hc_post_combine:COMPILE_CONFIGS",
    ),
    KernelSpec(  # one kernel, two forms: decode (one token per request) and chunked prefill
        name="paged_sparse_attention",
        kernel="dsv4_kernels.sparse_attention:paged_sparse_attention_kernel",
        references=("dsv4_kernels.sparse_attention_ref:paged_sparse_attention_ref",),
        test_module="tests/kernels/test_sparse_attention.py",
        compile_configs="dsv4_kernels.sparse_attention:COMPILE_CONFIGS",
    ),
    KernelSpec(
        name="indexer_topk",
        kernel="dsv4_kernels.indexer_topk:indexer_score_kernel",
        references=("dsv4_kernels.indexer_topk_ref:indexer_topk_ref",),
        test_module="tests/kernels/test_indexer_topk.py",
        compile_configs="dsv4_kernels.indexer_topk:COMPILE_CONFIGS",
    ),
    KernelSpec(  # the indexer's choice: a radix select of each row's k-th score, ties to the earlier entry
        name="indexer_topk_select",
        kernel="dsv4_kernels.indexer_topk_select:topk_select_kernel",
        references=("dsv4_kernels.indexer_topk_ref:topk_from_scores_ref",),
        test_module="tests/kernels/test_indexer_topk.py",
        compile_configs="dsv4_kernels.indexer_topk_select:COMPILE_CONFIGS",
    ),
    KernelSpec(
        name="compressor_pool",
        kernel="dsv4_kernels.compressor_pool:compressor_pool_kernel",
        references=("dsv4_kernels.compressor_pool_ref:compressor_pool_ref",),
        test_module="tests/kernels/test_compressor_pool.py",
        compile_configs="dsv4_kernels.compressor_pool:COMPILE_CONFIGS",
    ),
    KernelSpec(  # a decode step's compressor update: carry, pooling, entry and previous half in one launch
        name="compressor_decode",
        kernel="dsv4_kernels.compressor_decode:compressor_decode_kernel",
        references=("dsv4_kernels.compressor_decode_ref:compressor_decode_ref",),
        test_module="tests/kernels/test_compressor_decode.py",
        compile_configs="dsv4_kernels.compressor_decode:COMPILE_CONFIGS",
    ),
    KernelSpec(
        name="head_logits",
        kernel="dsv4_kernels.head_logits:head_logits_kernel",
        references=("dsv4_kernels.head_logits_ref:head_logits_ref",),
        test_module="tests/kernels/test_head_logits.py",
        compile_configs="dsv4_kernels.head_logits:COMPILE_CONFIGS",
    ),
    KernelSpec(  # one kernel, three forms: hc_pre (mixes, norm, Sinkhorn, x), hc_head, hc_post
        name="hc_mix",
        kernel="dsv4_kernels.hc_mix:hc_mix_kernel",
        references=(
            "dsv4_kernels.hc_mix_ref:hc_pre_ref",
            "dsv4_kernels.hc_mix_ref:hc_head_ref",
            "dsv4_kernels.hc_mix_ref:hc_post_ref",
        ),
        test_module="tests/kernels/test_hc_mix.py",
        compile_configs="dsv4_kernels.hc_mix:COMPILE_CONFIGS",
    ),
    KernelSpec(  # one kernel, six chains: RMSNorm / per-head RMS, RoPE, FP8 nope or Hadamard + FP4
        name="token_rows",
        kernel="dsv4_kernels.token_ops:token_rows_kernel",
        references=(
            "dsv4_kernels.token_ops_ref:rms_norm_ref",
            "dsv4_kernels.token_ops_ref:q_head_norm_rope_ref",
            "dsv4_kernels.token_ops_ref:kv_norm_rope_quant_ref",
            "dsv4_kernels.token_ops_ref:rope_ref",
            "dsv4_kernels.token_ops_ref:indexer_q_ref",
            "dsv4_kernels.token_ops_ref:compressed_entry_ref",
        ),
        test_module="tests/kernels/test_token_ops.py",
        compile_configs="dsv4_kernels.token_ops:COMPILE_CONFIGS",
    ),
    KernelSpec(  # the MoE router's fp32 logits, as partial sums over D slices (learned layers)
        name="router_logits",
        kernel="dsv4_kernels.router:router_logits_kernel",
        references=("dsv4_kernels.router_ref:router_ref",),
        test_module="tests/kernels/test_router.py",
        compile_configs="dsv4_kernels.router:LOGITS_CONFIGS",
    ),
    KernelSpec(  # one token a program: scores, top-k with bias or hash ids, gather, normalize, scale
        name="router_select",
        kernel="dsv4_kernels.router:router_select_kernel",
        references=("dsv4_kernels.router_ref:router_ref", "dsv4_kernels.router_ref:scores_ref"),
        test_module="tests/kernels/test_router.py",
        compile_configs="dsv4_kernels.router:SELECT_CONFIGS",
    ),
    KernelSpec(  # the shared expert's w1 + w3 FP8 GEMM with the clamped SwiGLU and FP8 quantization epilogue
        name="fp8_swiglu",
        kernel="dsv4_kernels.fp8_swiglu:fp8_swiglu_kernel",
        references=("dsv4_kernels.fp8_swiglu_ref:fp8_swiglu_ref", "dsv4_kernels.fp8_swiglu_ref:shared_expert_ref"),
        test_module="tests/kernels/test_fp8_swiglu.py",
        compile_configs="dsv4_kernels.fp8_swiglu:COMPILE_CONFIGS",
    ),
)

KERNELS_BY_NAME = MappingProxyType({spec.name: spec for spec in KERNELS})
