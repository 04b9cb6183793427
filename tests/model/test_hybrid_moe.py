"""--moe-backend hybrid on dsv4-tiny (D = I = 128 suit kt-kernel's MXFP4 experts), half of the 40 routed
experts in device slots: an MoE layer equals its device part (the torch path on the slot experts) plus
the kt oracle (tests/unit/kt_oracle.py) on the rest, bit for bit, and the torch path within the FP8
rounding the CPU experts skip (the device path quantizes the SwiGLU output to FP8 before w2, kt-kernel
keeps it bf16); the whole model, prefill and decode, is bit for bit the model with the oracle in
kt-kernel's place. (Its logits are not compared with the torch path's: dsv4-tiny's random weights make
them chaotic, 0.5% noise on the routed experts' sums moves its prefill logits by about 20% RMS and
flips greedy tokens, so only the layer-level bound above is meaningful.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from dsv4serve.checkpoint.loader import open_checkpoint
from dsv4serve.experts.attach import attach_cpu_experts, attach_expert_cache, iter_resident_dense
from dsv4serve.experts.kt_backend import kt_kernel_available
from dsv4serve.experts.kt_experts import KtJob
from dsv4serve.model.numerics import NUMERICS_ON, act_quant
from dsv4serve.model.transformer import BatchRow, Transformer

# found without importing it: kt-kernel's import turns on flush-to-zero for the process (kt_backend.load_kt
# turns it off again), which a module-level import here would leave on for every later test in the worker
pytestmark = pytest.mark.skipif(not kt_kernel_available()[0], reason=kt_kernel_available()[1])

SLOTS = 20  # of 5 MoE layers x 8 experts: 4 a layer at the start
PROMPT_TOKENS, DECODE_STEPS = 24, 6
_spec = importlib.util.spec_from_file_location("kt_oracle", Path(__file__).parents[1] / "unit" / "kt_oracle.py")
oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oracle)


@pytest.fixture(scope="module")
def ckpt(tiny_dir):
    c = open_checkpoint(tiny_dir)
    yield c
    c.source.close()


def offloaded(ckpt, hybrid: bool):
    model = Transformer(ckpt.args, include_mtp=True).eval()
    cache = attach_expert_cache(model, ckpt, SLOTS, torch.device("cpu"), progress=False)
    model.load_state_dict(dict(iter_resident_dense(ckpt, progress=False)), strict=True)
    cpu = attach_cpu_experts(model, cache, torch.device("cpu"), room_bytes=2**30) if hybrid else None
    return model, cache, cpu


def generate(model: Transformer) -> tuple[torch.Tensor, list[int]]:
    ids = torch.randint(0, model.args.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(3))
    state = model.new_state(NUMERICS_ON)
    rows = [model([BatchRow(ids, state)], NUMERICS_ON, all_logits=True).logits[0]]
    tokens = [int(rows[-1][-1].argmax())]
    for _ in range(DECODE_STEPS):
        logits = model([BatchRow(torch.tensor(tokens[-1:]), state)], NUMERICS_ON).logits[0]
        rows.append(logits[None])
        tokens.append(int(logits.argmax()))
    return torch.cat(rows), tokens


def test_an_moe_layer_is_its_slot_experts_plus_kt_kernel_s(ckpt):
    model, cache, cpu = offloaded(ckpt, hybrid=True)
    moe = model.layers[2].ffn  # gate-routed
    x = torch.randn(6, ckpt.args.dim, generator=torch.Generator().manual_seed(1)).bfloat16()
    tokens = torch.arange(6)
    with torch.no_grad():
        weights, ids = moe.gate(x, tokens, NUMERICS_ON)
        in_slot = cache.host_slot_map(2) >= 0
        on_cpu = frozenset(int(e) for e in ids.unique() if not in_slot[e])
        assert on_cpu and len(on_cpu) < len(ids.unique())  # both paths take part
        before = cpu.stats.cpu_experts
        got = moe(x, tokens, NUMERICS_ON)
        assert cpu.stats.cpu_experts - before == len(on_cpu)
        xq = act_quant(x, NUMERICS_ON)
        device_part = moe._routed_torch(xq, weights, ids, NUMERICS_ON, on_cpu)
        parts = cache.bank.layers[2]
        slot_experts = frozenset(range(8)) - on_cpu
        cpu_part = oracle.kt_reference(xq, ids, weights, parts, ckpt.args.swiglu_limit, slot_experts)
        want = device_part + cpu_part.float() + moe.shared_experts(xq, NUMERICS_ON)
    assert cpu_part.abs().sum() > 0 and torch.equal(got, want.to(got.dtype))
    # against the torch path (every expert through the device arithmetic): the CPU experts' down projection
    # skips the FP8 rounding of its input (e4m3: 3 mantissa bits, relative error up to 2^-4, about 2% RMS)
    torch_part = moe._routed_torch(xq, weights, ids, NUMERICS_ON, slot_experts)
    rel = ((cpu_part.float() - torch_part).norm() / torch_part.norm()).item()
    print(f"CPU experts vs the torch path: relative RMS {rel:.4f}")
    assert 0 < rel < 2**-4


def test_the_hybrid_model_is_the_torch_path_with_the_oracle_for_kt_kernel(ckpt):
    """Prefill and decode (the slot cache promoting between steps): kt-kernel replaced by the oracle gives the
    same logits bit for bit, so every split, mask, stand-in and sum in between is right."""
    model, cache, cpu = offloaded(ckpt, hybrid=True)
    logits, tokens = generate(model)
    twin, twin_cache, twin_cpu = offloaded(ckpt, hybrid=True)
    layer_parts = twin_cache.bank.layers

    def oracle_submit(layer, x, ids, weights, on_device):
        skip = frozenset(torch.nonzero(on_device).flatten().tolist())
        out = oracle.kt_reference(x.bfloat16(), ids, weights, layer_parts[layer], ckpt.args.swiglu_limit, skip)
        return KtJob(_Done(), out, ())

    twin_cpu.kt.submit = oracle_submit
    twin_logits, twin_tokens = generate(twin)
    assert (
        cpu.stats.cpu_experts > 0 and cache.stats.prefetches > 0 and cpu.stats.cpu_experts == twin_cpu.stats.cpu_experts
    )
    assert torch.equal(logits, twin_logits) and tokens == twin_tokens


class _Done:
    def sync(self) -> None:
        pass


# ------------------------------------------------------------------ decode steps as graphs (hybrid_graph.py)


def test_a_graph_step_s_moe_layer_is_its_device_part_plus_kt_kernel_on_the_cpu_set(ckpt):
    """Inside a decode graph's step the CPU set is fixed before the step: routes to it are kt-kernel's (through the
    stream buffers), the rest the device path's, bit for bit; the CPU's uses reach the slot cache's counters."""
    model, cache, cpu = offloaded(ckpt, hybrid=True)
    split, moe = cpu.graph, model.layers[2].ffn
    x = torch.randn(6, ckpt.args.dim, generator=torch.Generator().manual_seed(1)).bfloat16()
    tokens = torch.arange(6)
    cache.begin_step()
    split.begin_step()
    cpu_set = split.cpu_experts(2)
    free = frozenset(torch.nonzero(cache.host_slot_map(2) < 0).flatten().tolist())
    assert cpu_set <= free and 0 < split.cpu_share <= 1  # the CPU device: no fetch cost, so all of them
    with torch.no_grad():
        weights, ids = moe.gate(x, tokens, NUMERICS_ON)
        routed = frozenset(ids.unique().tolist())
        assert routed & cpu_set and routed - cpu_set  # both paths take part
        usage = cache.usage_row(2).clone()
        cache.collect_usage()
        cpu_uses = cache.stats.cpu_uses
        with split.steps():
            got = moe(x, tokens, NUMERICS_ON)
        xq = act_quant(x, NUMERICS_ON)
        device_part = moe._routed_torch(xq, weights, ids, NUMERICS_ON, cpu_set)
        skip = frozenset(range(ckpt.args.n_routed_experts)) - cpu_set
        cpu_part = oracle.kt_reference(xq, ids, weights, cache.bank.layers[2], ckpt.args.swiglu_limit, skip)
        want = device_part + cpu_part.float() + moe.shared_experts(xq, NUMERICS_ON)
    assert cpu_part.abs().sum() > 0 and torch.equal(got, want.to(got.dtype))
    grown = cache.usage_row(2) - usage
    for e in cpu_set:
        assert int(grown[e]) == int((ids == e).any()), e  # one use per expert and step
    cache.collect_usage()  # and /metrics' CPU uses (expert_cache_cpu_uses_total) count them
    assert cache.stats.cpu_uses - cpu_uses == len(routed & cpu_set)


def test_decode_graph_steps_with_hybrid_experts_are_the_oracle_s(ckpt):
    """Through worker/graphs.py (eager standing in for the graph: the same static buffers, boundaries and split):
    kt-kernel's stream forwards replaced by the oracle give the same tokens and log-probabilities bit for bit over
    prefill and decode steps of three requests, the slot cache promoting between steps."""
    from dsv4serve.ipc.messages import AddRequest
    from dsv4serve.ipc.sampling import SamplingParams
    from dsv4serve.model.kv_pool import KvPool
    from dsv4serve.worker.graphs import DecodeGraphs
    from dsv4serve.worker.runner import Runner
    from dsv4serve.worker.scheduler import Scheduler, SchedulerLimits

    def serve(model, cache) -> dict[str, list[tuple[int, float]]]:
        page, max_len = model.args.page_tokens, 256
        limits = SchedulerLimits(4, 4, 32 * page, page, max_len, model.args.eos_token_id)
        pool = KvPool(model.args, NUMERICS_ON.compute_dtype, num_pages=33, num_slots=limits.num_slots + 1)
        graphs = DecodeGraphs(
            model, pool, NUMERICS_ON, 4, max_len, pool.num_slots - 1, pool.num_pages - 1, False, expert_cache=cache
        )
        runner = Runner(model, pool, NUMERICS_ON, model.args.eos_token_id, torch.device("cpu"), graphs=graphs)
        sched, outs = Scheduler(limits), {}
        for i in range(3):
            prompt = list(range(200 + 11 * i, 220 + 13 * i))
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6, logprobs=0)
            sched.add(AddRequest(f"r{i}", prompt, params))
        while sched.has_work:
            plan = sched.schedule(4096)
            for msg in sched.complete(plan, runner.execute(plan)):
                outs.setdefault(msg.request_id, []).extend((t.token_id, t.logprob) for t in msg.tokens)
        assert graphs.hybrid is not None
        sets = [graphs.hybrid.cpu_experts(layer) for layer in graphs.hybrid.layers]
        calls: list[int] = []
        graphs.hybrid.begin_step = lambda: calls.append(1)  # what a replay's check must not redo
        graphs.run([(5, 30, 0, [0])], eager=True, same_split=True)  # the replay's CPU sets, kept
        assert not calls and sets == [graphs.hybrid.cpu_experts(layer) for layer in graphs.hybrid.layers]
        return outs

    model, cache, cpu = offloaded(ckpt, hybrid=True)
    with torch.no_grad():
        got = serve(model, cache)
    twin, twin_cache, twin_cpu = offloaded(ckpt, hybrid=True)
    kt, parts, ran = twin_cpu.kt, twin_cache.bank.layers, []

    def oracle_run(task, device):
        layer, b = task
        skip = frozenset(torch.nonzero(kt.masks[kt._row[layer]]).flatten().tolist())
        b.out.copy_(oracle.kt_reference(b.x, b.ids, b.weights, parts[layer], ckpt.args.swiglu_limit, skip))
        ran.append(layer)

    kt.stream_task = lambda layer, bufs: (layer, bufs)
    kt.run_on_stream, kt.wait_on_stream = oracle_run, lambda device: None
    with torch.no_grad():
        want = serve(twin, twin_cache)
    assert ran and got == want and all(len(v) == 6 for v in got.values())


def test_kt_kernel_holds_at_most_the_layers_the_projection_asks_for(ckpt):
    """attach_cpu_experts(max_layers=k): kt-kernel loads the first k MoE layers only (the count
    memory/decode_choice.best_kt_layers prefers on a CUDA worker); the rest stay on the offload path."""
    model = Transformer(ckpt.args, include_mtp=True).eval()
    cache = attach_expert_cache(model, ckpt, SLOTS, torch.device("cpu"), progress=False)
    model.load_state_dict(dict(iter_resident_dense(ckpt, progress=False)), strict=True)
    every = cache.layers
    cpu = attach_cpu_experts(model, cache, torch.device("cpu"), room_bytes=2**30, max_layers=2)
    assert cpu.kt.layers == every[:2] and [cpu.kt.holds(layer) for layer in every] == [True, True] + [False] * (
        len(every) - 2
    )
