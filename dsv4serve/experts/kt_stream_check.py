"""Before hybrid decode steps are captured (CUDA): kt-kernel's stream forward, captured in a CUDA graph and replayed,
must compute what its plain forward computes.

    why = check_stream_graph(kt, layer, device)   # None: passed; else why hybrid decode steps stay eager

A build whose stream functions do nothing (compiled without its CUDA vendor, `submit_with_cuda_stream` is an empty
function) would leave the output buffer as it was, silently; a host node that frees its arguments after one run
would break on the second replay. So: one graph of [copy the inputs in, run_on_stream, wait_on_stream], replayed
on two different inputs, each output equal to kt-kernel's synchronous forward of the same inputs bit for bit.
"""

from __future__ import annotations

import torch

from dsv4serve.experts.kt_experts import KtExperts

ROWS = 2  # tokens of the checked forward


def _inputs(kt: KtExperts, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    geo = kt.geometry
    x = torch.randn(ROWS, geo.dim, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(geo.n_experts, generator=g)[: geo.topk] for _ in range(ROWS)])
    weights = torch.rand(ROWS, geo.topk, generator=g)
    return x, ids.to(torch.int64), weights


def check_stream_graph(kt: KtExperts, layer: int, device: torch.device) -> str | None:
    """None when two replays of a captured stream forward equal the synchronous forward; else the reason. On the
    CPU (no graph) the same sequence runs directly: the plain submit / sync it stands for."""
    bufs = kt.stream_buffers(ROWS, device)
    src = [tuple(t.to(device) for t in _inputs(kt, seed)) for seed in (1, 2)]
    staged = tuple(torch.empty_like(t) for t in src[0])  # the graph's inputs on the device
    everyone = torch.zeros(kt.geometry.n_experts, dtype=torch.bool)  # no expert on the device: the CPU does all

    def forward() -> None:
        for buf, t in zip((bufs.x, bufs.ids, bufs.weights), staged):
            buf.copy_(t, non_blocking=True)
        kt.run_on_stream(kt.stream_task(layer, bufs), device)
        kt.wait_on_stream(device)

    try:
        kt.set_mask(layer, everyone)
        replay = forward
        if device.type == "cuda":
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream), torch.cuda.graph(graph):
                forward()
            torch.cuda.current_stream(device).wait_stream(stream)
            replay = graph.replay
        for inputs in src:
            for s, t in zip(staged, inputs):
                s.copy_(t)
            bufs.out.zero_()
            replay()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            x, ids, weights = (t.cpu() for t in inputs)
            want = kt.forward(layer, x, ids, weights, everyone)
            if not torch.equal(bufs.out, want):
                diff = (bufs.out.float() - want.float()).abs().max().item()
                return f"a replayed stream forward differed from the synchronous one (max |diff| {diff:.3g})"
    except (RuntimeError, AttributeError) as exc:
        return f"capturing kt-kernel's stream forward failed: {exc}"
    return None
