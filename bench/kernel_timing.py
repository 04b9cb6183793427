"""Device time of one kernel call, as a decode step's CUDA graph runs it (bench/gpu_fp4_sweep.py, gpu_fp8_sweep.py).

Timing a single eager launch between two CUDA events counts the Python launch (tens of microseconds for a
Triton kernel with many arguments) whenever the kernel is shorter than it, and repeating one call on the
same weights lets a 60 MB L2 serve them after the first. So the calls, each on its own weights / routing,
are captured back to back in one CUDA graph (the ~1 us gap between kernels a replay leaves, as in the decode
step) and the graph is replayed `repeats` times: one call's time = the median replay / the number of calls.
Make the calls' data together larger than L2 (the sweeps use >= 256 MB).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch


def time_us(calls: Sequence[Callable[[], object]], repeats: int) -> float:
    """Median device microseconds of one call (see the module doc); on the CPU (--cpu-smoke: no CUDA) the
    wall time of one pass over the calls, divided the same way (a check of the code, not a timing)."""
    for fn in calls[:2]:  # the first builds the kernel and the lazily made buffers (split-K counters)
        fn()
    if not torch.cuda.is_available():
        start_s = time.perf_counter()
        for fn in calls:
            fn()
        return 1e6 * (time.perf_counter() - start_s) / len(calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm every call outside the graph (allocator pools, lazy state)
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(1e3 * start.elapsed_time(end) / len(calls))
    return statistics.median(samples)
