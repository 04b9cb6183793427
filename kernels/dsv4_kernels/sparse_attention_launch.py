"""How and where the paged sparse attention kernel (sparse_attention.py) is launched: the launch shape per
GPU (`launch_shape`), the split-K count (`pick_num_splits`), and the same launches declared for the CPU
compile checks (COMPILE_CONFIGS, LAUNCH_OPTIONS, LAUNCH_ARCHS, ALIGNED_INTS; registry.py reads them through
sparse_attention.py, which re-exports them)."""

from __future__ import annotations

import triton

from dsv4_kernels.registry import SHARED_PER_BLOCK


def pick_num_splits(num_programs: int, max_blocks: int, num_sms: int) -> int:
    """Key splits per (token, head group): enough programs for two waves over the SMs, but at least
    two key blocks per split (each split reloads the token's q tile and writes a partial)."""
    return max(1, min(triton.cdiv(max_blocks, 2), triton.cdiv(2 * num_sms, max(1, num_programs))))


def launch_shape(shared_per_block: int, block_h: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for a GPU whose blocks may opt in to `shared_per_block` bytes.
    Measured with ptxas at H = 64, D = 512: the [64, 512] q tile and two stages of [32, 512] keys take
    128 KiB of shared memory, which Hopper has (227 KiB a block); GPUs with ~99 KiB a block (sm_120,
    RTX 50) take BLOCK_N = 16 (88 KiB). Eight warps split the [64, 512] fp32 accumulator to 128
    registers a thread; ptxas still spills a little (tests/kernels/test_compile.py keeps the count).
    Not yet timed on a GPU (bench/gpu_cases/sparse_attention.py weighs these)."""
    return (32 if shared_per_block >= 160 * 1024 else 16), (8 if block_h >= 64 else 4), 2


COMPILE_SIGNATURE = {
    "q_ptr": "*bf16",
    "new_kv_ptr": "*bf16",
    "swa_kv_ptr": "*bf16",
    "comp_kv_ptr": "*bf16",
    "block_table_ptr": "*i32",
    "topk_ptr": "*i32",
    "cu_seqlens_ptr": "*i32",
    "start_pos_ptr": "*i32",
    "seq_slot_ptr": "*i32",
    "row_req_ptr": "*i32",
    "sink_ptr": "*fp32",
    "out_ptr": "*bf16",
    "part_acc_ptr": "*fp32",
    "part_ml_ptr": "*fp32",
    "scale_log2": "fp32",
    "num_heads": "i32",
    "num_rows": "i32",
    "ratio": "i32",
    "num_topk": "i32",
    "num_splits": "i32",
    "stride_qn": "i32",
    "stride_qh": "i32",
    "stride_new": "i32",
    "stride_swa_slot": "i32",
    "stride_swa_pos": "i32",
    "stride_comp_page": "i32",
    "stride_comp_entry": "i32",
    "stride_bt": "i32",
    "stride_topk": "i32",
    "stride_on": "i32",
    "stride_oh": "i32",
    "WINDOW": "constexpr",
    "ENTRIES_PER_PAGE": "constexpr",
    "HEAD_DIM": "constexpr",
    "COMP_MODE": "constexpr",
    "PHASE": "constexpr",
    "BLOCK_H": "constexpr",
    "BLOCK_N": "constexpr",
    "DOT_FP32": "constexpr",
}
# multiples of 16 at DeepSeek-V4-Flash's dims (registry.py): 64 heads, 512 top-k, head dim 512 strides;
# not the block table's width (pages per sequence), the row count or the split count
ALIGNED_INTS = (
    "num_heads",
    "num_topk",
    "stride_qn",
    "stride_qh",
    "stride_new",
    "stride_swa_slot",
    "stride_swa_pos",
    "stride_comp_page",
    "stride_comp_entry",
    "stride_topk",
    "stride_on",
    "stride_oh",
)
_REAL_DIMS = {"WINDOW": 128, "HEAD_DIM": 512, "BLOCK_H": 64, "DOT_FP32": False}
_FORMS = (
    ("decode_csa", {"ENTRIES_PER_PAGE": 32, "COMP_MODE": 1, "PHASE": 1}),  # split-K partials
    ("prefill_csa", {"ENTRIES_PER_PAGE": 32, "COMP_MODE": 1, "PHASE": 0}),  # one chunk, normalized
    ("decode_hca", {"ENTRIES_PER_PAGE": 1, "COMP_MODE": 2, "PHASE": 1}),  # every entry, one a page
    ("combine", {"ENTRIES_PER_PAGE": 32, "COMP_MODE": 1, "PHASE": 2}),
)  # split-K merge, no matrix product


def _launches() -> dict[str, tuple[tuple[int, int, int], tuple[int, ...]]]:
    """ "bn<BLOCK_N>" -> (the `launch_shape` at 64 heads, the archs that get it)."""
    by_shape: dict[tuple[int, int, int], list[int]] = {}
    for arch, smem in SHARED_PER_BLOCK.items():
        by_shape.setdefault(launch_shape(smem, 64), []).append(arch)
    return {f"bn{shape[0]}": (shape, tuple(archs)) for shape, archs in by_shape.items()}


# (config name, signature, constexprs) for the CPU compile checks (tests/kernels/test_compile.py), at
# DeepSeek-V4-Flash's dims: each form with the launch shape of each arch; LAUNCH_OPTIONS / LAUNCH_ARCHS:
# how and where the wrapper launches them (registry.py)
COMPILE_CONFIGS = tuple(
    (f"{form}_{tag}", COMPILE_SIGNATURE, {**_REAL_DIMS, **extra, "BLOCK_N": shape[0]})
    for tag, (shape, _) in _launches().items()
    for form, extra in _FORMS
)
LAUNCH_OPTIONS = {
    f"{form}_{tag}": {"num_warps": shape[1], "num_stages": shape[2]}
    for tag, (shape, _) in _launches().items()
    for form, _ in _FORMS
}
LAUNCH_ARCHS = {f"{form}_{tag}": archs for tag, (_, archs) in _launches().items() for form, _ in _FORMS}
