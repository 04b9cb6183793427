"""The MoE router (dsv4-model.md §2.8) in Triton: two launches on a learned layer, one on a hash layer,
no host sync, a grid that depends on the token count only (reference: `router_ref.router_ref`).

Contract:
  x         [N, D]  bf16 or fp32 (the compute dtype), D contiguous
  weight    [E, D]  fp32 (or bf16) as the model holds it
  bias      [E]     fp32, learned layers: added to the scores to choose, never to weigh
  tid2eid   [V, k]  int64 (unit last stride) and token_ids [N] int32 / int64, hash layers: the ids as stored
  route_rows [N] int32, optional: token t takes the routing of token route_rows[t] (a padding row of a
            static decode bucket takes a request's: worker/graphs.py), read on the device
  returns   (weights fp32 [N, k], ids int64 [N, k])

1. `router_logits_kernel` (learned layers, and softmax on hash layers, whose normalizer needs every
   logit): logits = x @ W^T in fp32 (an IEEE fp32 dot: FMA, not TF32), tiles of 16 tokens x 32
   experts, the D axis cut into `num_splits` slices that each write their partial sum, so a decode step
   (N = 1: 8 expert tiles at E = 256) still spreads the 4 MB weight read over ~128 programs; no atomics,
   so the sum is the same on every run.
2. `router_select_kernel`, one program per token: the partials summed in slice order, the score
   function in fp64 rounded to fp32 (the reference's `in_fp64`; given equal logits the scores are the
   reference's unless an fp64 result lies within a few fp64 ulps of an fp32 rounding boundary), and
   then either the top k of scores + bias, k rounds of "largest value, lowest id among equal ones"
   (the reference's stable-sort rule; torch.topk on the CPU orders ties arbitrarily), or the hash
   ids; the chosen scores, normalized (a k-term fp32 sum, whose order may differ from torch's by an
   ulp) and scaled. On a hash layer (DIRECT) the program computes the logits of its k ids itself, k
   dot products of D, instead of all E: one launch, k / E of the weight read.

softplus follows torch's: z above 20 is returned as is, else log1p(exp(z)), with log1p(u) =
u log(1 + u) / ((1 + u) - 1) (exact to a few fp64 ulps, invisible after the fp32 rounding; Triton has
no log1p the interpreter also runs). The interpreter has no bf16 arithmetic: x is upcast after loading.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_kernels.outputs import output_buffer
from dsv4_kernels.router_ref import SCORE_FUNCS

BLOCK_T, BLOCK_E, BLOCK_D = 16, 32, 64  # the logits tile (16: the smallest dot tile)
SPLIT_MIN_D = 256  # the shortest D slice worth its own partial sum
TARGET_PROGRAMS = 128  # about one per SM on an H100 / H200: a decode step reads W at full width


@triton.jit
def router_logits_kernel(
    x_ptr,
    w_ptr,
    part_ptr,
    N,
    E,
    D,
    d_per_split,
    stride_xn,
    stride_we,
    stride_ps,
    stride_pn,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """partial[s, t, e] = sum over the D slice s (d_per_split, a multiple of BLOCK_D) of x[t] * W[e]."""
    pid_t = tl.program_id(0)
    pid_e = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    t_ok = offs_t < N
    e_ok = offs_e < E
    d_begin = pid_s * d_per_split
    d_end = tl.minimum(d_begin + d_per_split, D)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for d0 in range(d_begin, d_end, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_d < d_end
        x = tl.load(
            x_ptr + offs_t[:, None] * stride_xn + offs_d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + offs_e[:, None] * stride_we + offs_d[None, :], mask=e_ok[:, None] & d_ok[None, :], other=0.0
        )
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    p_ptrs = part_ptr + pid_s * stride_ps + offs_t.to(tl.int64)[:, None] * stride_pn + offs_e[None, :]
    tl.store(p_ptrs, acc, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _log1p(u):
    """log(1 + u) for u >= 0 without cancellation (fp64)."""
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))


@triton.jit
def _scores(z, ok, SCORE: tl.constexpr):
    """fp32 logits (masked lanes: anything) -> fp32 scores, the function evaluated in fp64. SCORE: 0
    sqrt(softplus), 1 sigmoid, 2 softmax over the `ok` lanes (the others come out 0)."""
    z = z.to(tl.float64)
    if SCORE == 0:
        s = tl.sqrt(tl.where(z > 20.0, z, _log1p(tl.exp(tl.minimum(z, 20.0)))))
    elif SCORE == 1:
        s = 1.0 / (1.0 + tl.exp(-z))
    else:
        z = tl.where(ok, z, float("-inf"))
        e = tl.exp(z - tl.max(z, axis=0))
        s = e / tl.sum(e, axis=0)
    return s.to(tl.float32)


@triton.jit
def router_select_kernel(
    part_ptr,
    x_ptr,
    w_ptr,
    bias_ptr,
    tid2eid_ptr,
    token_ptr,
    rows_ptr,
    weights_ptr,
    ids_ptr,
    E,
    D,
    num_splits,
    route_scale,
    stride_ps,
    stride_pn,
    stride_xn,
    stride_we,
    stride_tv,
    stride_wn,
    stride_in,
    TOPK: tl.constexpr,
    SCORE: tl.constexpr,
    HASH: tl.constexpr,
    DIRECT: tl.constexpr,
    NORM: tl.constexpr,
    ROUTE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One token: its k ids and routing weights (module doc). HASH: ids from tid2eid[token]; DIRECT
    (HASH, not softmax): their logits computed here from x and W, no partials read. ROUTE: the token's
    inputs are those of token rows_ptr[t] (its partials, x row and token id); the outputs are its own."""
    t = tl.program_id(0)
    src = tl.load(rows_ptr + t).to(tl.int64) if ROUTE else t.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < TOPK
    if HASH:
        token = tl.load(token_ptr + src).to(tl.int64)
        ids = tl.load(tid2eid_ptr + token * stride_tv + offs_k, mask=k_ok, other=0).to(tl.int32)
    if DIRECT:
        acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
        w_rows = w_ptr + ids.to(tl.int64)[:, None] * stride_we
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            x = tl.load(x_ptr + src * stride_xn + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            w = tl.load(w_rows + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        picked = tl.where(k_ok, _scores(acc, k_ok, SCORE), 0.0)
    else:
        offs_e = tl.arange(0, BLOCK_E)
        e_ok = offs_e < E
        logits = tl.zeros((BLOCK_E,), dtype=tl.float32)
        for s in range(0, num_splits):  # slice order: the same sum on every run
            logits += tl.load(part_ptr + s * stride_ps + src * stride_pn + offs_e, mask=e_ok, other=0.0)
        scores = _scores(logits, e_ok, SCORE)
        picked = tl.zeros((BLOCK_K,), dtype=tl.float32)
        if not HASH:
            ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
            v = tl.where(e_ok, scores + tl.load(bias_ptr + offs_e, mask=e_ok, other=0.0), float("-inf"))
        for j in tl.static_range(TOPK):
            if HASH:
                e_j = tl.sum(tl.where(offs_k == j, ids, 0), axis=0)
            else:
                top = tl.max(v, axis=0)
                e_j = tl.min(tl.where(v == top, offs_e, BLOCK_E), axis=0)  # the lowest id among equal values
                v = tl.where(offs_e == e_j, float("-inf"), v)
                ids = tl.where(offs_k == j, e_j, ids)
            s_j = tl.sum(tl.where(offs_e == e_j, scores, 0.0), axis=0)
            picked = tl.where(offs_k == j, s_j, picked)
    if NORM:
        picked = tl.div_rn(picked, tl.broadcast_to(tl.sum(picked, axis=0), (BLOCK_K,)))
    tl.store(weights_ptr + t.to(tl.int64) * stride_wn + offs_k, picked * route_scale, mask=k_ok)
    tl.store(ids_ptr + t.to(tl.int64) * stride_in + offs_k, ids.to(tl.int64), mask=k_ok)


def pick_splits(n: int, e: int, d: int) -> int:
    """How many D slices the logits take: enough programs for TARGET_PROGRAMS (a decode step has few
    tokens), each slice at least SPLIT_MIN_D long; a power of two, 1 once the token tiles fill the GPU."""
    tiles = triton.cdiv(n, BLOCK_T) * triton.cdiv(e, BLOCK_E)
    splits = 1
    while splits * 2 * tiles <= TARGET_PROGRAMS and d // (splits * 2) >= SPLIT_MIN_D:
        splits *= 2
    return splits


def router_logits(x: torch.Tensor, weight: torch.Tensor, num_splits: int | None = None) -> torch.Tensor:
    """x [N, D], weight [E, D] -> the logits' partial sums fp32 [S, N, E] over S D slices
    (`num_splits`, default `pick_splits`; fewer when D has fewer BLOCK_D steps)."""
    n, d = x.shape
    e = weight.shape[0]
    splits = num_splits or pick_splits(n, e, d)
    per_split = triton.cdiv(triton.cdiv(d, splits), BLOCK_D) * BLOCK_D
    grid = (triton.cdiv(n, BLOCK_T), triton.cdiv(e, BLOCK_E), triton.cdiv(d, per_split))
    part = torch.empty((grid[2], n, e), dtype=torch.float32, device=x.device)
    router_logits_kernel[grid](
        x, weight, part, n, e, d, per_split, x.stride(0), weight.stride(0), part.stride(0), part.stride(1),
        BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, BLOCK_D=BLOCK_D,
    )  # fmt: skip
    return part


def router_select(
    part: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    score_func: str,
    route_scale: float,
    norm_topk_prob: bool,
    tid2eid: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    outs: tuple[torch.Tensor, torch.Tensor] | None = None,
    route_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token launch: `part` [S, N, E] fp32 (unit last stride) from `router_logits`, or None on a
    hash layer without softmax (the logits of its ids are computed here from x and weight); `route_rows`:
    the module contract's."""
    n, d = x.shape
    e = weight.shape[0]
    if part is None:
        if tid2eid is None or score_func == "softmax":
            raise ValueError("only a hash layer without softmax computes its own logits (part=None)")
        src, num_splits, stride_ps, stride_pn = x, 1, 0, 0  # DIRECT: src is never read
    elif part.shape[1:] != (n, e) or part.stride(-1) != 1 or part.dtype != torch.float32:
        raise ValueError(f"partial logits must be fp32 [S, {n}, {e}] with unit last stride, got {tuple(part.shape)}")
    else:
        src, num_splits, stride_ps, stride_pn = part, part.shape[0], part.stride(0), part.stride(1)
    if (tid2eid is None) != (token_ids is None):
        raise ValueError("a hash layer passes both tid2eid and token_ids, a learned layer neither")
    if route_rows is not None and (
        tuple(route_rows.shape) != (n,) or route_rows.dtype != torch.int32 or route_rows.device != x.device
    ):
        got = f"{tuple(route_rows.shape)} {route_rows.dtype} on {route_rows.device}"
        raise ValueError(f"route_rows must be int32 [{n}] on {x.device}, got {got}")
    weights = output_buffer(outs[0] if outs else None, (n, k), torch.float32, x.device)
    ids = output_buffer(outs[1] if outs else None, (n, k), torch.int64, x.device)
    bias = bias.float() if bias is not None else weights  # hash: never read
    # learned layers: the table and tokens are never read
    table, tokens = (tid2eid, token_ids.contiguous()) if tid2eid is not None and token_ids is not None else (ids, ids)
    rows = route_rows.contiguous() if route_rows is not None else ids  # never read without ROUTE
    router_select_kernel[(n,)](
        src, x, weight, bias, table, tokens, rows, weights, ids,
        e, d, num_splits, float(route_scale), stride_ps, stride_pn,
        x.stride(0), weight.stride(0), table.stride(0), weights.stride(0), ids.stride(0),
        TOPK=k, SCORE=SCORE_FUNCS.index(score_func), HASH=tid2eid is not None, DIRECT=part is None,
        NORM=norm_topk_prob and score_func != "softmax", ROUTE=route_rows is not None,
        BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(k), BLOCK_D=select_block_d(d),
    )  # fmt: skip
    return weights, ids


def router(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    score_func: str,
    route_scale: float,
    norm_topk_prob: bool,
    tid2eid: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    num_splits: int | None = None,
    outs: tuple[torch.Tensor, torch.Tensor] | None = None,
    route_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module contract: one launch on a hash layer (unless softmax), two otherwise.
    `num_splits`: as `router_logits`; `outs`: (weights fp32 [N, k], ids int64 [N, k]) buffers."""
    n, d = x.shape
    e = weight.shape[0]
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"unknown score function {score_func!r}; expected one of {SCORE_FUNCS}")
    if weight.shape[1] != d or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"x [N, {d}] and weight [E, {d}] need a contiguous last dim, got {tuple(weight.shape)}")
    if k > e:
        raise ValueError(f"top {k} of {e} experts")
    if tid2eid is not None:
        if token_ids is None or tid2eid.shape[1] != k or tid2eid.stride(-1) != 1 or tuple(token_ids.shape) != (n,):
            raise ValueError(f"hash routing needs tid2eid [V, {k}] (unit last stride) and token_ids [{n}]")
    elif bias is None or tuple(bias.shape) != (e,):
        raise ValueError(f"learned routing needs a bias [{e}]")
    direct = tid2eid is not None and score_func != "softmax"
    part = None if direct else router_logits(x, weight, num_splits)
    return router_select(
        part, x, weight, bias, k, score_func, route_scale, norm_topk_prob, tid2eid, token_ids, outs, route_rows
    )


def select_block_d(d: int) -> int:
    """The DIRECT dot's D step: 256 (at 512 the sm_90 build spills), less for a narrower model."""
    return min(256, triton.next_power_of_2(d))


def interpreting() -> bool:
    """True when @triton.jit builds interpreter functions (TRITON_INTERPRET=1 at import time)."""
    return not isinstance(router_select_kernel, triton.runtime.JITFunction)


# the CPU compile checks (tests/kernels/test_compile.py), at DeepSeek-V4-Flash's router: E = 256 experts,
# top 6, D = 4096, sqrt(softplus), bf16 activations, the fp32 weight; ALIGNED_INTS holds for both kernels
# (E, D, and the strides that are multiples of them)
_I32 = "i32"
LOGITS_SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*fp32", "part_ptr": "*fp32", "N": _I32, "E": _I32, "D": _I32, "d_per_split": _I32,
    "stride_xn": _I32, "stride_we": _I32, "stride_ps": _I32, "stride_pn": _I32,
    "BLOCK_T": "constexpr", "BLOCK_E": "constexpr", "BLOCK_D": "constexpr",
}  # fmt: skip
SELECT_SIGNATURE = {
    "part_ptr": "*fp32", "x_ptr": "*bf16", "w_ptr": "*fp32", "bias_ptr": "*fp32", "tid2eid_ptr": "*i64",
    "token_ptr": "*i32", "rows_ptr": "*i32", "weights_ptr": "*fp32", "ids_ptr": "*i64", "E": _I32, "D": _I32,
    "num_splits": _I32, "route_scale": "fp32", "stride_ps": _I32, "stride_pn": _I32, "stride_xn": _I32,
    "stride_we": _I32, "stride_tv": _I32, "stride_wn": _I32, "stride_in": _I32,
    **{c: "constexpr" for c in ("TOPK", "SCORE", "HASH", "DIRECT", "NORM", "ROUTE", "BLOCK_E", "BLOCK_K", "BLOCK_D")},
}  # fmt: skip
ALIGNED_INTS = ("E", "D", "stride_xn", "stride_we", "stride_pn")
_SELECT = {"TOPK": 6, "SCORE": 0, "NORM": True, "BLOCK_E": 256, "BLOCK_K": 8, "BLOCK_D": 256}
LOGITS_CONFIGS = (("logits", LOGITS_SIGNATURE, {"BLOCK_T": BLOCK_T, "BLOCK_E": BLOCK_E, "BLOCK_D": BLOCK_D}),)
SELECT_CONFIGS = (
    # a learned layer: tid2eid_ptr, token_ptr and rows_ptr are the ids output's (never read)
    ("select_topk", {**SELECT_SIGNATURE, "token_ptr": "*i64", "rows_ptr": "*i64"}, {**_SELECT, "HASH": False,
     "DIRECT": False, "ROUTE": False}),
    # the same in a static decode bucket (worker/graphs.py): padding rows read a request's inputs
    ("select_topk_bucket", {**SELECT_SIGNATURE, "token_ptr": "*i64"}, {**_SELECT, "HASH": False, "DIRECT": False,
     "ROUTE": True}),
    # a hash layer in a static decode bucket (token ids int32, as the batch layout holds them): part_ptr is x's
    # own pointer (never read), bias_ptr the weights output's
    ("select_hash_bucket", {**SELECT_SIGNATURE, "part_ptr": "*bf16"}, {**_SELECT, "HASH": True, "DIRECT": True,
     "ROUTE": True}),
)  # fmt: skip
