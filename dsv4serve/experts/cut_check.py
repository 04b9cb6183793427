"""Before decode steps with staged layers are captured (CUDA): a graph cut at the staging path, replayed, must compute
what the eager layer computes.

    why = check_cut_graph(moe, cache, numerics, device)   # None: passed; else why those steps stay eager

A cut graph (graph_cuts.py) relies on things no CPU test can show: that a tensor a segment writes is where the next
segment reads it, that the hook's wait for the routing orders it after the first segment, and that the second
segment's kernels read the staging area as the hook left it. So: one staged MoE layer (router, the cut, the routed
experts' kernels, the shared expert) captured with its cut, replayed on two inputs, the staging area emptied before
each, and each output equal to the eager layer's on the same input, bit for bit. The check's forwards count as no
uses of the slot cache (`ExpertSlotCache.detached`); hybrid CPU experts are left out of it (their stream forward
has its own check, kt_stream_check.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dsv4serve.experts import graph_cuts
from dsv4serve.experts.slot_cache import ExpertSlotCache
from dsv4serve.model.moe import MoE
from dsv4serve.model.numerics import Numerics

ROWS = 2  # tokens of the checked forward


def _inputs(dim: int, vocab: int, numerics: Numerics, device: torch.device, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, dim, generator=g).to(numerics.compute_dtype)
    tokens = torch.randint(0, vocab, (ROWS,), generator=g, dtype=torch.int32)
    return x.to(device), tokens.to(device)


def capture_cut(forward: Callable[[], torch.Tensor]) -> tuple[graph_cuts.CutGraph, torch.Tensor]:
    """`forward` captured with cuts (graph_cuts.capture) -> (the graph, its output tensor)."""
    with graph_cuts.capture(None, cuts=True) as graph:
        out = forward()
    return graph, out


def check_cut_graph(
    moe: MoE,
    cache: ExpertSlotCache,
    numerics: Numerics,
    device: torch.device,
    dim: int,
    vocab: int,
    capture_forward: Callable[[Callable[[], torch.Tensor]], tuple[Any, torch.Tensor]] = capture_cut,
) -> str | None:
    """None when two replays of the layer's cut graph equal its eager forward; else the reason. `moe` must be a layer
    the cache stages (ExpertSlotCache.staged_layers); `capture_forward`: how the forward is captured (a CPU test's
    stand-in replays it eagerly)."""
    if moe.layer_id not in cache.staged_layers:
        raise ValueError(f"layer {moe.layer_id} is not staged: nothing would cut its graph")
    src = [_inputs(dim, vocab, numerics, device, seed) for seed in (1, 2)]
    x, tokens = (torch.empty_like(t) for t in src[0])  # the graph's inputs
    cpu_experts, moe.cpu_experts = moe.cpu_experts, None  # the cut alone: hybrid's eager split syncs, kt_stream_check
    try:
        with torch.inference_mode(), cache.detached():  # as a forward runs (the area is made in it)
            x.copy_(src[0][0])
            tokens.copy_(src[0][1])
            moe(x, tokens, numerics)  # warm-up: compiles and lazy buffers stay out of the capture
            graph, out = capture_forward(lambda: moe(x, tokens, numerics))
            if graph.cuts != 1:
                return f"the layer's capture was cut {graph.cuts} times, not once"
            for inputs in src:
                x.copy_(inputs[0])
                tokens.copy_(inputs[1])
                cache._staging.forget()
                graph.replay()
                got = out.clone()
                cache._staging.forget()
                want = moe(*inputs, numerics)
                if not torch.equal(got, want):
                    diff = (got.float() - want.float()).abs().max().item()
                    return f"a replayed cut graph differed from the eager layer (max |diff| {diff:.3g})"
    except RuntimeError as exc:
        return f"capturing a graph cut at the staging path failed: {str(exc).splitlines()[0]}"
    finally:
        moe.cpu_experts = cpu_experts
    return None
