"""--moe-backend hybrid with the grouped FP4 kernel as the device path (interpreter, dsv4-tiny, 20 slots): the
routes kt-kernel computes reach the kernel as weight-0 routes to a stand-in slot expert, so the MoE layer
matches the hybrid torch path within the kernel's stated tolerance against torch (test_packed_load.py:
2^-6 of the routes' summed magnitudes + 2^-8 relative); the CPU part is the same in both."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4_kernels.fp4_moe_ref import down_ref, gate_up_ref
from dsv4_kernels.fp8_gemm_ref import act_quant_fp8_ref
from dsv4serve.checkpoint.loader import open_checkpoint
from dsv4serve.experts.attach import attach_cpu_experts, attach_expert_cache, iter_resident_dense
from dsv4serve.experts.kt_backend import kt_kernel_available
from dsv4serve.experts.slot_cache import PART_ORDER
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.numerics import NUMERICS_ON
from dsv4serve.model.transformer import Transformer

# found without importing it: kt-kernel's import turns on flush-to-zero for the process (kt_backend.load_kt
# turns it off again), which a module-level import here would leave on for every later test in the worker
pytestmark = pytest.mark.skipif(not kt_kernel_available()[0], reason=kt_kernel_available()[1])

CPU = torch.device("cpu")


@pytest.mark.parametrize(("seed", "tokens"), [(2, 5), (0, 3)])  # the stand-in (expert 0) routed too, or not
def test_the_kernel_device_path_with_cpu_experts_matches_the_torch_one(tiny_dir, seed, tokens):
    ckpt = open_checkpoint(tiny_dir)
    model = Transformer(ckpt.args, include_mtp=True).eval()
    cache = attach_expert_cache(model, ckpt, 20, CPU, progress=False)
    model.load_state_dict(dict(iter_resident_dense(ckpt, progress=False)), strict=True)
    hybrid = attach_cpu_experts(model, cache, CPU, room_bytes=2**30)
    kernel_num = dataclasses.replace(NUMERICS_ON, backends=KernelBackends(fp4_moe="triton"))
    moe = model.layers[3].ffn
    x = torch.randn(tokens, ckpt.args.dim, generator=torch.Generator().manual_seed(seed)).bfloat16()
    tokens = torch.arange(tokens)
    with torch.no_grad():
        weights, ids = moe.gate(x, tokens, NUMERICS_ON)
        cache.collect_usage()
        before, usage, cpu_uses = hybrid.stats.cpu_experts, cache.usage_row(3).clone(), cache.stats.cpu_uses
        by_kernel = moe(x, tokens, kernel_num).float()
        on_cpu, grown = hybrid.stats.cpu_experts - before, cache.usage_row(3) - usage
        cache.collect_usage()
        by_torch = moe(x, tokens, NUMERICS_ON).float()
    assert 0 < on_cpu < len(ids.unique())  # both paths took part
    assert cache.stats.cpu_uses - cpu_uses == on_cpu  # /metrics' expert_cache_cpu_uses_total
    assert torch.equal(grown, _routing_record(ids, cache.host_slot_map(3)))  # the stand-in's route not counted
    w = [cache.bank.layers[3][p] for p in PART_ORDER]
    per_route = down_ref(
        *act_quant_fp8_ref(gate_up_ref(*act_quant_fp8_ref(x), *w[:4], weights, ids, moe.swiglu_limit)), *w[4:], ids
    )
    # the outputs are rounded to bf16 at the end: one more bf16 ulp of the result on top of the kernel's bound
    bound = 2.0**-6 * per_route.float().abs().view(*ids.shape, -1).sum(1) + 2.0**-7 * by_torch.abs()
    assert bool(((by_kernel - by_torch).abs() <= bound).all())
    assert not torch.equal(by_kernel, torch.zeros_like(by_kernel))
    ckpt.source.close()


def _routing_record(ids: torch.Tensor, slot_of: torch.Tensor) -> torch.Tensor:
    """What a step's routing adds to a layer's usage counters: 1 per distinct expert, and in the last column those
    read from a slot (slot_cache.py's record, whether the device or the CPU computed them)."""
    record = torch.zeros(len(slot_of) + 1, dtype=torch.int64)
    routed = ids.unique()
    record[routed] = 1
    record[-1] = int((slot_of[routed] >= 0).sum())
    return record


def test_a_graph_step_on_the_kernel_path_is_the_graph_step_on_the_torch_one(tiny_dir):
    """The hybrid graph split (experts/hybrid_graph.py) with the grouped FP4 kernel as the device path: within the
    kernel's bound of the same split on the torch path, and the usage counters record the routing (the CPU set's
    uses counted on the device, the stand-in's taken back)."""
    ckpt = open_checkpoint(tiny_dir)
    model = Transformer(ckpt.args, include_mtp=True).eval()
    cache = attach_expert_cache(model, ckpt, 20, CPU, progress=False)
    model.load_state_dict(dict(iter_resident_dense(ckpt, progress=False)), strict=True)
    split = attach_cpu_experts(model, cache, CPU, room_bytes=2**30).graph
    kernel_num = dataclasses.replace(NUMERICS_ON, backends=KernelBackends(fp4_moe="triton"))
    moe = model.layers[3].ffn
    x = torch.randn(3, ckpt.args.dim, generator=torch.Generator().manual_seed(0)).bfloat16()
    tokens = torch.arange(3)  # routes to experts 1, 2, 3 (slots) and 6: the stand-in (0) is not routed
    cache.begin_step()
    split.begin_step()
    with torch.no_grad(), split.steps():
        weights, ids = moe.gate(x, tokens, NUMERICS_ON)
        usage = cache.usage_row(3).clone()
        by_kernel = moe(x, tokens, kernel_num).float()
        grown = cache.usage_row(3) - usage
        by_torch = moe(x, tokens, NUMERICS_ON).float()
    routed = frozenset(ids.unique().tolist())
    assert routed & split.cpu_experts(3) and routed - split.cpu_experts(3)  # both paths took part
    assert torch.equal(grown, _routing_record(ids, cache.host_slot_map(3)))
    w = [cache.bank.layers[3][p] for p in PART_ORDER]
    per_route = down_ref(
        *act_quant_fp8_ref(gate_up_ref(*act_quant_fp8_ref(x), *w[:4], weights, ids, moe.swiglu_limit)), *w[4:], ids
    )
    bound = 2.0**-6 * per_route.float().abs().view(*ids.shape, -1).sum(1) + 2.0**-7 * by_torch.abs()
    assert bool(((by_kernel - by_torch).abs() <= bound).all()) and by_kernel.abs().sum() > 0
    ckpt.source.close()


def test_a_streamed_chunk_fetches_every_miss_but_a_disk_layer_keeps_its_misses_on_the_cpu(tiny_dir):
    """A chunk whose experts the cache streams (24 tokens x top-2 over 8 experts: past 4 routes an expert) sends no
    miss to kt-kernel in a layer in RAM (the stream copies the whole layer anyway: the layer is the offload path's, bit
    for bit); a layer left in the shards sends its misses to kt-kernel's own copy and is not streamed."""
    ckpt = open_checkpoint(tiny_dir)
    layer_bytes = sum(s.nbytes for s in ckpt.specs if s.group == "routed_experts" and s.layer == 0)
    model = Transformer(ckpt.args, include_mtp=True).eval()
    cache = attach_expert_cache(model, ckpt, 3, CPU, ram_bytes=3 * layer_bytes, progress=False, stream_group=3)
    model.load_state_dict(dict(iter_resident_dense(ckpt, progress=False)), strict=True)
    hybrid = attach_cpu_experts(model, cache, CPU, room_bytes=2**30)
    assert 3 in cache.bank.mapped and 0 in cache.bank.layers and hybrid.kt.holds(3)
    num = dataclasses.replace(NUMERICS_ON, backends=KernelBackends(fp4_moe="triton"))
    x = torch.randn(24, ckpt.args.dim, generator=torch.Generator().manual_seed(4)).bfloat16()
    tokens = torch.arange(24)
    with torch.no_grad(), cache.detached():
        moe = model.layers[0].ffn
        hybrid_out = moe(x, tokens, num)
        assert (hybrid.stats.cpu_experts, cache.stats.streamed_layers) == (0, 1)
        moe.cpu_experts = None
        assert torch.equal(hybrid_out, moe(x, tokens, num))  # the offload path's streamed layer
        moe.cpu_experts = hybrid
        model.layers[3].ffn(x, tokens, num)
        assert hybrid.stats.cpu_experts > 0 and cache.stats.streamed_layers == 2  # only layer 0's second run
    ckpt.source.close()
