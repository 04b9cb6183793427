"""The compressor's decode update (dsv4_kernels.compressor_decode, interpreter) against its torch reference
(compressor_decode_ref), and against the model's own `Compressor.update_decode` (torch) over decode steps
that close and do not close windows, the first window included; the model's `project` as one matmul.

What must be exact: the carry (pending_*) and the previous half (prev_*) are copies and one fp32 add
(gate + ape), the same operations in both, so every bit must match.

Tolerance of the entries, and why: the pooling is fp32 in the kernel (exp of score - max, two sums, one
divide) and exact (fp64, rounded once) in the reference: at most (2L + spread + 4) 2^-24 of the pooled
magnitudes (tests/kernels/test_compressor_pool.py), L <= 2 * 128 slots; the RMS normalization rescales
it by max |kv| / rms(pooled), a few times here; the RMS sum runs in tile order and the rotation uses
fp32 cos / sin (tests/kernels/test_token_ops.py). So an unquantized entry may differ by one ulp of its
dtype plus 2^-14 of its row's largest magnitude (about 20 times the pooling bound). A one-ulp difference
before a quantizer can move a value by one step of its block's grid (amax / 8 for e4m3, 2 amax / 3 for
e2m1); such elements must stay rare (2%).

Entries are NaN-poisoned views of a larger buffer: an entry the kernel must write and does not fails, a
store outside the view fails the border check, and entries nobody writes must stay NaN.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4_kernels.compressor_decode import compressor_decode
from dsv4_kernels.compressor_decode_ref import compressor_decode_ref
from dsv4_kernels.launch_guard import launch_guard
from dsv4_kernels.testing import into_poisoned
from dsv4serve.model.args import args_from_dicts
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.batch import build_layout
from dsv4serve.model.compressor import Compressor
from dsv4serve.model.indexer import Indexer
from dsv4serve.model.kv_pool import CompressedCache
from dsv4serve.model.numerics import NUMERICS_OFF, NUMERICS_ON
from dsv4serve.model.rope import inv_freq
from dsv4serve.tiny.spec import TINY_CONFIG

EPS = 1e-6
ULP = {torch.bfloat16: 2.0**-7, torch.float32: 2.0**-19}
ROW_BOUND = 2.0**-14  # of the row's largest magnitude: see the module doc
MAX_OFF_FRACTION = 0.02
QUANT_STEP = {"kv": (64, 1 / 8), "index": (32, 2 / 3)}  # (block, step as a fraction of the block's amax)


def _assert_entries_close(got: torch.Tensor, want: torch.Tensor, mode: str, nope: int) -> None:
    """got / want [..., d] entries: NaN in the same places, the module doc's tolerance elsewhere."""
    assert got.dtype == want.dtype
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "written entries differ"
    written = ~torch.isnan(want).any(dim=-1)
    g, w = got[written].float(), want[written].float()  # [E, d]
    err = (g - w).abs()
    continuous = ULP[got.dtype] * w.abs() + ROW_BOUND * w.abs().amax(dim=-1, keepdim=True)
    bound = continuous.clone()
    if mode in QUANT_STEP:
        block, step = QUANT_STEP[mode]
        limit = nope if mode == "kv" else w.shape[-1]
        blocks = torch.nn.functional.pad(w[:, :limit].abs(), (0, (-limit) % block)).unflatten(-1, (-1, block))
        amax = blocks.amax(dim=-1, keepdim=True).expand(blocks.shape).flatten(-2)[:, :limit]
        bound[:, :limit] = torch.maximum(bound[:, :limit], step * amax)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    off = (err > continuous).float().mean().item()
    assert off <= (MAX_OFF_FRACTION if mode in QUANT_STEP else 0.0), f"{off:.2%} of elements beyond one ulp"


# ---- the kernel against the reference ----


def _freqs(rope_dim: int) -> torch.Tensor:
    return 1.0 / (160000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))


def _problem(ratio: int, d: int, positions: list[int], seed: int) -> dict:
    """Rows in distinct, shuffled slots with two shuffled pages each; a carry and previous half of random
    (stale) values, as a slot reused by another sequence holds."""
    gen = torch.Generator().manual_seed(seed)
    width = (2 if ratio == 4 else 1) * d
    n_rows, n_slots, per_page = len(positions), len(positions) + 2, 4
    n_pages = 2 * n_rows + 3
    pages_needed = max(p // ratio // per_page + 1 for p in positions)
    table = torch.randperm(n_pages, generator=gen)[: n_rows * pages_needed].view(n_rows, pages_needed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    overlap = ratio == 4
    return dict(
        kv=randn(n_rows, width),
        gate=randn(n_rows, width, scale=3.0),  # softmax weights from flat to peaked
        ape=randn(ratio, width),
        positions=torch.tensor(positions, dtype=torch.int32),
        slots=torch.randperm(n_slots, generator=gen)[:n_rows].int(),
        block_table=table.int(),
        pending_kv=randn(n_slots, ratio, width),
        pending_score=randn(n_slots, ratio, width, scale=3.0),
        prev_kv=randn(n_slots, ratio, d) if overlap else None,
        prev_score=randn(n_slots, ratio, d, scale=3.0) if overlap else None,
        entries_shape=(n_pages, per_page, d),
        norm_weight=1.0 + 0.1 * randn(d),
    )


CARRY = ("pending_kv", "pending_score", "prev_kv", "prev_score")
# (ratio, d, rope dim, mode, positions): rows whose window closes (p % ratio = ratio - 1) or not, in the
# first window (no previous half) or later; dsv4-tiny's CSA (d 128, both compressors) and HCA (ratio 16),
# DeepSeek-V4-Flash's CSA main (512) and HCA (ratio 128: 16 window tiles), a partial FP8 block (d 96)
CASES = [
    (4, 128, 64, "kv", [0, 3, 6, 11, 2, 13]),
    (4, 128, 64, "index", [1, 7, 3, 12, 9]),
    (4, 96, 32, "plain", [3, 4, 5]),
    (16, 128, 64, "kv", [0, 15, 20, 47, 5]),
    (4, 512, 64, "kv", [19, 22]),
    (128, 512, 64, "kv", [127, 200]),
    (16, 96, 32, "kv", [31, 8]),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("ratio", "d", "rope_dim", "mode", "positions"), CASES)
def test_update_matches_reference(ratio, d, rope_dim, mode, positions, dtype) -> None:
    p = _problem(ratio, d, positions, seed=ratio * d + len(mode))
    freqs, nope = _freqs(rope_dim), d - rope_dim if mode == "kv" else 0
    shape = p.pop("entries_shape")
    rows = {k: p[k] for k in ("kv", "gate", "ape", "positions", "slots", "block_table")}
    ref = {k: (None if p[k] is None else p[k].clone()) for k in CARRY}
    want = torch.full(shape, float("nan"), dtype=dtype)
    compressor_decode_ref(**rows, **ref, entries=want, norm_weight=p["norm_weight"], eps=EPS, freqs=freqs,
                          mode=mode, compute_dtype=dtype, nope_dims=nope)  # fmt: skip
    got_carry = {k: (None if p[k] is None else p[k].clone()) for k in CARRY}

    def run(entries: torch.Tensor) -> torch.Tensor:
        compressor_decode(**rows, **got_carry, entries=entries, norm_weight=p["norm_weight"], eps=EPS, freqs=freqs,
                          mode=mode, compute_dtype=dtype, nope_dims=nope)  # fmt: skip
        return entries.clone()

    got = into_poisoned(shape, dtype, run)
    for name in CARRY:
        if ref[name] is not None:
            assert torch.equal(got_carry[name], ref[name]), name
            assert not torch.equal(got_carry[name], p[name]) or name.startswith("prev"), f"{name} never written"
    assert int((~torch.isnan(want).any(-1)).sum()) == len(positions)
    _assert_entries_close(got, want, mode, nope)


def test_closing_rows_move_the_previous_half_and_others_keep_it() -> None:
    """The reference is what this test trusts for `prev`; check its rule directly: rows whose window closed
    hold the window's A halves (the token's included), the others keep the old ones."""
    p = _problem(4, 32, [3, 6, 11, 0], seed=1)
    p.pop("entries_shape")
    old = p["prev_kv"].clone()
    carry = {k: p[k] for k in CARRY}
    compressor_decode(p["kv"], p["gate"], p["ape"], p["positions"], p["slots"], p["block_table"], **carry,
                      entries=torch.zeros(16, 4, 32), norm_weight=p["norm_weight"], eps=EPS, freqs=_freqs(8),
                      mode="plain", compute_dtype=torch.float32)  # fmt: skip
    for b, pos in enumerate([3, 6, 11, 0]):
        slot = int(p["slots"][b])
        if pos % 4 == 3:
            assert torch.equal(p["prev_kv"][slot], p["pending_kv"][slot, :, :32])
            assert torch.equal(p["prev_kv"][slot, 3], p["kv"][b, :32])
        else:
            assert torch.equal(p["prev_kv"][slot], old[slot])


# ---- the kernel in the model: Compressor.update_decode on Triton against its torch form ----


def _compressor(ratio: int, rotate: bool, seed: int) -> tuple[Compressor, torch.Tensor]:
    args = args_from_dicts(TINY_CONFIG, expert_dtype_hint="fp4")  # experts play no part here
    d = args.index_head_dim if rotate else args.head_dim
    comp = Compressor(args, ratio, d, rotate=rotate)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in comp.named_parameters():
            scale = 0.1 if name.startswith(("wkv", "wgate")) else 1.0
            base = 1.0 if name.startswith("norm") else 0.0
            param.copy_(base + scale * torch.randn(param.shape, generator=gen))
    return comp, inv_freq(args, compressed_layer=True)


PROMPTS = (2, 5, 17, 30)  # tokens before decoding: inside the first window, across windows


@pytest.mark.parametrize("numerics", ["off", "on"])
@pytest.mark.parametrize(("ratio", "rotate"), [(4, False), (4, True), (16, False)], ids=["csa", "indexer", "hca"])
def test_model_update_decode_on_triton_matches_torch(ratio: int, rotate: bool, numerics: str) -> None:
    """Rows prefilled on the per-row path (`update`), then 2 x ratio + 1 decode steps, every window of
    each row closing once or more; the Triton step and the torch step each run on their own copy of the
    cache from the same start, so each step compares one kernel call."""
    num = NUMERICS_OFF if numerics == "off" else NUMERICS_ON
    num = dataclasses.replace(num, batch_invariant=False)
    kernel_num = dataclasses.replace(num, backends=KernelBackends(compressor="triton"))
    comp, freqs = _compressor(ratio, rotate, seed=ratio + rotate)
    d, page_tokens, n_rows = comp.head_dim, 16, len(PROMPTS)
    steps = 2 * ratio + 1
    n_pages = n_rows * ((max(PROMPTS) + steps) // page_tokens + 1)
    cache = CompressedCache.empty(ratio, page_tokens, d, n_pages, n_rows + 1, num.compute_dtype, torch.device("cpu"))
    cache.entries.fill_(float("nan"))
    tables = torch.randperm(n_pages, generator=torch.Generator().manual_seed(9)).view(n_rows, -1)
    slots = [3, 0, 2, 1]  # not the rows' order
    gen = torch.Generator().manual_seed(ratio)
    with torch.no_grad():
        for b, n in enumerate(PROMPTS):
            kv, gate = comp.project(torch.randn(n, comp.wkv.weight.shape[1], generator=gen), num)
            comp.update(kv, gate, 0, cache, slots[b], tables[b], freqs, num)
        for step in range(steps):
            layout = build_layout(
                [[0]] * n_rows, [n + step for n in PROMPTS], slots, tables.tolist(), torch.device("cpu")
            )
            kv, gate = comp.project(torch.randn(n_rows, comp.wkv.weight.shape[1], generator=gen), num)
            copies = {f: getattr(cache, f).clone() for f in ("entries", *CARRY) if getattr(cache, f) is not None}
            mine = dataclasses.replace(cache, **copies)
            comp.update_decode(kv, gate, layout, mine, freqs, kernel_num)
            comp.update_decode(kv, gate, layout, cache, freqs, num)
            for name in CARRY:
                if getattr(cache, name) is not None:
                    assert torch.equal(getattr(mine, name), getattr(cache, name)), f"step {step}: {name}"
            _assert_entries_close(mine.entries, cache.entries, comp._entry_mode(num), d - comp.rope_head_dim)


def test_update_decode_is_one_launch_and_project_one_matmul() -> None:
    comp, freqs = _compressor(4, False, seed=0)
    num = dataclasses.replace(NUMERICS_ON, batch_invariant=False, backends=KernelBackends(compressor="triton"))
    cache = CompressedCache.empty(4, 16, comp.head_dim, 4, 2, num.compute_dtype, torch.device("cpu"))
    layout = build_layout([[0], [0]], [6, 3], [1, 0], [[2], [0, 3]], torch.device("cpu"))
    x = torch.randn(2, comp.wkv.weight.shape[1])
    comp.project(x, num)  # the first call fuses the weights
    with launch_guard() as seen:
        kv, gate = comp.project(x, num)
        comp.update_decode(kv, gate, layout, cache, freqs, num)
    assert (seen.aten_launches, dict(seen.triton)) == (1, {"compressor_decode_kernel": 1}), (seen.aten, seen.triton)


def test_project_is_the_two_projections_and_follows_reloaded_weights() -> None:
    """One fp32 matmul over [wkv; wgate]: the two products (fp32, to rounding), with the weights views
    into the fused tensor (no second copy); weights loaded in place afterwards, or replaced, are used."""
    comp, _ = _compressor(4, False, seed=1)
    x = torch.randn(3, comp.wkv.weight.shape[1])

    def check() -> None:
        """Each product within the fp32 summation bound K 2^-24 sum_k |x_k w_k| of the exact (fp64) one."""
        for got, w in zip(comp.project(x, NUMERICS_OFF), (comp.wkv.weight, comp.wgate.weight)):
            w = w.detach().double()
            bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ w.abs().T)
            assert bool(((got.double() - x.double() @ w.T).abs() <= bound).all())

    check()
    fused = comp._fused_weight()
    assert comp.wkv.weight.data_ptr() == fused.data_ptr() and comp.wgate.weight.data_ptr() > fused.data_ptr()
    state = {k: torch.randn_like(v) for k, v in comp.state_dict().items()}
    comp.load_state_dict(state)  # in place, into the views
    check()
    comp.wgate.weight = torch.nn.Parameter(torch.randn_like(comp.wgate.weight))  # a new tensor
    check()


def test_projection_on_the_head_kernel_holds_bf16_and_meets_the_fp32_bound(caplog) -> None:
    """compressor=triton: `prepare` holds [wkv; wgate] in bf16 (weights rounded as a checkpoint stores them),
    the weights become bf16 views of it (the fp32 copies freed), and both the kernel (head_logits: exact
    products) and the torch path on the same module stay within the fp32 summation bound of the exact
    product. Weights that are not exact in bf16 keep the fp32 projection on torch, with a warning."""
    comp, _ = _compressor(4, False, seed=3)
    with torch.no_grad():
        for w in (comp.wkv.weight, comp.wgate.weight):
            w.copy_(w.to(torch.bfloat16).float())
    backends = KernelBackends(compressor="triton")
    comp.prepare(backends)
    fused = comp._fused_weight()
    assert fused.dtype == comp.wkv.weight.dtype == comp.wgate.weight.dtype == torch.bfloat16
    assert comp.wkv.weight.data_ptr() == fused.data_ptr()
    x = torch.randn(5, fused.shape[1]) * torch.logspace(-2, 1, fused.shape[1])
    kernel_num = dataclasses.replace(NUMERICS_OFF, batch_invariant=False, backends=backends)
    for num in (kernel_num, NUMERICS_OFF):
        for got, w in zip(comp.project(x, num), (comp.wkv.weight, comp.wgate.weight)):
            w = w.detach().double()
            bound = 2 * x.shape[1] * 2.0**-24 * (x.double().abs() @ w.abs().T)
            assert got.dtype == torch.float32 and bool(((got.double() - x.double() @ w.T).abs() <= bound).all())
    inexact, _ = _compressor(4, False, seed=4)
    with caplog.at_level("WARNING", logger="dsv4serve.model.compressor"):
        inexact.prepare(backends)
    assert inexact._fused_weight().dtype == torch.float32 and "not exact in bf16" in caplog.text


@pytest.mark.parametrize("numerics", ["off", "on"])
def test_the_indexer_head_weights_ride_in_the_compressor_launch(numerics: str) -> None:
    """compressor=triton: the CSA indexer's head weights (weights_proj, stored bf16) are stacked under its
    compressor's [wkv; wgate] and come out of the same head_logits launch, finished as the Linear finishes
    them (the compute dtype, then the scale), and nothing else is launched; the torch path of the prepared
    module gives the same. Integer operands make every sum exact, so all of it is bit for bit; the Linear's
    weight becomes a bf16 view into the fused tensor (no second copy)."""
    args = args_from_dicts(TINY_CONFIG, expert_dtype_hint="fp4")
    indexer = Indexer(args, ratio=4)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for param in indexer.parameters():
            param.copy_(torch.randint(-8, 9, param.shape, generator=gen) * 2.0**-6)
    num = NUMERICS_OFF if numerics == "off" else NUMERICS_ON
    x = torch.randint(-32, 33, (3, args.dim), generator=gen).to(num.compute_dtype)
    expected = indexer.weights_proj(x, num).float() * indexer.weight_scale  # the Linear in fp32, before prepare
    comp = indexer.compressor
    kv_before, gate_before = comp.project(x, num)
    backends = KernelBackends(compressor="triton")
    comp.prepare(backends)
    fused = comp._fused_weight()
    w = indexer.weights_proj.weight
    assert w.dtype == fused.dtype == torch.bfloat16 and w.data_ptr() == fused[-w.shape[0] :].data_ptr()
    kernel_num = dataclasses.replace(num, batch_invariant=False, backends=backends)
    xf = x.float()  # the compressors' fp32 input, cast once in the layer for both of them (attention.py)
    with launch_guard() as seen:
        kv, gate, weights = comp.project_with_tail(xf, kernel_num)
    assert (seen.aten_launches, dict(seen.triton)) == (0, {"head_logits_kernel": 1}), (seen.aten, seen.triton)
    for got in (comp.project_with_tail(xf, num), (kv, gate, weights)):  # the torch path, then the kernel's
        assert torch.equal(got[0], kv_before) and torch.equal(got[1], gate_before)
        assert got[2] is not None and torch.equal(got[2], expected)


def test_a_tail_must_share_the_input() -> None:
    comp, _ = _compressor(4, False, seed=1)
    with pytest.raises(ValueError, match="tail"):
        comp.carry_tail(torch.nn.Linear(3, 2), 1.0)  # type: ignore[arg-type]


def test_wrapper_refuses_what_it_cannot_run() -> None:
    p = _problem(4, 32, [3], seed=2)
    shape = p.pop("entries_shape")
    args = dict(p, entries=torch.zeros(shape), norm_weight=p["norm_weight"], eps=EPS, freqs=_freqs(8))
    with pytest.raises(ValueError, match="mode"):
        compressor_decode(**args, mode="fp8", compute_dtype=torch.float32)
    with pytest.raises(ValueError, match="compute dtype"):
        compressor_decode(**args, mode="plain", compute_dtype=torch.bfloat16)  # entries are fp32
    with pytest.raises(ValueError, match="prev_"):
        compressor_decode(**dict(args, prev_kv=None, prev_score=None), mode="plain", compute_dtype=torch.float32)
    with pytest.raises(ValueError, match="int32"):
        compressor_decode(**dict(args, positions=p["positions"].long()), mode="plain", compute_dtype=torch.float32)
