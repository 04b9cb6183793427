"""The MoE router (dsv4_kernels.router) in the interpreter against its torch reference (router_ref) and
the model's Gate.

The two launches are checked apart, each against an exact or bitwise target:
- the logits' partial sums (router_logits): their sum against the exact (fp64) x W^T, within fp32
  summation-order error, 2 D 2^-24 sum_d |x_d w_d| (gamma_D, doubled for margin);
- the selection (router_select) on given partials: the reference run on the same logits (the partials
  summed in slice order, as the kernel sums them). Both evaluate the score function in fp64 and round to
  fp32, so the scores are equal and the ids must be identical, exact ties included (the lower id
  first, the reference's stable rule); the weights differ only by the k-term normalizing sum's order
  and its division, a few fp32 ulps (tolerance 2^-20 relative).
End to end (router), the kernel's logits differ from torch's by summation order, so ids are compared
on rows whose k-th and (k+1)-th values of score + bias are further apart than that error can move them,
and weights within a tolerance derived from the same logit bound.

Ties in the model: torch.topk on the CPU orders equal values arbitrarily, so where scores tie exactly
the Gate's torch path and the kernel can list the same experts in another order. That cannot change
the MoE output: the routed experts are summed per expert (torch: ascending id), each with its own
weight. A tie at the k-th place (which expert is chosen) has no defined answer in torch; the kernel's
is the lower id.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4_kernels.router import pick_splits, router, router_logits, router_select
from dsv4_kernels.router_ref import SCORE_FUNCS, router_ref, scores_ref, topk_ids_ref
from dsv4_kernels.testing import into_poisoned
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.numerics import NUMERICS_ON
from dsv4serve.model.router import Gate
from dsv4serve.worker.kernel_check import tiny_args

ROUTE_SCALE = 1.5
WEIGHT_RTOL = 2.0**-20


def _inputs(n: int, e: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x bf16 [n, d], W fp32 [e, d], bias fp32 [e] at the checkpoint's scales (logits of a few units)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen).bfloat16()
    weight = torch.randn(e, d, generator=gen) * (2.0 / d**0.5)
    bias = torch.randn(e, generator=gen) * 0.5
    return x, weight, bias


def _logit_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The fp32 summation-order error bound of x W^T, per element [n, e]."""
    return 2 * x.shape[1] * 2.0**-24 * (x.double().abs() @ weight.double().abs().t()) + 1e-30


def _weight_rtol(x: torch.Tensor, weight: torch.Tensor) -> float:
    """Kernel against reference, both within the logit bound of the exact logits (2 bounds apart). A
    score moves by at most its logit's change, relatively (sigmoid: 1 - s; sqrt(softplus): below 1/2;
    softmax: twice the largest change), a normalized weight by twice that: 8 bounds, plus fp32 ulps."""
    return 8 * _logit_bound(x, weight).max().item() + WEIGHT_RTOL


def _sum_in_order(part: torch.Tensor) -> torch.Tensor:
    logits = part[0].clone()
    for s in range(1, part.shape[0]):
        logits += part[s]
    return logits


# (n, e, d, splits): one token at dsv4-tiny's router (8 experts, D = 128); a token tile crossed (17 > 16),
# E off the 32-expert tile and D off the 64 step (200), two slices; four 128-wide slices
@pytest.mark.parametrize(("n", "e", "d", "splits"), [(1, 8, 128, None), (17, 40, 200, 2), (3, 64, 512, 4)])
def test_logit_partials_sum_to_the_exact_product(n: int, e: int, d: int, splits: int | None) -> None:
    x, weight, _ = _inputs(n, e, d, seed=n + e)
    part = router_logits(x, weight, splits)
    assert part.shape == ((splits or pick_splits(n, e, d)), n, e) and part.dtype == torch.float32
    exact = x.double() @ weight.double().t()
    assert ((_sum_in_order(part).double() - exact).abs() <= _logit_bound(x, weight)).all()


def test_pick_splits_fills_the_gpu_at_decode() -> None:
    # DeepSeek-V4-Flash: E = 256 (8 expert tiles), D = 4096: 16 slices of 256 at one token, 128 programs
    assert pick_splits(1, 256, 4096) == 16
    assert pick_splits(64, 256, 4096) == 4  # 4 token tiles x 8 expert tiles x 4 slices
    assert pick_splits(1024, 256, 4096) == 1
    assert pick_splits(1, 8, 128) == 1  # dsv4-tiny: no slice shorter than 256


def _partials(n: int, e: int, splits: int, seed: int) -> torch.Tensor:
    """Synthetic partial logits [S, n, e]: the softplus / sigmoid saturation ranges (|z| > 20) included,
    and exact ties: experts 1 and 2 equal in every row (both chosen: the bias below favours them)."""
    gen = torch.Generator().manual_seed(seed)
    part = torch.randn(splits, n, e, generator=gen) * 2.0
    part[0, :, -1] = 25.0  # softplus above its threshold; sigmoid rounds to 1 in fp32
    part[0, :, 0] = -30.0
    part[:, :, 2] = part[:, :, 1]
    return part


@pytest.mark.parametrize(("score_func", "norm"), [("sqrtsoftplus", True), ("sigmoid", False), ("softmax", True)])
def test_select_equals_the_reference_on_the_same_logits(score_func: str, norm: bool) -> None:
    n, e, k, d = 3, 12, 4, 64
    part = _partials(n, e, splits=2, seed=3)
    x, weight, bias = _inputs(n, e, d, seed=4)
    bias[1] = bias[2] = 3.0  # a tie inside the chosen set
    bias[5] = bias[6] = -4.0
    part[:, :, 6] = part[:, :, 5]  # a tie outside it
    weights, ids = router_select(part, x, weight, bias, k, score_func, ROUTE_SCALE, norm)
    scores = scores_ref(_sum_in_order(part), score_func)
    want_ids = topk_ids_ref(scores + bias, k)
    assert torch.equal(ids, want_ids) and ids.dtype == torch.int64
    place = [row.tolist() for row in ids]
    assert all(r.index(1) + 1 == r.index(2) for r in place), place  # the tie: both chosen, the lower id first
    want = scores.gather(1, want_ids)
    if norm and score_func != "softmax":
        want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, want * ROUTE_SCALE, rtol=WEIGHT_RTOL, atol=0)


def test_select_with_hash_ids_takes_the_table_as_stored() -> None:
    """A hash layer with softmax: the scores need every logit (partials), the ids come from the table
    even where another expert scores higher."""
    n, e, k, vocab = 3, 8, 2, 10
    part = _partials(n, e, splits=1, seed=5)
    x, weight, _ = _inputs(n, e, 32, seed=6)
    tid2eid = torch.randint(0, e, (vocab, k), generator=torch.Generator().manual_seed(7))
    tokens = torch.tensor([9, 0, 9])
    weights, ids = router_select(part, x, weight, None, k, "softmax", ROUTE_SCALE, True, tid2eid, tokens)
    assert torch.equal(ids, tid2eid[tokens])
    want = scores_ref(part[0], "softmax").gather(1, tid2eid[tokens]) * ROUTE_SCALE  # never normalized
    torch.testing.assert_close(weights, want, rtol=WEIGHT_RTOL, atol=0)


def _decided_rows(x, weight, bias, k, score_func) -> torch.Tensor:
    """Rows whose top-k choice the logit errors cannot change: the k-th and (k+1)-th best of score + bias
    further apart than twice the largest score change they allow (kernel and reference each within
    one bound of the exact logits; a score's slope is at most 1 per logit, softmax's change at most
    twice the largest logit change)."""
    logits = x.double() @ weight.double().t()
    values = (scores_ref(logits.float(), score_func) + bias).sort(-1, descending=True).values
    slack = 8 * _logit_bound(x, weight).max(-1).values + 2.0**-20
    return (values[:, k - 1] - values[:, k]) > slack


@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize(("n", "e", "k", "d"), [(1, 8, 2, 128), (3, 40, 6, 200)])
def test_router_matches_the_reference(score_func: str, n: int, e: int, k: int, d: int) -> None:
    x, weight, bias = _inputs(n, e, d, seed=11 * n + k)
    ids_out = torch.full((n, k + 3), -1, dtype=torch.int64)  # a strided view: stores stay inside it
    weights = into_poisoned(
        (n, k),
        torch.float32,
        lambda w: router(x, weight, bias, k, score_func, ROUTE_SCALE, True, outs=(w, ids_out[:, 1 : k + 1]))[0],
    )
    ids = ids_out[:, 1 : k + 1]
    assert (ids_out[:, 0] == -1).all() and (ids_out[:, k + 1 :] == -1).all()
    want_w, want_ids = router_ref(x, weight, bias, k, score_func, ROUTE_SCALE, True)
    decided = _decided_rows(x, weight, bias, k, score_func)
    assert decided.float().mean() >= 0.5, "the inputs should mostly be free of near-ties"
    assert torch.equal(ids[decided], want_ids[decided])
    torch.testing.assert_close(weights[decided], want_w[decided], rtol=_weight_rtol(x, weight), atol=0)


@pytest.mark.parametrize("score_func", SCORE_FUNCS)
def test_hash_router_matches_the_reference(score_func: str) -> None:
    """One launch without softmax (the k chosen logits computed in the select kernel), two with it."""
    n, e, k, d, vocab = 4, 8, 2, 200, 16
    x, weight, _ = _inputs(n, e, d, seed=21)
    tid2eid = torch.randint(0, e, (vocab, k), generator=torch.Generator().manual_seed(22))
    tokens = torch.tensor([3, 15, 0, 3])
    weights, ids = router(x, weight, None, k, score_func, ROUTE_SCALE, True, tid2eid, tokens)
    want_w, want_ids = router_ref(x, weight, None, k, score_func, ROUTE_SCALE, True, tid2eid, tokens)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=_weight_rtol(x, weight), atol=0)


def _random_gate(layer_id: int) -> Gate:
    args = tiny_args()
    gate = Gate(layer_id, args)
    gen = torch.Generator().manual_seed(layer_id)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen) * (2.0 / args.dim**0.5))
        if gate.bias is not None:
            gate.bias.copy_(torch.randn(gate.bias.shape, generator=gen) * 0.5)
        else:
            gate.tid2eid.copy_(torch.randint(0, args.n_routed_experts, gate.tid2eid.shape, generator=gen))
    return gate


@pytest.mark.parametrize("layer_id", [0, 2])  # dsv4-tiny: layer 0 hashes, layer 2 learns its routes
def test_gate_on_triton_matches_its_torch_path(layer_id: int) -> None:
    """The model's Gate: `router=triton` against the torch path (and the torch path against router_ref,
    which claims to be its arithmetic), token ids int32 as the batch layout holds them."""
    gate = _random_gate(layer_id)
    gen = torch.Generator().manual_seed(30)
    x = torch.randn(3, gate.weight.shape[1], generator=gen).bfloat16()
    tokens = torch.randint(0, gate.tid2eid.shape[0] if gate.hash else 100, (3,), generator=gen, dtype=torch.int32)
    num = dataclasses.replace(NUMERICS_ON, batch_invariant=False)
    want_w, want_ids = gate(x, tokens, num)
    table = (gate.tid2eid, tokens) if gate.hash else (None, None)
    args = (gate.topk, gate.score_func, gate.route_scale, gate.norm_topk_prob, *table)
    ref_w, ref_ids = router_ref(x, gate.weight, gate.bias, *args)
    rtol = _weight_rtol(x, gate.weight)
    assert torch.equal(ref_ids, want_ids)
    torch.testing.assert_close(ref_w, want_w, rtol=rtol, atol=0)
    weights, ids = gate(x, tokens, dataclasses.replace(num, backends=KernelBackends(router="triton")))
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=rtol, atol=0)


@pytest.mark.parametrize("layer_id", [0, 2])  # a hash layer (one launch, DIRECT) and a learned one
def test_route_rows_give_a_token_the_routing_of_another(layer_id: int) -> None:
    """A static decode bucket's padding rows take a request's routing (BatchLayout.route_rows): rows 2 and 3 of
    four take rows 0 and 1's, on the kernel and on the torch path, and rows 0 and 1 keep their own; the padding
    rows' own inputs (here a token the table routes elsewhere and another x) are never read."""
    gate = _random_gate(layer_id)
    gen = torch.Generator().manual_seed(32)
    x = torch.randn(4, gate.weight.shape[1], generator=gen).bfloat16()
    tokens = torch.tensor([5, 7, 0, 0], dtype=torch.int32)
    rows = torch.tensor([0, 1, 0, 1], dtype=torch.int32)
    num = dataclasses.replace(NUMERICS_ON, batch_invariant=False)
    for backends in (KernelBackends(), KernelBackends(router="triton")):
        run = dataclasses.replace(num, backends=backends)
        own_w, own_ids = gate(x, tokens, run)
        weights, ids = gate(x, tokens, run, route_rows=rows)
        assert torch.equal(ids, own_ids[rows.long()]) and torch.equal(weights, own_w[rows.long()])
        assert not torch.equal(ids[2:], own_ids[2:]) or not torch.equal(weights[2:], own_w[2:])
    with pytest.raises(ValueError, match="route_rows"):
        router(x, gate.weight, gate.bias, gate.topk, gate.score_func, 1.0, True,
               *((gate.tid2eid, tokens) if gate.hash else (None, None)), route_rows=rows.long())  # fmt: skip


def test_gate_ties_keep_torch_topks_experts_and_weights() -> None:
    """Two experts with the same weight row and bias tie exactly on every token; both are chosen. The
    kernel lists the lower id first; torch.topk may not: the same (expert, weight) pairs either way."""
    gate = _random_gate(2)
    with torch.no_grad():
        gate.weight[5] = gate.weight[3]
        gate.bias[3] = gate.bias[5] = 10.0  # chosen on every token
    x = torch.randn(4, gate.weight.shape[1], generator=torch.Generator().manual_seed(31)).bfloat16()
    tokens = torch.zeros(4, dtype=torch.int64)
    num = dataclasses.replace(NUMERICS_ON, batch_invariant=False)
    want_w, want_ids = gate(x, tokens, num)
    weights, ids = gate(x, tokens, dataclasses.replace(num, backends=KernelBackends(router="triton")))
    assert (ids == torch.tensor([3, 5])).all()
    order = want_ids.argsort(-1)
    assert torch.equal(want_ids.gather(1, order), ids)
    torch.testing.assert_close(weights, want_w.gather(1, order), rtol=_weight_rtol(x, gate.weight), atol=0)


def test_router_rejects_what_it_cannot_route() -> None:
    x, weight, bias = _inputs(2, 8, 64, seed=40)
    with pytest.raises(ValueError, match="unknown score function"):
        router(x, weight, bias, 2, "relu", 1.0, True)
    with pytest.raises(ValueError, match="bias"):
        router(x, weight, None, 2, "sigmoid", 1.0, True)
    with pytest.raises(ValueError, match="hash routing"):
        router(x, weight, None, 2, "sigmoid", 1.0, True, torch.zeros(5, 3, dtype=torch.int64), torch.zeros(2))
    with pytest.raises(ValueError, match="only a hash layer"):
        router_select(None, x, weight, bias, 2, "sigmoid", 1.0, True)
