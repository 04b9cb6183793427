"""A step captured as CUDA graph segments, cut where the host must work mid-step.

    with capture(pool, cuts=True) as graph:   # on a side stream, as torch.cuda.graph captures
        outputs = forward()                   # code that may call cut(hook) at a host point
    graph.replay()                            # segment 0, hook 0, segment 1, hook 1, ..., segment n

A layer whose experts the device cannot read in place (a bank beyond the pin budget: pageable RAM, or the
checkpoint's shards on disk) needs the host in the middle of the step: it learns the layer's routing and stages
the routed experts into pinned memory before the layer's kernels run (staging.py). One CUDA graph cannot hold that
wait, so such steps ran eagerly, every launch paid from Python (~1,500 a DeepSeek-V4-Flash step). Cut instead: the
staging path calls `cut(hook)`, which ends the segment being captured, keeps `hook` (the host work, not run now:
nothing executes during a capture), and begins the next segment in the same memory pool. A replay runs the segments
in order with the hooks between them: a hook waits for its segment's routing (the one host sync it costs), stages,
and the next segment's kernels read the staged experts. Tensors made in one segment and read in a later one keep
their addresses (one pool, replayed in the order captured), so the segments chain as one forward does.

`cut` outside a cut capture returns False: the caller does its host work at once, as an eager step does. The
worker checks a cut capture at start-up against the eager step before it keeps it (worker/graphs.py).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch

_ACTIVE: list[CutGraph] = []  # the capture in progress that takes cuts (the worker captures on one thread)


class CutGraph:
    """CUDA graph segments and the host hooks between them (module doc); one segment when nothing cut it."""

    def __init__(self, pool: Any):
        self.pool = pool
        self.segments: list[Any] = []  # torch.cuda.CUDAGraph
        self.hooks: list[Callable[[], None]] = []

    @property
    def cuts(self) -> int:
        return len(self.hooks)

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.segments.append(graph)

    def _end(self) -> None:
        self.segments[-1].capture_end()

    def replay(self) -> None:
        for i, segment in enumerate(self.segments):
            segment.replay()
            if i < len(self.hooks):
                with torch.inference_mode():  # the hooks write buffers the forward made under it
                    self.hooks[i]()


@contextlib.contextmanager
def capture(pool: Any, cuts: bool) -> Iterator[CutGraph]:
    """Capture what the block runs into a CutGraph, on a side stream; `cuts`: host points may cut it (`cut`),
    else it is one torch.cuda.graph capture (a host point then fails the capture, as it always did)."""
    if pool is None:  # the segments share one pool: a later segment reads what an earlier one wrote
        pool = torch.cuda.graph_pool_handle()
    graph = CutGraph(pool)
    if not cuts:
        whole = torch.cuda.CUDAGraph()
        with torch.cuda.graph(whole, pool=pool):
            yield graph
        graph.segments.append(whole)
        return
    torch.cuda.synchronize()  # as torch.cuda.graph: nothing pending, the allocator's free blocks returned
    gc.collect()
    torch.cuda.empty_cache()
    with torch.cuda.stream(torch.cuda.Stream()), taking_cuts(graph):
        yield graph


@contextlib.contextmanager
def taking_cuts(graph: CutGraph) -> Iterator[CutGraph]:
    """`graph` captures (its first segment begun) and takes the cuts of the block: capture's part that is not
    CUDA's (a test's stand-in graph runs it on the CPU)."""
    graph._begin()
    _ACTIVE.append(graph)
    try:
        yield graph
    except BaseException:
        _ACTIVE.pop()
        with contextlib.suppress(RuntimeError):  # the capture's own error is the one to report
            graph._end()
        raise
    _ACTIVE.pop()
    graph._end()


def cut(hook: Callable[[], None]) -> bool:
    """At a host point of a step: inside a cut capture, end the segment, keep `hook` for the replays and begin the
    next segment (True); outside one, False: the caller does its host work now."""
    if not _ACTIVE:
        return False
    graph = _ACTIVE[-1]
    graph._end()
    graph.hooks.append(hook)
    graph._begin()
    return True
