"""Decode graphs cut at the staging path (experts/graph_cuts.py), on the CPU with a stand-in for the CUDA graph.

What a CPU can show: a step through layers the host stages calls `cut` once per staged layer, in layer order, and
takes no staging then (the captured kernels read the staging area the hook will fill); each hook, run where its
segment ends, stages its own layer's routed experts from the routing that segment wrote, so running the segments
with their hooks between them computes the eager step, bit for bit. The stand-in "captures" by running the ops
eagerly, and begins the segment after a cut by running the hook just kept: what a replay does, in its order.
What needs a GPU (one pool across segments, the hook's wait ordered after its segment) the worker checks at start-up
(experts/cut_check.py, whose own logic is checked here with an eager stand-in for the replay: it passes a replay that
stages and fails one that does not) and bench/gpu_cases/decode_step.py times.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4serve.checkpoint.loader import open_checkpoint
from dsv4serve.experts import graph_cuts
from dsv4serve.experts.attach import attach_expert_cache, iter_resident_dense
from dsv4serve.experts.pinning import PinBudget
from dsv4serve.experts.slot_cache import PART_ORDER
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.numerics import NUMERICS_ON
from dsv4serve.model.transformer import BatchRow, Transformer

CPU = torch.device("cpu")
NUM = dataclasses.replace(NUMERICS_ON, backends=KernelBackends(fp4_moe="triton"), batch_invariant=False)


class StandIn(graph_cuts.CutGraph):
    """Records segment boundaries; `replaying`: a segment begun after a cut runs the hook just kept first (a
    replay's order), so graph_cuts.cut itself drives it."""

    def __init__(self, replaying: bool):
        super().__init__(None)
        self.replaying, self.events = replaying, []

    def _begin(self) -> None:
        if self.replaying and self.hooks:
            self.hooks[-1]()
        self.events.append("begin")

    def _end(self) -> None:
        self.events.append("end")


@pytest.fixture(scope="module")
def offloaded(tiny_dir):
    """dsv4-tiny's experts behind one token's worth of slots, 2 layers in RAM, the rest left in the shards: staged
    on the CPU too."""
    ckpt = open_checkpoint(tiny_dir)
    layer_bytes = sum(s.nbytes for s in ckpt.specs if s.group == "routed_experts" and s.layer == 0)
    model = Transformer(ckpt.args, include_mtp=False).eval()
    k = ckpt.args.n_activated_experts
    cache = attach_expert_cache(model, ckpt, k, CPU, PinBudget(0, "native", "test"), 2 * layer_bytes, False)
    model.load_state_dict(dict(iter_resident_dense(ckpt, progress=False)), strict=False)
    model.use_kernels(KernelBackends(fp4_moe="triton"))
    assert cache is not None and cache.staged_layers
    yield model, cache
    ckpt.source.close()


def _step(model, state, token: int) -> torch.Tensor:
    with torch.no_grad():
        return model([BatchRow(torch.tensor([token]), state)], NUM).logits[0]


def test_cut_outside_a_capture_leaves_the_host_work_to_the_caller():
    assert graph_cuts.cut(lambda: None) is False and not graph_cuts._ACTIVE


def test_a_step_is_cut_once_per_staged_layer_and_its_segments_with_their_hooks_are_the_eager_step(
    offloaded,
):
    model, cache = offloaded
    prompt = torch.arange(5, 9)
    states = [model.new_state(NUM) for _ in range(3)]
    with torch.no_grad():
        for state in states:
            model([BatchRow(prompt, state)], NUM)
    staged_main = [layer for layer in cache.staged_layers if layer < len(model.layers)]
    want = _step(model, states[0], 40)  # eager: each staged layer stages when it reaches the staging path

    replaying = StandIn(replaying=True)
    with graph_cuts.taking_cuts(replaying):
        got = _step(model, states[1], 40)
    assert replaying.cuts == len(staged_main)
    assert replaying.events == ["begin"] + ["end", "begin"] * len(staged_main) + ["end"]
    assert torch.equal(got, want)

    capturing = StandIn(replaying=False)  # hooks kept, not run: what a capture does
    staged_before = cache.stats.staged_layers
    with graph_cuts.taking_cuts(capturing):
        _step(model, states[2], 40)
    assert capturing.cuts == len(staged_main) and cache.stats.staged_layers == staged_before  # nothing staged yet
    staged_any = 0
    for i, (layer, hook) in enumerate(zip(staged_main, capturing.hooks)):  # each on the routing its segment wrote
        cache._staging.forget()
        with torch.inference_mode():  # as CutGraph.replay runs its hooks
            hook()
        area, held = cache._staging.area(), cache._staging._held
        assert cache.stats.staged_layers == staged_before + i + 1 and cache._staging._layer == layer
        assert all(int(cache.host_slot_map(layer)[e]) < 0 for e in held)  # only misses are staged
        for e in held:
            for part, t in cache.bank.expert(layer, e).items():
                assert torch.equal(area[part][e], t), (layer, e, part)
        staged_any += len(held)
    assert staged_any and set(PART_ORDER) == set(area)


class EagerReplay:
    """A captured forward stood in for on the CPU: `replay` runs it again, its cuts' hooks run where a replay runs
    them (or, `broken`, never: a replay that leaves the staging area as it was), the result into the output."""

    def __init__(self, forward, out: torch.Tensor, broken: bool):
        self.forward, self.out, self.broken, self.cuts = forward, out, broken, 0

    def replay(self) -> None:
        graph = StandIn(replaying=not self.broken)
        with graph_cuts.taking_cuts(graph):
            self.out.copy_(self.forward())
        self.cuts = graph.cuts


def test_the_start_up_check_passes_a_replay_that_stages_and_fails_one_that_does_not(offloaded):
    """cut_check.check_cut_graph's own logic (inputs, the emptied staging area, the comparison) on the CPU, with
    EagerReplay for the CUDA capture."""
    from dsv4serve.experts.cut_check import check_cut_graph

    model, cache = offloaded
    layer = next(layer for layer in cache.staged_layers if layer < len(model.layers))
    moe = model.layers[layer].ffn
    args = (moe, cache, NUM, CPU, model.args.dim, model.args.vocab_size)
    usage, stats = cache.usage.clone(), dataclasses.replace(cache.stats)

    def stand_in(broken: bool):
        def capture_forward(forward):
            graph = StandIn(replaying=False)  # a capture: the hooks kept, not run
            with graph_cuts.taking_cuts(graph):
                out = forward()
            replay = EagerReplay(forward, out, broken)
            replay.cuts = graph.cuts
            return replay, out

        return capture_forward

    assert check_cut_graph(*args, capture_forward=stand_in(broken=False)) is None
    why = check_cut_graph(*args, capture_forward=stand_in(broken=True))
    assert why is not None and why.startswith("a replayed cut graph differed from the eager layer"), why
    assert torch.equal(cache.usage, usage) and cache.stats == stats  # the check's forwards are no requests' uses
    with pytest.raises(ValueError, match="not staged"):
        check_cut_graph(model.layers[0].ffn, cache, NUM, CPU, model.args.dim, model.args.vocab_size)
