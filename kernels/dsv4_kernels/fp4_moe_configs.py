"""The compile checks' view of the grouped MXFP4 GEMM (fp4_moe.py): the launch signatures, the configurations
its wrappers launch (decode and prefill tiles, with and without the expert-slot cache's second source, the
tuned decode splits) and their launch options per arch (registry.py reads COMPILE_CONFIGS, LAUNCH_OPTIONS,
LAUNCH_ARCHS and ALIGNED_INTS here; tests/kernels/test_compile.py builds them for sm_90 and sm_120)."""

from __future__ import annotations

from dsv4_kernels.fp4_moe_choices import _num_warps

_SIG = {
    "a_ptr": "*fp8e4nv",
    "a_scale_ptr": "*fp32",
    "w_ptr": "*u8",
    "w_scale_ptr": "*u8",
    "w3_ptr": "*u8",
    "w3_scale_ptr": "*u8",
    "sw_ptr": "*u8",
    "sw_scale_ptr": "*u8",
    "sw3_ptr": "*u8",
    "sw3_scale_ptr": "*u8",
    "slot_of_expert_ptr": "*i32",
    "out_ptr": "*bf16",
    "out_scale_ptr": "*bf16",
    "part_ptr": "*fp32",
    "count_ptr": "*i32",
    "topk_weight_ptr": "*fp32",
    "sorted_ids_ptr": "*i32",
    "expert_ids_ptr": "*i32",
    "num_routes": "i32",
    "N": "i32",
    "K": "i32",
    "limit": "fp32",
    "stride_am": "i32",
    "stride_asm": "i32",
    "stride_we": "i32",
    "stride_wn": "i32",
    "stride_wse": "i32",
    "stride_wsn": "i32",
    "stride_om": "i32",
    "stride_osm": "i32",
    "stride_ps": "i32",
    "A_ROW_DIV": "constexpr",
    "GATE_UP": "constexpr",
    "QUANT_A": "constexpr",
    "QUANT_OUT": "constexpr",
    "SLOTS": "constexpr",
    "BLOCK_M": "constexpr",
    "BLOCK_N": "constexpr",
    "BLOCK_K": "constexpr",
    "EVEN_K": "constexpr",
    "DOT_FP32": "constexpr",
    "ROUND_BITS": "constexpr",
    "EVEN_ODD": "constexpr",
    "PREFETCH": "constexpr",
    "SPLIT_K": "constexpr",
    "LATE_SCALE": "constexpr",
}
# what the model launches: gate/up reads bf16 x (a_scale_ptr: x's own pointer, unread) and stores e4m3 act
# with fp32 scales; the down GEMM reads those and stores bf16 (out_scale_ptr: its own output, unread)
_GATE_UP_SIG = {**_SIG, "a_ptr": "*bf16", "a_scale_ptr": "*bf16", "out_ptr": "*fp8e4nv", "out_scale_ptr": "*fp32"}
# multiples of 16 at DeepSeek-V4-Flash's dims (registry.py; D=4096, I=2048): N, K, the weight strides
# and the scale strides K/32, the row strides of x / act (K) and of the down output (D); not the route
# count, nor the activation-scale strides K/128 (16 for D, but 16 also divides I/128 = 16: kept out, as
# the scale row strides of a tiny model are not)
ALIGNED_INTS = ("N", "K", "stride_am", "stride_we", "stride_wn", "stride_wse", "stride_wsn", "stride_om")
_GPU = {
    "EVEN_K": True,
    "DOT_FP32": False,
    "ROUND_BITS": False,
    "EVEN_ODD": False,
    "PREFETCH": False,
    "SPLIT_K": 1,
    "LATE_SCALE": False,
}
_GATE_UP = {**_GPU, "A_ROW_DIV": 6, "GATE_UP": True, "QUANT_A": True, "QUANT_OUT": True, "BLOCK_N": 128}
_DOWN = {**_GPU, "A_ROW_DIV": 1, "GATE_UP": False, "QUANT_A": False, "QUANT_OUT": False, "BLOCK_N": 64}

# (config name, signature, constexprs) for the CPU compile checks (tests/kernels/test_compile.py): the
# resident experts and the expert-slot cache's two sources (SLOTS), decode and prefill tiles; the 64-row
# gate/up tile takes BLOCK_K 64 where wgmma runs (sm_90) and 32 elsewhere (pick_block_k)
_PHASES = {
    "gate_up": (("decode", 16, 64), ("prefill", 64, 64), ("prefill_bk32", 64, 32)),
    "down": (("decode", 16, 128), ("prefill", 64, 64)),
}
COMPILE_CONFIGS = tuple(
    (f"{form}_{phase}{'_slots' if slots else ''}", sig, {**base, "SLOTS": slots, "BLOCK_M": bm, "BLOCK_K": bk})
    for form, sig, base in (("gate_up", _GATE_UP_SIG, _GATE_UP), ("down", _SIG, _DOWN))
    for phase, bm, bk in _PHASES[form]
    for slots in (False, True)
) + tuple(  # the decode forms tuned/NVIDIA_H200.json picks: K split in two (split_k.py), one launch
    (f"{form}_decode_split2{'_slots' if slots else ''}", sig, {**base, "SLOTS": slots, "BLOCK_M": 16, "BLOCK_K": bk,
                                                             "SPLIT_K": 2})
    for form, sig, base, bk in (("gate_up", _GATE_UP_SIG, _GATE_UP, 64), ("down", _SIG, _DOWN, 128))
    for slots in (False, True)
) + tuple(  # the late-scale K loop (fp4_moe.py), split in two as the decode tuning takes it, for the sweep to time
    (f"{form}_decode_late_split2{'_slots' if slots else ''}", sig,
     {**base, "SLOTS": slots, "BLOCK_M": 16, "BLOCK_K": bk, "SPLIT_K": 2, "LATE_SCALE": True})
    for form, sig, base, bk in (("gate_up", _GATE_UP_SIG, _GATE_UP, 64), ("down", _SIG, _DOWN, 128))
    for slots in (False, True)
)  # fmt: skip
LAUNCH_OPTIONS = {
    name: {"num_warps": _num_warps(bool(cx["GATE_UP"]), cx["BLOCK_M"])} for name, _, cx in COMPILE_CONFIGS
}
LAUNCH_ARCHS = {
    **{name: (90,) for name, _, _ in COMPILE_CONFIGS if name.startswith("gate_up_prefill") and "bk32" not in name},
    **{name: (120,) for name, _, _ in COMPILE_CONFIGS if "bk32" in name},
}
