"""kt-kernel's MXFP4 experts (dsv4serve/experts/kt_experts.py) against the torch oracle (kt_oracle.py) on
dsv4-tiny's expert shape (D = I = 128, 8 experts, top-2): bit for bit at batch 1, never silently zero,
the live GPU-expert mask honoured, inputs longer than kt-kernel's buffers split into pieces."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from dsv4_kernels.formats import quant_fp4
from dsv4serve.experts.kt_backend import KtGeometry, KtThreads, kt_kernel_available
from dsv4serve.experts.kt_experts import KtExperts

# found without importing it: kt-kernel's import turns on flush-to-zero for the process (kt_backend.load_kt
# turns it off again), which a module-level import here would leave on for every later test in the worker
pytestmark = pytest.mark.skipif(not kt_kernel_available()[0], reason=kt_kernel_available()[1])


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


oracle = _load("kt_oracle")
GEOMETRY = KtGeometry(n_experts=8, topk=2, dim=128, inter_dim=128, swiglu_limit=10.0)
LAYER = 3


def random_parts(g: KtGeometry, seed: int) -> dict[str, torch.Tensor]:
    """Stacked MXFP4 parts as the bank holds them, from seeded normal weights (some gate values past the clamp)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w1": (g.inter_dim, g.dim), "w3": (g.inter_dim, g.dim), "w2": (g.dim, g.inter_dim)}
    parts = {}
    for name, (out_dim, in_dim) in shapes.items():
        packed = [quant_fp4(4 * torch.randn(out_dim, in_dim, generator=gen) / in_dim**0.5) for _ in range(g.n_experts)]
        parts[name] = torch.stack([c for c, _ in packed])
        parts[f"{name}_scale"] = torch.stack([s for _, s in packed])
    return parts


def routes(n: int, g: KtGeometry, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, g.dim, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(g.n_experts, generator=gen)[: g.topk] for _ in range(n)])
    return x, ids, torch.rand(n, g.topk, generator=gen)


@pytest.fixture(scope="module")
def parts():
    return random_parts(GEOMETRY, 11)


@pytest.fixture(scope="module")
def kt(parts):
    return KtExperts({LAYER: parts}, GEOMETRY, KtThreads((0,), (1,)), max_tokens=8)


def test_one_token_at_a_time_is_bit_exact_and_not_zero(kt, parts):
    x, ids, w = routes(6, GEOMETRY, 1)
    for t in range(6):
        out = kt.forward(LAYER, x[t : t + 1], ids[t : t + 1], w[t : t + 1])
        ref = oracle.kt_reference(x[t : t + 1], ids[t : t + 1], w[t : t + 1], parts, GEOMETRY.swiglu_limit)
        assert out.dtype == torch.bfloat16 and out.abs().sum() > 0  # the "silently returns zeros" failure
        assert torch.equal(out, ref)


def test_a_batch_longer_than_the_buffers_equals_its_rows(kt, parts):
    x, ids, w = routes(19, GEOMETRY, 2)  # 8-row buffers: three pieces
    out = kt.forward(LAYER, x, ids, w)
    rows = torch.cat([kt.forward(LAYER, x[t : t + 1], ids[t : t + 1], w[t : t + 1]) for t in range(19)])
    assert torch.equal(out, rows)
    assert torch.equal(out, oracle.kt_reference(x, ids, w, parts, GEOMETRY.swiglu_limit))


def test_experts_marked_on_the_device_are_skipped_and_the_mask_is_read_live(kt, parts):
    x, ids, w = routes(5, GEOMETRY, 3)
    on_device = torch.zeros(GEOMETRY.n_experts, dtype=torch.bool)
    on_device[::2] = True
    part = kt.forward(LAYER, x, ids, w, on_device)
    assert torch.equal(part, oracle.kt_reference(x, ids, w, parts, GEOMETRY.swiglu_limit, frozenset(range(0, 8, 2))))
    rest = kt.forward(LAYER, x, ids, w, ~on_device)  # the same MoE object, the other half
    full = kt.forward(LAYER, x, ids, w)
    assert torch.allclose(part.float() + rest.float(), full.float(), atol=2**-7 * full.abs().max().item())
    skipped = torch.where(on_device[ids], -1, ids)  # -1 routes are skipped too: the same result
    assert torch.equal(kt.forward(LAYER, x, skipped, w), part)


def test_the_weights_are_kt_kernel_s_own_copy(parts):
    mine = {k: v.clone() for k, v in parts.items()}
    kt = KtExperts({0: mine}, GEOMETRY, KtThreads((0,), (1,)))
    x, ids, w = routes(3, GEOMETRY, 4)
    before = kt.forward(0, x, ids, w)
    for t in mine.values():
        t.fill_(0x22)  # the bank's tensors may be dropped after the hand-over
    assert torch.equal(kt.forward(0, x, ids, w), before)


def test_the_stream_forward_over_fixed_buffers_equals_the_plain_one_and_its_check_catches_a_silent_one(kt, parts):
    """kt_experts.stream_task / run_on_stream / wait_on_stream (the CPU stands in for the stream): a task built once
    over fixed buffers computes whatever they hold when it runs, as the plain forward does, bit for bit; the
    start-up check (kt_stream_check.py) passes it and names a stream forward that leaves the output untouched."""
    from dsv4serve.experts.kt_stream_check import check_stream_graph

    cpu = torch.device("cpu")
    bufs = kt.stream_buffers(3, cpu)
    task = kt.stream_task(LAYER, bufs)
    none_on_device = torch.zeros(GEOMETRY.n_experts, dtype=torch.bool)
    for seed in (5, 6):  # the same task, new inputs in the same buffers
        x, ids, w = routes(3, GEOMETRY, seed)
        bufs.x.copy_(x), bufs.ids.copy_(ids), bufs.weights.copy_(w)
        kt.set_mask(LAYER, none_on_device)
        kt.run_on_stream(task, cpu)
        kt.wait_on_stream(cpu)
        want = kt.forward(LAYER, x, ids, w, none_on_device)
        assert want.abs().sum() > 0 and torch.equal(bufs.out, want)
    assert kt.stream_task(LAYER, bufs) is task  # built once per layer and buffers
    assert check_stream_graph(kt, LAYER, cpu) is None
    silent = KtExperts({LAYER: parts}, GEOMETRY, KtThreads((0,), (1,)), max_tokens=8)
    silent.run_on_stream = lambda task, device: None  # a build whose stream submit does nothing
    why = check_stream_graph(silent, LAYER, cpu)
    assert why is not None and "differed from the synchronous one" in why
