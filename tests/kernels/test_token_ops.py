"""The per-token chains (dsv4_kernels.token_ops, interpreter) against their torch references
(token_ops_ref), and the references against the model's own code (dsv4serve.model), on dsv4-tiny's dims,
odd dims (partial FP8 / FP4 blocks, widths that are not powers of two) and DeepSeek-V4-Flash's for one
token; bf16 and fp32; outputs NaN-poisoned views (an unwritten element or a store outside fails).

What must be exact, and why:
- the quantizers, on any input: the e4m3 / e2m1 roundings (ties to even), ue8m0 scales, amax floors and
  clamps are integer and power-of-two arithmetic (tests/kernels/test_token_ops_quantizers.py);
- whole chains given the model's cos / sin tables and inputs on a coarse dyadic grid (k / 16, |k| <= 32):
  every sum of squares is then exact in any order, the only arithmetic the kernel orders differently,
  so every output bit must equal the reference's, -0.0 included.

Tolerance elsewhere (`_assert_chain_close`): on generic inputs the RMS statistics sum in tile order (an
fp32 ulp or so, at most log2(D) * 2^-24 relative through a tree of sums), and with `Angles.at` the kernel
evaluates cos / sin in fp32 (within 2 ulp of the model's fp64-rounded tables): an unquantized output may
differ by one ulp of its dtype (bf16 2^-7 relative, fp32 allowed 2^-19), plus 2^-20 of its row's
largest magnitude (a rotated pair can cancel to a small value; its fp32 error is that of its inputs).
Such an ulp can move a quantized value by one step of its block's grid (or, at a scale threshold, the
block to the next scale): at most amax / 8 for e4m3 (16 or 32 quanta of the scale, amax / scale > 224)
and 2 * amax / 3 for e2m1 (2 quanta, amax / scale > 3). Elements off by more than the ulp bound must
stay rare (1%).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from dsv4_kernels.launch_guard import launch_guard
from dsv4_kernels.testing import assert_bits_equal, bits, into_poisoned
from dsv4_kernels.token_ops import (
    Angles,
    compressed_entry,
    indexer_q,
    kv_norm_rope_quant,
    q_head_norm_rope,
    rms_norm,
    rope,
)
from dsv4_kernels.token_ops_ref import (
    compressed_entry_ref,
    indexer_q_ref,
    kv_norm_rope_quant_ref,
    q_head_norm_rope_ref,
    rms_norm_ref,
    rope_cos_sin_ref,
    rope_ref,
)
from dsv4serve.model.args import ModelArgs, args_from_dicts, read_model_args
from dsv4serve.model.compressor import Compressor
from dsv4serve.model.indexer import Indexer
from dsv4serve.model.layers import RMSNorm
from dsv4serve.model.numerics import KV_BLOCK, Numerics, fp8_quant_dequant
from dsv4serve.model.rope import Rotation, apply_rope, inv_freq, rope_cos_sin

EPS = 1e-6
ULP_BOUND = {torch.bfloat16: 2.0**-7, torch.float32: 2.0**-19}  # relative, see the module doc
MAX_OFF_FRACTION = 0.01
POSITIONS = (0, 1, 37, 4095, 65_537, 1_000_003)  # up to the 1M context: large angles too


def _block_amax(ref: torch.Tensor, lo: int, hi: int, block: int) -> torch.Tensor:
    """|ref| maxima of channels [lo, hi) per block of `block`, expanded back to [..., hi - lo]."""
    part = ref[..., lo:hi].float().abs()
    pad = torch.nn.functional.pad(part, (0, (-part.shape[-1]) % block)).unflatten(-1, (-1, block))
    return pad.amax(dim=-1, keepdim=True).expand(pad.shape).flatten(-2)[..., : hi - lo]


def _assert_chain_close(out: torch.Tensor, ref: torch.Tensor, quant: tuple[str, int] | None = None) -> None:
    """The module doc's tolerance; quant = ("fp8", nope dims) or ("fp4", d): the quantized channels."""
    assert out.dtype == ref.dtype and out.shape == ref.shape and not out.isnan().any()
    o, r = out.float(), ref.float()
    err = (o - r).abs()
    # one ulp of the element, plus fp32 ulps of the row's magnitudes (a rotation can cancel to a small value)
    ulp_bound = ULP_BOUND[out.dtype] * r.abs() + 2.0**-20 * r.abs().amax(dim=-1, keepdim=True)
    bound = ulp_bound.clone()
    if quant is not None:
        kind, limit = quant
        block, step = (64, 1 / 8) if kind == "fp8" else (32, 2 / 3)
        bound[..., :limit] = torch.maximum(bound[..., :limit], step * _block_amax(ref, 0, limit, block))
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    off = (err > ulp_bound).float().mean().item()
    assert off <= MAX_OFF_FRACTION, f"{off:.2%} of elements beyond one ulp"


def _grid_values(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """k / 16 for integers |k| <= 32: squares and their sums are exact in fp32 in any order."""
    return torch.randint(-32, 33, shape, generator=gen).float() / 16


def _freqs(rope_dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))


def _angles(n: int, rope_dim: int, tables: bool, gen: torch.Generator) -> Angles:
    positions = torch.tensor(POSITIONS * (n // len(POSITIONS) + 1), dtype=torch.int32)[:n]
    positions = positions[torch.randperm(n, generator=gen)]
    freqs = _freqs(rope_dim)
    return Angles.tables(*rope_cos_sin_ref(freqs, positions)) if tables else Angles.at(positions, freqs)


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, fn) -> torch.Tensor:
    return into_poisoned(tuple(shape), dtype, lambda out: fn(out=out))


# ---- each chain against its reference ----

# grid_tables: inputs on the dyadic grid, the model's cos / sin tables: exact (module doc); random_positions:
# generic inputs, angles from positions (cos / sin in the kernel): the tolerance
MODES = ("grid_tables", "random_positions")
DTYPES = (torch.bfloat16, torch.float32)


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, mode: str, gen: torch.Generator) -> torch.Tensor:
    x = _grid_values(shape, gen) if mode == "grid_tables" else torch.randn(shape, generator=gen) * 3
    return x.to(dtype)


def _check(mode: str, out: torch.Tensor, ref: torch.Tensor, quant: tuple[str, int] | None) -> None:
    if mode == "grid_tables":
        assert_bits_equal(out, ref)
    else:
        _assert_chain_close(out, ref, quant)


def _weight(d: int, gen: torch.Generator) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(d, generator=gen)  # fp32, as the model holds norm weights


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 4096), (2, 1024), (1, 512), (5, 128), (3, 40), (4, 100)], ids=str)
def test_rms_norm(shape: tuple[int, int], dtype: torch.dtype, mode: str) -> None:
    gen = torch.Generator().manual_seed(shape[1])
    x, w = _inputs(shape, dtype, mode, gen), _weight(shape[1], gen)
    _check(mode, _poisoned(shape, dtype, lambda out: rms_norm(x, w, EPS, out=out)), rms_norm_ref(x, w, EPS), None)
    heads = x.view(shape[0], 1, shape[1])  # the per-head form (no weight) on [N, H, d]
    out = _poisoned(heads.shape, dtype, lambda out: rms_norm(heads, None, EPS, out=out))
    _check(mode, out, rms_norm_ref(heads, None, EPS), None)


HEAD_SHAPES = [(1, 4, 128, 64), (5, 4, 128, 64), (3, 3, 96, 16), (1, 64, 512, 64)]  # (N, H, d, rope dim)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=str)
def test_q_head_norm_rope(shape: tuple[int, ...], dtype: torch.dtype, mode: str) -> None:
    n, h, d, rope_dim = shape
    gen = torch.Generator().manual_seed(n * d)
    q, angles = _inputs((n, h, d), dtype, mode, gen), _angles(n, rope_dim, mode != "random_positions", gen)
    out = _poisoned(q.shape, dtype, lambda out: q_head_norm_rope(q, angles, EPS, out=out))
    _check(mode, out, q_head_norm_rope_ref(q, angles, EPS), None)


@pytest.mark.parametrize("inverse", [True, False])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=str)
def test_rope(shape: tuple[int, ...], dtype: torch.dtype, mode: str, inverse: bool) -> None:
    n, h, d, rope_dim = shape
    gen = torch.Generator().manual_seed(n + d)
    x, angles = _inputs((n, h, d), dtype, mode, gen), _angles(n, rope_dim, mode != "random_positions", gen)
    out = _poisoned(x.shape, dtype, lambda out: rope(x, angles, inverse, out=out))
    _check(mode, out, rope_ref(x, angles, inverse), None)


@pytest.mark.parametrize("kv_fp8", [True, False])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 128, 64), (5, 128, 64), (3, 96, 16), (1, 512, 64)], ids=str)
def test_kv_norm_rope_quant(shape: tuple[int, ...], dtype: torch.dtype, mode: str, kv_fp8: bool) -> None:
    n, d, rope_dim = shape  # (3, 96, 16): 80 nope dims, a partial FP8 block of 16
    gen = torch.Generator().manual_seed(n * d + rope_dim)
    kv, w = _inputs((n, d), dtype, mode, gen), _weight(d, gen)
    angles, nope = _angles(n, rope_dim, mode != "random_positions", gen), d - rope_dim
    out = _poisoned(kv.shape, dtype, lambda out: kv_norm_rope_quant(kv, w, EPS, angles, nope, 64, kv_fp8, out=out))
    ref = kv_norm_rope_quant_ref(kv, w, EPS, angles, nope, 64, kv_fp8)
    _check(mode, out, ref, ("fp8", nope) if kv_fp8 else None)


@pytest.mark.parametrize("fp4", [True, False])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 4, 128, 64), (5, 4, 128, 64), (3, 2, 16, 8), (1, 64, 128, 64)], ids=str)
def test_indexer_q(shape: tuple[int, ...], dtype: torch.dtype, mode: str, fp4: bool) -> None:
    n, h, d, rope_dim = shape  # d = 16: one partial FP4 block
    gen = torch.Generator().manual_seed(n * h + d)
    q, angles = _inputs((n, h, d), dtype, mode, gen), _angles(n, rope_dim, mode != "random_positions", gen)
    out = _poisoned(q.shape, dtype, lambda out: indexer_q(q, angles, fp4, out=out))
    _check(mode, out, indexer_q_ref(q, angles, fp4), ("fp4", d) if fp4 else None)


ENTRY_CASES = [  # (W windows, d, rope dim, mode)
    (1, 512, 64, "kv"), (5, 128, 64, "kv"), (3, 96, 16, "kv"), (1, 128, 64, "index"), (4, 128, 64, "index"),
    (2, 16, 8, "index"), (3, 128, 64, "plain"),
]  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "d", "rope_dim", "kind"), ENTRY_CASES)
def test_compressed_entry(n: int, d: int, rope_dim: int, kind: str, dtype: torch.dtype, mode: str) -> None:
    """The pooled entry is fp32; the chain runs in the compute dtype `dtype`. Angles.at names the tokens'
    positions with window = 4: the entry rotates at its window's first position."""
    gen = torch.Generator().manual_seed(n * d + len(kind))
    pooled, w = _inputs((n, d), torch.float32, mode, gen), _weight(d, gen)
    angles = _angles(n, rope_dim, True, gen)
    if mode == "random_positions":
        positions = torch.randint(0, 1 << 20, (n,), generator=gen, dtype=torch.int64)  # int64 works too
        angles = Angles.at(positions, _freqs(rope_dim, 160000.0), window=4)
    nope = d - rope_dim if kind == "kv" else 0
    out = _poisoned((n, d), dtype, lambda out: compressed_entry(pooled, w, EPS, angles, kind, dtype, nope, out=out))
    ref = compressed_entry_ref(pooled, w, EPS, angles, kind, dtype, nope)
    _check(mode, out, ref, {"kv": ("fp8", nope), "index": ("fp4", d)}.get(kind))


# ---- the references are the model's code; the kernels match it (angles from positions) ----

REPO = Path(__file__).resolve().parents[2]


def _model_args(which: str) -> ModelArgs:
    if which == "tiny":
        return args_from_dicts(json.loads((REPO / "configs" / "dsv4-tiny.json").read_text()), None, "fp4")
    return read_model_args(REPO / "tests" / "data" / "DeepSeek-V4-Flash")


def _randomize(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Norm weights near 1, projections ~ unit gain (the modules start uninitialized)."""
    for name, p in module.named_parameters():
        if isinstance(module, RMSNorm) or name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def _model_chains(args: ModelArgs, dtype: torch.dtype, n: int, gen: torch.Generator) -> list[tuple]:
    """(name, the model's output, the reference's, the kernel call, quantized channels) for each chain,
    on n tokens of a compressed (YaRN) layer; the model's lines as attention.py / indexer.py /
    compressor.py write them."""
    num = Numerics(compute_dtype=dtype)  # every simulation on, in the given compute dtype
    eps, h, d, rope_dim = args.norm_eps, args.n_heads, args.head_dim, args.rope_head_dim
    freqs = inv_freq(args, compressed_layer=True)
    positions = torch.tensor(POSITIONS * n, dtype=torch.int32)[:n]
    cos, sin = rope_cos_sin(freqs, positions)
    tables, at = Angles.tables(cos, sin), Angles.at(positions, freqs)
    chains = [("cos", cos, rope_cos_sin_ref(freqs, positions)[0], None, None)]
    attn_norm, kv_norm = RMSNorm(args.dim, eps), RMSNorm(d, eps)
    indexer = Indexer(args, 4)
    kv_comp, idx_comp = Compressor(args, 4, d, rotate=False), Compressor(args, 4, args.index_head_dim, rotate=True)
    for module in (attn_norm, kv_norm, indexer, kv_comp, idx_comp):
        _randomize(module, gen)

    x = torch.randn(n, args.dim, generator=gen).to(dtype)
    chains.append(("rms_norm", attn_norm(x), rms_norm_ref(x, attn_norm.weight, eps),
                   lambda out: rms_norm(x, attn_norm.weight, eps, out=out), None))  # fmt: skip
    q = (torch.randn(n, h, d, generator=gen) * 3).to(dtype)
    model_q = apply_rope(q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + eps).to(q.dtype), cos, sin)
    chains.append(("q", model_q, q_head_norm_rope_ref(q, tables, eps),
                   lambda out: q_head_norm_rope(q, at, eps, out=out), None))  # fmt: skip
    kv, nope = (torch.randn(n, d, generator=gen) * 3).to(dtype), d - rope_dim
    model_kv = apply_rope(kv_norm(kv), cos, sin)
    model_kv = torch.cat((fp8_quant_dequant(model_kv[:, :nope], KV_BLOCK), model_kv[:, nope:]), dim=1)
    chains.append(("kv", model_kv, kv_norm_rope_quant_ref(kv, kv_norm.weight, eps, tables, nope, KV_BLOCK, True),
                   lambda out: kv_norm_rope_quant(kv, kv_norm.weight, eps, at, nope, out=out), ("fp8", nope)))  # fmt: skip
    o = torch.randn(n, h, d, generator=gen).to(dtype)
    chains.append(("inverse rope", apply_rope(o, cos, sin, inverse=True), rope_ref(o, tables, True),
                   lambda out: rope(o, at, True, out=out), None))  # fmt: skip
    qr = torch.randn(n, args.q_lora_rank, generator=gen).to(dtype)
    iq = indexer.wq_b(qr, num).unflatten(-1, (args.index_n_heads, args.index_head_dim))
    chains.append(("indexer q", indexer.queries(x, qr, Rotation.from_tables(cos, sin), num)[0], indexer_q_ref(iq, tables, True),
                   lambda out: indexer_q(iq, at, True, out=out), ("fp4", args.index_head_dim)))  # fmt: skip
    for comp, kind in ((kv_comp, "kv"), (idx_comp, "index")):  # tokens at positions, rotated at window starts
        pooled, starts = torch.randn(n, comp.head_dim, generator=gen), (positions // 4) * 4
        entry = apply_rope(comp.norm(pooled.to(dtype)), *rope_cos_sin(freqs, starts))
        model_entry = comp._simulate(entry, num)
        e_nope = comp.head_dim - rope_dim if kind == "kv" else 0
        ref = compressed_entry_ref(pooled, comp.norm.weight, eps, Angles.at(positions, freqs, 4), kind, dtype, e_nope)
        call = partial(
            compressed_entry, pooled, comp.norm.weight, eps, Angles.at(positions, freqs, 4), kind, dtype, e_nope
        )
        chains.append(
            (f"{kind} entry", model_entry, ref, call, ("fp8", e_nope) if kind == "kv" else ("fp4", comp.head_dim))
        )
    return chains


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("which", "n"), [("tiny", 1), ("tiny", 5), ("real", 1)])
def test_references_and_kernels_match_the_model(which: str, n: int, dtype: torch.dtype) -> None:
    """Each reference equals the model's code bit for bit; each kernel (angles from positions, evaluated in
    fp32) matches the model within the module doc's tolerance."""
    gen = torch.Generator().manual_seed(n + (dtype == torch.bfloat16))
    with torch.no_grad():
        chains = _model_chains(_model_args(which), dtype, n, gen)
    for name, model_out, ref, call, quant in chains:
        assert torch.equal(bits(model_out), bits(ref)), f"{name}: the reference is not the model's code"
        if call is not None:
            _assert_chain_close(_poisoned(ref.shape, ref.dtype, call), model_out, quant)


# ---- one launch each, no host sync; in place; what the wrappers refuse ----


def test_each_chain_is_one_launch_without_torch_ops() -> None:
    """The brief's budget: each chain one kernel launch and nothing else on the device (no cos / sin
    tables, no casts, no copies), and no host sync."""
    gen = torch.Generator().manual_seed(3)
    n, h, d, rope_dim = 3, 4, 128, 64
    x, q = torch.randn(n, d, generator=gen).bfloat16(), torch.randn(n, h, d, generator=gen).bfloat16()
    w, pooled = _weight(d, gen), torch.randn(n, d, generator=gen)
    at = Angles.at(torch.tensor([5, 9, 4000], dtype=torch.int32), _freqs(rope_dim), window=4)
    calls = {
        "rms_norm": lambda: rms_norm(x, w, EPS),
        "q_head_norm_rope": lambda: q_head_norm_rope(q, at, EPS),
        "kv_norm_rope_quant": lambda: kv_norm_rope_quant(x, w, EPS, at, d - rope_dim),
        "rope in place": lambda: rope(q, at, inverse=True, out=q),
        "indexer_q": lambda: indexer_q(q, at),
        "compressed_entry kv": lambda: compressed_entry(pooled, w, EPS, at, "kv", torch.bfloat16, d - rope_dim),
        "compressed_entry index": lambda: compressed_entry(pooled, w, EPS, at, "index", torch.bfloat16),
    }
    for name, call in calls.items():
        with launch_guard(forbid_syncs=True) as seen:
            call()
        assert (seen.triton_launches, seen.aten_launches) == (1, 0), f"{name}: {seen.triton} {seen.aten}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_decode_steps_keys_go_into_their_window_rings_in_the_same_launch(dtype: torch.dtype) -> None:
    """`ring`: every row's key (the chain's output, bit for bit) also lands at ring[slot, position % W], the rest
    of the rings untouched (NaN-poisoned here), in the one launch; what cannot be a decode step's rings is
    refused."""
    from dsv4_kernels.token_ops import Ring

    n, d, rope_dim, window = 5, 128, 64, 8
    gen = torch.Generator().manual_seed(21)
    kv, w = _inputs((n, d), dtype, "random_positions", gen), _weight(d, gen)
    angles = _angles(n, rope_dim, False, gen)
    swa = torch.full((7, window, d), float("nan"), dtype=dtype)
    slots = torch.tensor([6, 0, 3, 1, 4], dtype=torch.int32)
    positions = torch.tensor([0, 7, 8, 30, 5], dtype=torch.int32)
    plain = kv_norm_rope_quant(kv, w, EPS, angles, d - rope_dim, 64, True)
    with launch_guard() as seen:
        out = kv_norm_rope_quant(kv, w, EPS, angles, d - rope_dim, 64, True, ring=Ring(swa, slots, positions))
    assert (seen.aten_launches, sum(seen.triton.values())) == (0, 1)
    assert torch.equal(out, plain)
    written = torch.zeros(swa.shape[:2], dtype=torch.bool)
    written[slots.long(), positions.long() % window] = True
    assert torch.equal(swa[slots.long(), positions.long() % window], plain)
    assert bool(swa[~written].isnan().all())
    with pytest.raises(ValueError, match="int32"):
        kv_norm_rope_quant(kv, w, EPS, angles, d - rope_dim, ring=Ring(swa, slots.long(), positions))
    with pytest.raises(ValueError, match="one-head rows"):
        other = swa.double() if dtype == torch.float32 else swa.float()
        kv_norm_rope_quant(kv, w, EPS, angles, d - rope_dim, ring=Ring(other, slots, positions))


def test_rope_in_place_equals_out_of_place() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 8, 128, generator=gen).bfloat16()
    angles = _angles(4, 64, False, gen)
    expected = rope(x, angles, inverse=True)
    result = rope(x, angles, inverse=True, out=x)
    assert result is x
    assert_bits_equal(x, expected)


def test_wrappers_refuse_what_they_cannot_run() -> None:
    q = torch.zeros(2, 4, 96)
    at = Angles.at(torch.tensor([0, 1]), _freqs(16))
    with pytest.raises(ValueError, match="power-of-two"):
        indexer_q(q, at)  # Hadamard over 96 channels
    with pytest.raises(ValueError, match="angles"):
        rope(torch.zeros(3, 4, 96), at)  # 2 rows of angles for 3 tokens
    with pytest.raises(ValueError, match="bf16 or fp32"):
        rope(q.half(), at)
    with pytest.raises(ValueError, match="mode"):
        compressed_entry(torch.zeros(2, 96), torch.ones(96), EPS, at, "fp8")


@pytest.mark.parametrize("tables", [True, False], ids=["tables", "positions"])
@pytest.mark.parametrize("heads", [1, 4, 64])
def test_a_token_in_a_many_token_program_gets_its_ownbits(heads: int, tables: bool) -> None:
    """A program takes as many (token, head) rows as fit its tile, several tokens' when rows are narrow (one kv
    row a token: 32 tokens a program at d = 128); every chain gives each token the bits it gets alone. 13 tokens:
    the last program is partial; 64 heads: one token's heads fill whole programs (its angles evaluated once)."""
    gen = torch.Generator().manual_seed(heads)
    n, d, rope_dim = 13, 128, 64
    q = torch.randn(n, heads, d, generator=gen).bfloat16()
    x, w, pooled = torch.randn(n, d, generator=gen).bfloat16(), _weight(d, gen), torch.randn(n, d, generator=gen)
    at = _angles(n, rope_dim, tables, gen)

    def one(t: int) -> Angles:
        if at.from_positions:
            return Angles.at(at.positions[t : t + 1], at.freqs, window=at.window)
        return Angles.tables(at.cos[t : t + 1], at.sin[t : t + 1])

    chains = {
        "rms_norm": lambda rows, a: rms_norm(x[rows], w, EPS),
        "q_head_norm_rope": lambda rows, a: q_head_norm_rope(q[rows], a, EPS),
        "kv_norm_rope_quant": lambda rows, a: kv_norm_rope_quant(x[rows], w, EPS, a, d - rope_dim),
        "rope": lambda rows, a: rope(q[rows], a, inverse=True),
        "indexer_q": lambda rows, a: indexer_q(q[rows], a),
        "compressed_entry": lambda rows, a: compressed_entry(pooled[rows], w, EPS, a, "kv", torch.bfloat16, 64),
    }
    for name, call in chains.items():
        together = call(slice(0, n), at)
        for t in range(n):
            alone = call(slice(t, t + 1), one(t))
            assert torch.equal(bits(together[t : t + 1]), bits(alone)), f"{name}: token {t} of {n}"
