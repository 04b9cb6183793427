"""The mHC kernels (dsv4_kernels.hc_mix) in the interpreter against their torch reference evaluated in
fp64, and against the model's torch path (dsv4serve.model.hc) through its dispatch.

Tolerance, and why (u = 2^-24, the fp32 unit roundoff; every bound is computed per element in fp64):
- mixes m = (fn . flat(h)) rho: the kernel sums K = hc D products in fp32, in blocks (the interpreter's
  dots and sums; a GPU's three bf16 tensor-core dots of k = 16 steps): |dm| <= c u S + (c / 2 + 5) u |m|,
  c = 3 K / 16 + 64, S = rho sum_k |fn_k h_k|; the second term is rho's error (the sum of squares in the
  same blocks, the square root halves it, the mean, eps and rsqrt add 4 u; the product one more).
- logits a = m s + b: |da| <= |s| |dm| + 2 u (|m s| + |b|). pre = sigmoid(a) + eps and post = 2 sigmoid(a):
  sigmoid' <= 1/4 and an fp32 sigmoid is within 4 u, so |dpre| <= |da| / 4 + 4 u, |dpost| <= |da| / 2 + 8 u.
- comb: entries in [0, 1]; the 20 Sinkhorn rounds move an entry by at most 0.63 max|da| (measured in fp64
  over 80,000 random 4x4 logit sets, perturbed by +-1e-7), and the fp32 rounds add at most 5.3 u against
  fp64 (measured, logits up to 30 wide); the softmax's exp adds (2 + spread) u relative, spread = the
  largest logit minus the smallest in the row. We allow max|da| + (16 + spread) u.
- x = sum_k pre_k h_k and hc_post's sums: (hc + 2) u of the sum of magnitudes, plus what the pre error
  carries; then both sides round to the output dtype: one ulp of the output dtype more.
With exact mixes (small integers, scaled by powers of two: every product and sum is exact in fp32) c is 0
and the bounds are a few u: those cases run with hc_eps 0.05 and norm_eps 0.25, where any slip in
placing eps would show far above them.

Every kernel output is written into a NaN-poisoned view of a larger buffer (dsv4_kernels.testing).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4_kernels.hc_mix import SPLIT_K, hc_head, hc_post, hc_pre, pick_block_n, pick_splits, post_tile
from dsv4_kernels.hc_mix_ref import hc_head_ref, hc_post_ref, hc_pre_ref
from dsv4_kernels.testing import into_poisoned

U = 2.0**-24
N_ITERS = 20
EPS = 1e-6  # the model's hc_eps and norm_eps


def _inputs(n: int, hc: int, d: int, n_mix: int, dtype: torch.dtype, seed: int, exact: bool):
    """h [n, hc, d], fn [n_mix, hc d], base [n_mix]. Random: fn at the scale that makes m O(1). Exact:
    h in multiples of 1/8 up to 1 and fn in multiples of 2^-12 up to 2^-6, so every product is a multiple
    of 2^-15 and every sum below 2^8: exact in fp32 in any order."""
    gen = torch.Generator().manual_seed(seed)
    if exact:
        h = torch.randint(-8, 9, (n, hc, d), generator=gen) / 8.0
        fn = torch.randint(-64, 65, (n_mix, hc * d), generator=gen) / 2.0**12
    else:
        h = torch.randn(n, hc, d, generator=gen)
        fn = torch.randn(n_mix, hc * d, generator=gen) * (hc * d) ** -0.5
    base = torch.randn(n_mix, generator=gen) * 0.5
    return h.to(dtype), fn, base


def _scales(n_scales: int) -> torch.Tensor:
    return torch.tensor([1.3, 0.7, 2.1][:n_scales])


def _c_kernel(k: int) -> float:
    """The summation-error factor of the kernel's K-term sums (module doc)."""
    return 3 * k / 16 + 64


def _mixes_bound(h: torch.Tensor, fn: torch.Tensor, norm_eps: float, c: float) -> tuple[torch.Tensor, ...]:
    """fp64 (m, bound on an fp32 path's |dm| whose K-term sums err by at most c u), both [N, n_mix]."""
    flat, fn64 = h.flatten(1).double(), fn.double()
    rho = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    m = flat @ fn64.T * rho
    return m, c * U * (flat.abs() @ fn64.abs().T * rho) + (c / 2 + 5) * U * m.abs()


def _logit_bound(m: torch.Tensor, dm: torch.Tensor, s: float, b: torch.Tensor) -> torch.Tensor:
    return abs(s) * dm + 2 * U * ((m * s).abs() + b.double().abs())


def _ulp_factor(dtype: torch.dtype) -> float:
    return 2.0**-7 if dtype == torch.bfloat16 else 2.0**-23


def _rounded_bound(value_ref: torch.Tensor, delta: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """delta plus one ulp of `dtype` at the value: both sides round a nearby value to `dtype`."""
    return delta + _ulp_factor(dtype) * (value_ref.double().abs() + delta) * 1.01


def _x_bound(h: torch.Tensor, pre: torch.Tensor, dpre: torch.Tensor) -> torch.Tensor:
    """fp32 error of x = sum_k pre_k h_k given |dpre| bounds: [N, D]."""
    hd = h.double().abs()
    hc = h.shape[1]
    return (dpre.unsqueeze(-1) * hd).sum(1) + (hc + 2) * U * (pre.abs().unsqueeze(-1) * hd).sum(1)


def _assert_within(name: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    err = (got.double() - want.double()).abs()
    assert not torch.isnan(got).any(), f"{name}: NaN (an element left unwritten?)"
    assert bool((err <= bound).all()), (
        f"{name}: max err {err.max().item():.3g}, bound there {bound.flatten()[err.argmax()]:.3g}"
    )


def _run_pre(h, fn, scale, base, hc_eps, norm_eps, block_n):
    n, hc, d = h.shape
    return into_poisoned(
        (n, d),
        h.dtype,
        lambda x_out: into_poisoned(
            (n, hc),
            torch.float32,
            lambda post_out: into_poisoned(
                (n, hc, hc),
                torch.float32,
                lambda comb_out: hc_pre(
                    h, fn, scale, base, N_ITERS, hc_eps, norm_eps, block_n, x_out, post_out, comb_out
                ),
            ),
        ),
    )


def _check_pre(h, fn, base, hc_eps, norm_eps, block_n, exact) -> None:
    n, hc, d = h.shape
    scale = _scales(3)
    x, post, comb = _run_pre(h, fn, scale, base, hc_eps, norm_eps, block_n)
    x_ref, post_ref, comb_ref = hc_pre_ref(h, fn, scale, base, N_ITERS, hc_eps, norm_eps, torch.float64)
    m, dm = _mixes_bound(h, fn, norm_eps, 0.0 if exact else _c_kernel(h.shape[1] * h.shape[2]))
    s0, s1, s2 = scale.tolist()
    da_pre = _logit_bound(m[:, :hc], dm[:, :hc], s0, base[:hc])
    da_post = _logit_bound(m[:, hc : 2 * hc], dm[:, hc : 2 * hc], s1, base[hc : 2 * hc])
    logits = m[:, 2 * hc :] * s2 + base[2 * hc :].double()
    da_comb = _logit_bound(m[:, 2 * hc :], dm[:, 2 * hc :], s2, base[2 * hc :]).amax(-1)
    spread = (logits.unflatten(-1, (hc, hc)).amax(-1) - logits.unflatten(-1, (hc, hc)).amin(-1)).amax(-1)
    pre_ref = torch.sigmoid(m[:, :hc] * s0 + base[:hc].double()) + hc_eps
    _assert_within("post", post, post_ref, da_post / 2 + 8 * U)
    _assert_within("comb", comb, comb_ref, (da_comb + (16 + spread) * U)[:, None, None].expand(n, hc, hc))
    x_bound = _rounded_bound(x_ref, _x_bound(h, pre_ref, da_pre / 4 + 4 * U), h.dtype)
    _assert_within("x", x, x_ref, x_bound)
    assert x.dtype == h.dtype and post.dtype == comb.dtype == torch.float32


DTYPES = [torch.float32, torch.bfloat16]
# (N, D, tokens per program): decode (one token), a few tokens, 16-token blocks with ragged N, K and D
# (20 tokens, D = 100), 64-token blocks with a ragged second block, and a larger D
# up to 64 tokens split K = 4 d into SPLIT_K = 256 values (d 200 leaves a short last split, d 1100 makes 18
# splits: two SPLIT_CHUNK steps of the sum), one token a program or, as the interpreter runs them, 16; larger
# batches take the one-launch tl.dot form (80 and 70 tokens)
PRE_SHAPES = [
    (1, 64, 1),
    (5, 128, 1),
    (20, 100, 16),
    (80, 64, 16),
    (70, 64, 64),
    (2, 512, 1),
    (3, 200, 1),
    (2, 1100, 1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "d", "block_n"), PRE_SHAPES)
def test_pre_matches_reference(n: int, d: int, block_n: int, dtype: torch.dtype) -> None:
    h, fn, base = _inputs(n, 4, d, 24, dtype, seed=n * d + block_n, exact=False)
    _check_pre(h, fn, base, EPS, EPS, block_n, exact=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_n", [1, 16])
def test_pre_exact_mixes_large_eps(block_n: int, dtype: torch.dtype) -> None:
    """Exact mixes: only the norm, the sigmoids and the Sinkhorn rounds differ, by a few u, with hc_eps
    and norm_eps large enough that a misplaced eps would be caught."""
    h, fn, base = _inputs(7, 4, 64, 24, dtype, seed=block_n, exact=True)
    _check_pre(h, fn, base, 0.05, 0.25, block_n, exact=True)


def test_pre_three_streams() -> None:
    """hc = 3 pads the [hc, hc] tiles to 4 x 4: the padding must stay out of the softmax and the sums."""
    h, fn, base = _inputs(3, 3, 64, 15, torch.float32, seed=3, exact=False)
    _check_pre(h, fn, base, EPS, EPS, 1, exact=False)


HEAD_SHAPES = [(1, 64, 1), (20, 100, 16), (3, 256, 1), (70, 64, 16)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "d", "block_n"), HEAD_SHAPES)
def test_head_matches_reference(n: int, d: int, block_n: int, dtype: torch.dtype) -> None:
    h, fn, base = _inputs(n, 4, d, 4, dtype, seed=7 * n + d, exact=False)
    scale = _scales(1)
    x = into_poisoned((n, d), dtype, lambda out: hc_head(h, fn, scale, base, EPS, EPS, block_n, out))
    x_ref = hc_head_ref(h, fn, scale, base, EPS, EPS, torch.float64)
    m, dm = _mixes_bound(h, fn, EPS, _c_kernel(4 * d))
    pre_ref = torch.sigmoid(m * scale.item() + base.double()) + EPS
    dpre = _logit_bound(m, dm, scale.item(), base) / 4 + 4 * U
    _assert_within("x", x, x_ref, _rounded_bound(x_ref, _x_bound(h, pre_ref, dpre), dtype))


def _post_inputs(n: int, hc: int, d: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hc, d, generator=gen).to(dtype)
    out = torch.randn(n, d, generator=gen).to(dtype)
    post = 2 * torch.rand(n, hc, generator=gen)
    comb = torch.rand(n, hc, hc, generator=gen)
    return out, h, post, comb / comb.sum(-1, keepdim=True)


# decode, a few tokens (several a program at small D, the last program partial: post_tile), D above the 512-channel
# block and ragged, and hc = 3
POST_SHAPES = [(1, 4, 64), (5, 4, 128), (9, 4, 64), (3, 4, 600), (2, 3, 64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "hc", "d"), POST_SHAPES)
def test_post_matches_reference(n: int, hc: int, d: int, dtype: torch.dtype) -> None:
    out, h, post, comb = _post_inputs(n, hc, d, dtype, seed=n + d)
    new = into_poisoned((n, hc, d), dtype, lambda buf: hc_post(out, h, post, comb, buf))
    new_ref = hc_post_ref(out, h, post, comb, torch.float64)
    magnitude = post.double().unsqueeze(-1) * out.double().abs().unsqueeze(1) + (
        comb.double().unsqueeze(-1) * h.double().abs().unsqueeze(2)
    ).sum(1)
    _assert_within("new", new, new_ref, _rounded_bound(new_ref, (hc + 2) * U * magnitude, dtype))
    assert new.dtype == dtype
    for t in range(n):  # several tokens share a program at small D: each gets the bits it gets alone
        alone = hc_post(out[t : t + 1], h[t : t + 1], post[t : t + 1], comb[t : t + 1])
        assert torch.equal(new[t : t + 1], alone), f"token {t} of {n}"


def test_empty_batch_and_bad_shapes() -> None:
    h, fn, base = _inputs(0, 4, 64, 24, torch.float32, seed=0, exact=False)
    x, post, comb = hc_pre(h, fn, _scales(3), base, N_ITERS, EPS, EPS)
    assert x.shape == (0, 64) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
    with pytest.raises(ValueError, match="need fn"):
        hc_pre(torch.zeros(1, 4, 64), fn[:, :-1], _scales(3), base, N_ITERS, EPS, EPS)
    with pytest.raises(ValueError, match="need out"):
        hc_post(torch.zeros(2, 64), torch.zeros(1, 4, 64), torch.zeros(1, 4), torch.zeros(1, 4, 4))


def test_block_choice_is_data_independent_and_invariant_when_asked() -> None:
    gpu = [pick_block_n(n, interpreter=False) for n in (1, 64, 65, 2048, 2049, 16384)]
    assert gpu == [1, 1, 16, 16, 64, 64]
    assert [pick_block_n(n, interpreter=True) for n in (1, 2, 64, 16384)] == [1, 16, 16, 16]
    assert {pick_block_n(n, batch_invariant=True, interpreter=i) for n in (1, 100, 16384) for i in (False, True)} == {1}
    # hc_post: 512 channels of one token at the real D, whole rows of several tokens at small D (shape alone)
    assert [post_tile(4, d) for d in (4096, 600, 128, 64)] == [(1, 512), (1, 512), (4, 128), (8, 64)]


def test_split_k_depends_on_k_alone_and_keeps_a_token_batch_invariant() -> None:
    """One token a program sums its flat row in cdiv(K, SPLIT_K) splits, whatever the batch: a token's x, post
    and comb are bitwise the same alone and among others (blocks of tokens take the one-launch form)."""
    assert [pick_splits(k, 1, 1) for k in (256, 257, 16384)] == [1, 2, 16384 // SPLIT_K]
    assert pick_splits(16384, 64, 16) == pick_splits(16384, 1000, 1) == 64  # a decode batch; invariant numerics
    assert pick_splits(16384, 65, 16) == pick_splits(16384, 4096, 64) == 0
    h, fn, base = _inputs(5, 4, 300, 24, torch.bfloat16, seed=11, exact=False)
    alone = hc_pre(h[2:3], fn, _scales(3), base, N_ITERS, EPS, EPS, block_n=1)
    batch = hc_pre(h, fn, _scales(3), base, N_ITERS, EPS, EPS, block_n=1)
    for a, b in zip(alone, batch):
        assert torch.equal(a[0], b[2])


def _norm_inputs(d: int, seed: int) -> tuple[torch.Tensor, float]:
    gen = torch.Generator().manual_seed(seed)
    return 1.0 + 0.5 * torch.randn(d, generator=gen), 0.25  # a large eps: misplaced, it would show


def _check_norm(x_normed: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """x_normed against weight * (x * r) in fp64 over the very x the unfused launch stores: r's fp32 error is the
    squares' sum (D terms in some order: D u), the mean, sqrt and divide (3 u); then the two products and the
    rounding to x's dtype."""
    xd = x.double()
    r = torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps)
    want = weight.double() * (xd * r)
    delta = (x.shape[1] + 5) * U * want.abs()
    _assert_within("normed x", x_normed, want, _rounded_bound(want, delta, x.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "d", "block_n"), [(1, 64, 1), (3, 200, 1), (20, 100, 16), (70, 64, 64)])
def test_pre_and_head_apply_the_sub_layer_norm_in_the_launch_that_writes_x(
    n: int, d: int, block_n: int, dtype: torch.dtype
) -> None:
    """`norm`: x leaves RMS-normalized (the split-K finish and the one-launch form; pre and head); post and comb,
    and the x the norm starts from, are the unfused launch's bit for bit."""
    h, fn, base = _inputs(n, 4, d, 24, dtype, seed=n + d, exact=False)
    weight, eps = _norm_inputs(d, seed=d)
    x, post, comb = hc_pre(h, fn, _scales(3), base, N_ITERS, EPS, EPS, block_n)
    x_n, post_n, comb_n = hc_pre(h, fn, _scales(3), base, N_ITERS, EPS, EPS, block_n, norm=(weight, eps))
    assert torch.equal(post_n, post) and torch.equal(comb_n, comb) and x_n.dtype == dtype
    _check_norm(x_n, x, weight, eps)
    head = hc_head(h, fn[:4], _scales(1), base[:4], EPS, EPS, block_n)
    head_n = into_poisoned(
        (n, d), dtype, lambda out: hc_head(h, fn[:4], _scales(1), base[:4], EPS, EPS, block_n, out, norm=(weight, eps))
    )
    _check_norm(head_n, head, weight, eps)


def test_the_fused_norm_keeps_a_token_batch_invariant_and_checks_its_weight() -> None:
    h, fn, base = _inputs(5, 4, 300, 24, torch.bfloat16, seed=13, exact=False)
    norm = _norm_inputs(300, seed=1)
    alone = hc_pre(h[2:3], fn, _scales(3), base, N_ITERS, EPS, EPS, block_n=1, norm=norm)[0]
    batch = hc_pre(h, fn, _scales(3), base, N_ITERS, EPS, EPS, block_n=1, norm=norm)[0]
    assert torch.equal(alone[0], batch[2])
    with pytest.raises(ValueError, match="RMSNorm weight"):
        hc_pre(h, fn, _scales(3), base, N_ITERS, EPS, EPS, norm=(norm[0][:-1], norm[1]))


def _model_numerics(backend: str, batch_invariant: bool):
    from dsv4serve.model.backends import KernelBackends
    from dsv4serve.model.numerics import NUMERICS_ON

    return dataclasses.replace(NUMERICS_ON, batch_invariant=batch_invariant, backends=KernelBackends(hc=backend))


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_model_dispatch_matches_the_torch_path(monkeypatch, batch_invariant: bool) -> None:
    """dsv4serve.model.hc with hc=triton runs the kernels (counted) and agrees with its own torch path on
    the same inputs within the two paths' bounds added; the torch path's fp32 matmul is held to the
    bound of any order of summation, c = K."""
    import dsv4_kernels.hc_mix as kernels
    from dsv4serve.model import hc as model_hc

    calls = []
    for name in ("hc_pre", "hc_post", "hc_head"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _f=real, _n=name, **k: calls.append(_n) or _f(*a, **k))
    n, d = 7, 128  # dsv4-tiny's width, a 7-token chunk
    h, fn, base = _inputs(n, 4, d, 24, torch.bfloat16, seed=11, exact=False)
    out, _, post_in, comb_in = _post_inputs(n, 4, d, torch.bfloat16, seed=12)
    scale = _scales(3)
    runs = {}
    for backend in ("torch", "triton"):
        num = _model_numerics(backend, batch_invariant)
        pre = model_hc.hc_pre(h, fn, scale, base, N_ITERS, EPS, EPS, num)
        new = model_hc.hc_post(out, h, post_in, comb_in, num)
        head = model_hc.hc_head(h, fn[:4], scale[:1], base[:4], EPS, EPS, num)
        runs[backend] = (*pre, new, head)
    assert calls == ["hc_pre", "hc_post", "hc_head"]
    (x_t, post_t, comb_t, new_t, head_t), (x_k, post_k, comb_k, new_k, head_k) = runs["torch"], runs["triton"]
    m, dm_kernel = _mixes_bound(h, fn, EPS, _c_kernel(4 * d))
    dm = dm_kernel + _mixes_bound(h, fn, EPS, 4 * d)[1]
    s0, s1, s2 = scale.tolist()
    da_pre = _logit_bound(m[:, :4], dm[:, :4], s0, base[:4])
    da_post = _logit_bound(m[:, 4:8], dm[:, 4:8], s1, base[4:8])
    da_comb = _logit_bound(m[:, 8:], dm[:, 8:], s2, base[8:]).amax(-1)
    logits = (m[:, 8:] * s2 + base[8:].double()).unflatten(-1, (4, 4))
    spread = (logits.amax(-1) - logits.amin(-1)).amax(-1)
    _assert_within("post", post_k, post_t, da_post / 2 + 16 * U)
    _assert_within("comb", comb_k, comb_t, (da_comb + (32 + spread) * U)[:, None, None].expand(n, 4, 4))
    pre = torch.sigmoid(m[:, :4] * s0 + base[:4].double())
    x_delta = _x_bound(h, pre, da_pre / 4 + 8 * U) * 2
    _assert_within("x", x_k, x_t, _rounded_bound(x_t, x_delta, torch.bfloat16))
    magnitude = post_in.double().unsqueeze(-1) * out.double().abs().unsqueeze(1) + (
        comb_in.double().unsqueeze(-1) * h.double().abs().unsqueeze(2)
    ).sum(1)
    _assert_within("new", new_k, new_t, _rounded_bound(new_t, 2 * 6 * U * magnitude, torch.bfloat16))
    mh, dmh = _mixes_bound(h, fn[:4], EPS, _c_kernel(4 * d))
    dmh = dmh + _mixes_bound(h, fn[:4], EPS, 4 * d)[1]
    da_head = _logit_bound(mh, dmh, s0, base[:4])
    head_delta = _x_bound(h, torch.sigmoid(mh * s0 + base[:4].double()), da_head / 4 + 8 * U) * 2
    _assert_within("head", head_k, head_t, _rounded_bound(head_t, head_delta, torch.bfloat16))


def test_reference_mirrors_the_model_torch_path() -> None:
    """The fp32 reference is the model's torch path, operation for operation (hc.py, batch-invariance off:
    one matmul for all rows, as the reference): equal to the bit."""
    from dsv4serve.model import hc as model_hc

    num = _model_numerics("torch", batch_invariant=False)
    h, fn, base = _inputs(5, 4, 64, 24, torch.bfloat16, seed=5, exact=False)
    scale = _scales(3)
    got = model_hc.hc_pre(h, fn, scale, base, N_ITERS, EPS, EPS, num)
    for g, w in zip(got, hc_pre_ref(h, fn, scale, base, N_ITERS, EPS, EPS)):
        assert torch.equal(g, w)
    x, post, comb = got
    assert torch.equal(model_hc.hc_post(x, h, post, comb, num), hc_post_ref(x, h, post, comb))
    assert torch.equal(
        model_hc.hc_head(h, fn[:4], scale[:1], base[:4], EPS, EPS, num),
        hc_head_ref(h, fn[:4], scale[:1], base[:4], EPS, EPS),
    )
