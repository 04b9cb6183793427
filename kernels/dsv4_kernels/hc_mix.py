"""The mHC mixing (dsv4-model.md §2.1) in Triton: hc_pre, hc_post and hc_head, one launch each.

Contract (reference: `hc_mix_ref`; hc = hc_mult, K = hc * D, n_mix = (2 + hc) * hc):
  hc_pre   h [N, hc, D] bf16 or fp32, fn [n_mix, K] fp32, scale [3], base [n_mix] fp32
           -> x [N, D] in h's dtype, post [N, hc] fp32, comb [N, hc, hc] fp32, where
           m = (fn . flat(h)) * rsqrt(mean(flat(h)^2) + norm_eps), pre = sigmoid(m[:hc] s0 + b) + hc_eps,
           post = 2 sigmoid(m[hc:2hc] s1 + b), comb = Sinkhorn(m[2hc:] s2 + b) (a row softmax + eps, a
           column normalization, then n_iters - 1 row / column rounds), x = sum_k pre[k] h[k]
  hc_post  out [N, D], h [N, hc, D], post, comb -> new [N, hc, D] in h's dtype,
           new[k] = post[k] out + sum_j comb[j, k] h[j]
  hc_head  like hc_pre with fn [hc, K], scale [1], base [hc], no post and no Sinkhorn: -> x only
  `norm` = (weight [D] fp32, eps), on hc_pre and hc_head: x leaves RMS-normalized, weight * (x * r) with
           r = 1 / sqrt(mean(x^2) + eps) over x as its dtype holds it (the sub-layer's RMSNorm, layers.RMSNorm /
           token_ops.rms_norm, in the same program: one launch a site fewer; un-normed x is never stored)
Everything after the loads runs in fp32 (the torch path evaluates sigmoid and softmax in fp64 and
rounds: tests/kernels/test_hc_mix.py states the tolerance). Launch shapes depend on N only, never on
the data (CUDA graphs).

One kernel, three forms (MODE), as one launch each:
- pre / head: a program takes BLOCK_N tokens. It streams their flat rows once, accumulating the sum of
  squares and the [BLOCK_N, 2 hc'^2] mixes (hc' = hc rounded up to a power of two, at least 4: the
  comb logits in the first hc'^2 columns, pre and post in the next two rows of hc'), then does the
  norm, the sigmoids and the 20 Sinkhorn rounds on the [BLOCK_N, hc', hc'] tile in registers, and
  reads its tokens' streams a second time for x (32 KiB a token at the real sizes: from L2 for
  small blocks, partly from HBM again for 64-token blocks, whose ~130 programs touch ~270 MiB).
- post: a program takes BLOCK_D channels of one token: reads out and the hc streams once, writes the
  hc new streams.

Why this layout: the mixes are a [N, 16384] x [16384, 24] product, memory-bound on h (32 KiB a token)
but fn (1.5 MiB) is read by every program, from L2. Tokens per program trade fn's L2 traffic against
spreading the work over the SMs (pick_block_n): one token per program for decode batches, 16 or 64
tokens per program with tl.dot above that, cutting fn's reads to 96 or 24 KiB a token.
Decode batches split K (PHASE, pick_splits): one SM streaming all of fn's 1.5 MiB took ~100 us a call on
an H200 (bench/gpu_profile.py: 28% of a batch-1 decode step), so up to DECODE_TOKENS tokens run two
launches: PHASE 1, a program per (token, SPLIT_K = 256 values of the flat row), writes the token's partial
mixes and sum of squares [N, splits, 2 hcp^2 + 1] (fp32); PHASE 2, a program per token, sums them in a
fixed order (split by split, whatever N is: batch invariant) and goes on as the one-launch form does
(PHASE 0). Measured there: the mHC kernels of a 2-layer batch-1 step went from 560 to 69 us.
Blocks: a bf16 h times fp32 fn goes on the tensor cores as three bf16 products, fn = hi + mid + lo
split exactly in registers (as head_logits does with y): every product is exact and the sum is fp32.
fp32 h takes an fp32 "ieee" dot.

Under the Triton interpreter bf16 tiles are upcast right after the load and the dots run in fp32
(toolchain.md); its fp32 -> bf16 cast truncates, so the wrapper has the kernel round to nearest even
by hand first (ROUND_BF16), like torch.

The kernel's pieces (@triton.jit helpers) are in hc_mix_tiles.py; this module holds the kernel, the launch
choices, the wrappers and the compile configurations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4_kernels.hc_mix_tiles import _partial_sums, _post, _pre_or_head
from dsv4_kernels.outputs import output_buffer

MODE_PRE, MODE_HEAD, MODE_POST = 0, 1, 2
DOT_NONE, DOT_FP32, DOT_BF16X3 = 0, 1, 2  # FMA (one token a program), fp32 tl.dot, three bf16 tl.dots
MAX_HC = 8
POST_BLOCK_D = 512
POST_VALUES = 2048  # a post program's new values: [hc 4, 512 channels] at the real dims, more tokens where D is small
NUM_WARPS = 4
NUM_STAGES = 3
# BLOCK_N -> (BLOCK_K of the mixes loop, BLOCK_D of the x loop): ~4K fp32 values a tile (32 a thread)
TILES = {1: (128, 1024), 16: (64, 64), 64: (64, 16)}
PHASE_WHOLE, PHASE_PARTIAL, PHASE_FINISH = 0, 1, 2  # one launch; the split-K sums; the rest from them
DECODE_TOKENS = 64  # up to this many tokens, one token a program on a GPU (pick_block_n), K split (pick_splits)
SPLIT_K = 256  # flat-row values a PHASE 1 program sums (two fn tiles of TILES[1]'s 128): 64 splits at K = 16384
_SPLIT_K = tl.constexpr(SPLIT_K)  # the kernel's view of it


def interpreting() -> bool:
    """True when @triton.jit builds interpreter functions (TRITON_INTERPRET=1 at import time)."""
    return not isinstance(hc_mix_kernel, triton.runtime.JITFunction)


@triton.jit
def hc_mix_kernel(
    h_ptr, fn_ptr, scale_ptr, base_ptr, x_ptr, post_ptr, comb_ptr, new_ptr, part_ptr, nw_ptr,
    N, D, stride_hn, stride_xn, stride_pn, stride_cn, stride_cj, stride_yn, stride_yk, stride_qn, n_splits,
    n_iters, hc_eps, norm_eps, x_eps,
    HC: tl.constexpr, HCP: tl.constexpr, MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT: tl.constexpr, ROUND_BF16: tl.constexpr, PHASE: tl.constexpr,
    NORM: tl.constexpr = False,
):  # fmt: skip
    """MODE 0 (pre): reads h, fn, scale, base; writes x, post, comb. MODE 1 (head): the same, x only.
    MODE 2 (post): reads x (the sub-layer output), h, post, comb; writes new. Pointers a form does not
    use are placeholders. PHASE (pre / head, module doc): 0 one launch; 1 the split-K partial sums into
    part [N, n_splits, 2 HCP^2 + 1] (grid (N, n_splits)); 2 the rest, from those partials. NORM (pre / head,
    PHASE 0 or 2): x leaves RMS-normalized with the weight at nw_ptr and x_eps (the module's `norm`)."""
    if MODE == 2:
        _post(
            x_ptr, h_ptr, post_ptr, comb_ptr, new_ptr,
            N, D, stride_hn, stride_xn, stride_pn, stride_cn, stride_cj, stride_yn, stride_yk,
            HC, HCP, BLOCK_N, BLOCK_D, ROUND_BF16,
        )  # fmt: skip
    elif PHASE == 1:
        _partial_sums(h_ptr, fn_ptr, part_ptr, N, D, stride_hn, stride_qn, HC, HCP, MODE, BLOCK_N, _SPLIT_K, BLOCK_K)
    else:
        _pre_or_head(
            h_ptr, fn_ptr, scale_ptr, base_ptr, x_ptr, post_ptr, comb_ptr, part_ptr, nw_ptr,
            N, D, stride_hn, stride_xn, stride_pn, stride_cn, stride_cj, stride_qn, n_splits, n_iters, hc_eps,
            norm_eps, x_eps, HC, HCP, MODE, BLOCK_N, BLOCK_K, BLOCK_D, DOT, ROUND_BF16, PHASE, NORM,
        )  # fmt: skip


def pick_block_n(n: int, batch_invariant: bool = False, interpreter: bool | None = None) -> int:
    """Tokens per hc_pre / hc_head program: one for decode batches (up to DECODE_TOKENS; K split over 64
    programs a token, pick_splits: 0.106 ms a batch-1 call on an H200, launch included, where one program
    streaming all of fn took ~100 us of device time), 16 up to 2048 tokens (fn read from L2 once per 16 tokens,
    128 programs at 2048), 64 beyond (24 KiB of fn a token; a wave of the SMs from ~8K tokens; 0.53 ms at 4,096
    tokens there). Batch-invariant numerics take one always: a token's sums then never depend on the tokens
    beside it.
    Under the Triton interpreter (`interpreter`, default: whether it is on) a program costs ~0.5 s of Python
    whatever its size (the 20 Sinkhorn rounds re-enter the interpreter per program), so blocks of 16 run
    from two tokens on: whole-model tests on the CPU take minutes less. The unit tests run every form."""
    if batch_invariant:
        return 1
    if interpreter if interpreter is not None else interpreting():
        return 1 if n == 1 else 16
    if n <= DECODE_TOKENS:
        return 1
    return 16 if n <= 2048 else 64


def pick_splits(k: int, n: int, block_n: int) -> int:
    """Programs per token block that split the flat row (K = hc * D values): cdiv(K, SPLIT_K), 64 at the real
    dims, for decode batches (n <= DECODE_TOKENS, where a GPU runs one token a program) and for one token a
    program at any n (batch-invariant numerics: then a token's sums never depend on the batch); 0 (the
    one-launch form) for the blocks of larger batches. The interpreter's blocks of 16 for small batches
    split too, so that the CPU census counts the launches a GPU makes."""
    return triton.cdiv(k, SPLIT_K) if block_n == 1 or n <= DECODE_TOKENS else 0


def post_tile(hc: int, d: int) -> tuple[int, int]:
    """hc_post's (tokens, channels) a program: POST_BLOCK_D channels of one token at the real dims (D = 4096: 8
    programs a token), whole rows of several tokens where D is small (dsv4-tiny's 128: 4 tokens a program, a
    quarter of the programs the interpreter runs one by one). Every value is its own token's alone."""
    block_d = min(POST_BLOCK_D, triton.next_power_of_2(d))
    return max(1, POST_VALUES // (_hcp(hc) * block_d)), block_d


def _hcp(hc: int) -> int:
    """hc rounded up to a power of two, at least 4 (the 2 hcp^2 mixes columns are a tl.dot's N >= 16)."""
    return max(4, triton.next_power_of_2(hc))


def _dot_kind(h: torch.Tensor, block_n: int) -> int:
    if block_n == 1:
        return DOT_NONE
    return DOT_BF16X3 if h.dtype == torch.bfloat16 and not interpreting() else DOT_FP32


def _streams(h: torch.Tensor) -> torch.Tensor:
    """h [N, hc, D] bf16 / fp32 with each token's hc * D values contiguous (a copy only when not)."""
    if h.dim() != 3 or h.dtype not in (torch.bfloat16, torch.float32) or not 1 <= h.shape[1] <= MAX_HC:
        raise ValueError(f"need h [N, hc <= {MAX_HC}, D] bf16 or fp32, got {h.dtype} {tuple(h.shape)}")
    return h if h.stride(2) == 1 and h.stride(1) == h.shape[2] else h.contiguous()


def _mix_params(
    h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, n_mix: int, n_scales: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fn [n_mix, hc * D], scale [n_scales], base [n_mix], as contiguous fp32."""
    k = h.shape[1] * h.shape[2]
    if tuple(fn.shape) != (n_mix, k) or tuple(scale.shape) != (n_scales,) or tuple(base.shape) != (n_mix,):
        raise ValueError(
            f"need fn [{n_mix}, {k}], scale [{n_scales}], base [{n_mix}] for h {tuple(h.shape)}, got "
            f"{tuple(fn.shape)}, {tuple(scale.shape)}, {tuple(base.shape)}"
        )
    return tuple(t.detach().float().contiguous() for t in (fn, scale, base))  # type: ignore[return-value]


def _launch_mix(h, fn, scale, base, x, post, comb, n_iters, hc_eps, norm_eps, mode, block_n, norm=None) -> None:
    """One pre or head launch, or two (split K: pick_splits); the head passes no post / comb (fn stands in,
    with zero strides); `norm`: (weight, eps) of the RMSNorm x leaves through (module doc)."""
    n, hc, d = h.shape
    block_k, block_d = TILES[block_n]
    hcp = _hcp(hc)
    post_strides = (0, 0, 0) if post is None else (post.stride(0), comb.stride(0), comb.stride(1))
    splits = pick_splits(hc * d, n, block_n)
    part = torch.empty((n, splits, 2 * hcp * hcp + 1), dtype=torch.float32, device=h.device) if splits else fn
    row = part.stride(0) if splits else 0
    nw, x_eps = (fn, 0.0) if norm is None else (_norm_weight(norm[0], d), float(norm[1]))
    ptrs = (h, fn, scale, base, x, fn if post is None else post, fn if comb is None else comb, x, part, nw)
    ints = (n, d, h.stride(0), x.stride(0), *post_strides, 0, 0, row, splits, n_iters, hc_eps, norm_eps, x_eps)
    common = {
        "HC": hc, "HCP": hcp, "MODE": mode, "BLOCK_N": block_n, "BLOCK_K": block_k, "BLOCK_D": block_d,
        "DOT": _dot_kind(h, block_n), "ROUND_BF16": interpreting() and h.dtype == torch.bfloat16,
        "num_warps": NUM_WARPS, "num_stages": NUM_STAGES,
    }  # fmt: skip
    if splits:  # the partial sums never touch x: NORM is the finishing launch's
        hc_mix_kernel[(triton.cdiv(n, block_n), splits)](*ptrs, *ints, PHASE=PHASE_PARTIAL, NORM=False, **common)
    grid = (triton.cdiv(n, block_n),)
    hc_mix_kernel[grid](*ptrs, *ints, PHASE=PHASE_FINISH if splits else PHASE_WHOLE, NORM=norm is not None, **common)


def _norm_weight(weight: torch.Tensor, d: int) -> torch.Tensor:
    if tuple(weight.shape) != (d,):
        raise ValueError(f"the RMSNorm weight must be [{d}], got {tuple(weight.shape)}")
    return weight.detach().float().contiguous()


def hc_pre(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    n_iters: int,
    hc_eps: float,
    norm_eps: float,
    block_n: int | None = None,
    x_out: torch.Tensor | None = None,
    post_out: torch.Tensor | None = None,
    comb_out: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module contract: (x [N, D] in h's dtype, post [N, hc] fp32, comb [N, hc, hc] fp32).
    The *_out buffers (unit last stride) receive the stores (tests pass NaN-poisoned views). `norm`: x leaves
    through that RMSNorm (weight, eps)."""
    h = _streams(h)
    n, hc, d = h.shape
    fn, scale, base = _mix_params(h, fn, scale, base, (2 + hc) * hc, 3)
    x = output_buffer(x_out, (n, d), h.dtype, h.device)
    post = output_buffer(post_out, (n, hc), torch.float32, h.device)
    comb = output_buffer(comb_out, (n, hc, hc), torch.float32, h.device)
    if n and n_iters < 1:
        raise ValueError(f"n_iters must be >= 1, got {n_iters}")
    if n:
        block_n = block_n or pick_block_n(n)
        _launch_mix(h, fn, scale, base, x, post, comb, n_iters, hc_eps, norm_eps, MODE_PRE, block_n, norm)
    return x, post, comb


def hc_head(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    block_n: int | None = None,
    x_out: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """See the module contract: x [N, D] in h's dtype (`norm`: through that RMSNorm)."""
    h = _streams(h)
    n, hc, d = h.shape
    fn, scale, base = _mix_params(h, fn, scale, base, hc, 1)
    x = output_buffer(x_out, (n, d), h.dtype, h.device)
    if n:
        block_n = block_n or pick_block_n(n)
        _launch_mix(h, fn, scale, base, x, None, None, 1, hc_eps, norm_eps, MODE_HEAD, block_n, norm)
    return x


def post_operands(
    h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The streams h [N, hc, D] (`_streams`), post [N, hc] and comb [N, hc, hc] as the post form reads them
    (fp32, unit last strides), their shapes checked against h's."""
    h = _streams(h)
    n, hc, _ = h.shape
    if tuple(post.shape) != (n, hc) or tuple(comb.shape) != (n, hc, hc):
        raise ValueError(
            f"need post [{n}, {hc}], comb [{n}, {hc}, {hc}] for h {tuple(h.shape)}, got "
            f"{tuple(post.shape)}, {tuple(comb.shape)}"
        )
    post = post.float() if post.stride(-1) == 1 else post.float().contiguous()
    comb = comb.float() if comb.stride(-1) == 1 else comb.float().contiguous()
    return h, post, comb


def hc_post(
    out: torch.Tensor,
    h: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    new_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See the module contract: new [N, hc, D] in h's dtype."""
    h, post, comb = post_operands(h, post, comb)
    n, hc, d = h.shape
    if tuple(out.shape) != (n, d):
        raise ValueError(f"need out [{n}, {d}] for h {tuple(h.shape)}, got {tuple(out.shape)}")
    out = out if out.stride(-1) == 1 else out.contiguous()
    new = output_buffer(new_out, (n, hc, d), h.dtype, h.device)
    if n:
        block_n, block_d = post_tile(hc, d)
        hc_mix_kernel[(triton.cdiv(n, block_n), triton.cdiv(d, block_d))](
            h, post, post, post, out, post, comb, new, post, post,
            n, d, h.stride(0), out.stride(0), post.stride(0), comb.stride(0), comb.stride(1),
            new.stride(0), new.stride(1), 0, 0, 1, 0.0, 0.0, 0.0,
            HC=hc, HCP=_hcp(hc), MODE=MODE_POST, BLOCK_N=block_n, BLOCK_K=16, BLOCK_D=block_d, DOT=DOT_NONE,
            ROUND_BF16=interpreting() and h.dtype == torch.bfloat16, PHASE=PHASE_WHOLE, num_warps=NUM_WARPS,
            num_stages=NUM_STAGES,
        )  # fmt: skip
    return new


_SIG = {
    "h_ptr": "*bf16",
    "fn_ptr": "*fp32",
    "scale_ptr": "*fp32",
    "base_ptr": "*fp32",
    "x_ptr": "*bf16",
    "post_ptr": "*fp32",
    "comb_ptr": "*fp32",
    "new_ptr": "*bf16",
    "part_ptr": "*fp32",
    "nw_ptr": "*fp32",
    **dict.fromkeys(("N", "D", "stride_hn", "stride_xn", "stride_pn", "stride_cn", "stride_cj"), "i32"),
    **dict.fromkeys(("stride_yn", "stride_yk", "stride_qn", "n_splits", "n_iters"), "i32"),
    "hc_eps": "fp32",
    "norm_eps": "fp32",
    "x_eps": "fp32",
    **dict.fromkeys(("HC", "HCP", "MODE", "BLOCK_N", "BLOCK_K", "BLOCK_D", "DOT", "ROUND_BF16", "PHASE"), "constexpr"),
    "NORM": "constexpr",
}
_ONE_ITER = {**_SIG, "n_iters": "constexpr"}  # the head and post pass n_iters = 1, which Triton makes a constant
_REAL = {"HC": 4, "HCP": 4, "ROUND_BF16": False}  # DeepSeek-V4-Flash: hc_mult 4, D 4096, bf16 streams


def _mix_config(mode: int, block_n: int, phase: int | None = None) -> dict:
    """What the wrapper launches: one token a program runs PHASE 2 after PHASE 1 (split K), blocks PHASE 0; the
    model's launches finish x through the sub-layer's RMSNorm (NORM) in the launch that writes it."""
    block_k, block_d = TILES[block_n]
    dot = DOT_NONE if block_n == 1 else DOT_BF16X3
    extra = {} if mode == MODE_PRE else {"n_iters": 1}
    phase = phase if phase is not None else PHASE_FINISH if block_n == 1 else PHASE_WHOLE
    return {
        **_REAL, "MODE": mode, "BLOCK_N": block_n, "BLOCK_K": block_k, "BLOCK_D": block_d, "DOT": dot,
        "PHASE": phase, "NORM": phase != PHASE_PARTIAL, **extra,
    }  # fmt: skip


# multiples of 16 at the real dims (registry.py): D = 4096, the stream rows 16384, x rows 4096, comb rows 16
ALIGNED_INTS = ("D", "stride_hn", "stride_xn", "stride_cn", "stride_yn", "stride_yk")

# (config name, signature, constexprs) for the CPU compile checks (tests/kernels/test_compile.py): every
# tokens-per-program choice of pick_block_n for hc_pre and hc_head (one token a program: its split-K partial
# sums, `*_part`, then PHASE 2), and hc_post
COMPILE_CONFIGS = (
    *((f"pre_bn{bn}", _SIG, _mix_config(MODE_PRE, bn)) for bn in TILES),
    *((f"head_bn{bn}", _ONE_ITER, _mix_config(MODE_HEAD, bn)) for bn in TILES),
    ("pre_part", _SIG, _mix_config(MODE_PRE, 1, PHASE_PARTIAL)),
    ("head_part", _ONE_ITER, _mix_config(MODE_HEAD, 1, PHASE_PARTIAL)),
    (
        "post",
        _ONE_ITER,
        {
            **_REAL,
            "MODE": MODE_POST,
            "BLOCK_N": post_tile(4, 4096)[0],
            "BLOCK_K": 16,
            "BLOCK_D": post_tile(4, 4096)[1],
            "DOT": DOT_NONE,
            "PHASE": PHASE_WHOLE,
            "NORM": False,
            "n_iters": 1,
        },
    ),
)
LAUNCH_OPTIONS = {name: {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES} for name, _, _ in COMPILE_CONFIGS}
