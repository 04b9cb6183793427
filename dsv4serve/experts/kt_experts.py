"""KtExperts: one kt-kernel MXFP4 MoE object per MoE layer over one CPUInfer (see kt_backend.py for the
numerics and why only the low-level API is used).

    kt = KtExperts(layer_parts, geometry, threads)   # layer -> the bank's packed parts, handed over once
    job = kt.submit(layer, x, ids, weights, on_device)
    out = job.wait()                                  # [T, D] bf16

    bufs = kt.stream_buffers(rows, device)            # a decode step's inputs and output, at fixed addresses
    kt.run_on_stream(kt.stream_task(layer, bufs), device)   # queued on the device's stream: a graph can hold it
    kt.wait_on_stream(device)

On CUDA the stream forms are kt-kernel's `CPUInfer.submit_with_cuda_stream` / `sync_with_cuda_stream`:
host functions on the current stream (cudaLaunchHostFunc), so the stream runs the CPU work where the copies
before it have landed and waits for it before the copies after, and a CUDA graph captures both as host
nodes replayed every step (kt-kernel keeps each task's and each sync's arguments for the process). On the
CPU they are its plain `submit` / `sync`, in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dsv4serve.experts.kt_backend import KT_MAX_TOKENS, KtGeometry, KtThreads, e8m0_as_bf16, load_kt

# bank part -> kt-kernel's name (w1 is the gate projection, w3 the up projection, w2 the down one)
_KT_PARTS = {"w1": "gate", "w3": "up", "w2": "down"}


class KtJob:
    """A forward submitted to kt-kernel: its inputs stay referenced until `wait` (kt reads them by pointer)."""

    def __init__(self, infer, out: torch.Tensor, keep: tuple[torch.Tensor, ...]):
        self._infer, self.out, self._keep = infer, out, keep
        self._done = False

    def wait(self) -> torch.Tensor:
        """The experts' weighted sum [T, D] bf16 (on the CPU)."""
        if not self._done:
            self._infer.sync()
            self._done, self._keep = True, ()
        return self.out


@dataclass(frozen=True)
class KtStreamBuffers:
    """A stream forward's host side: x [R, D] bf16, ids [R, k] int64, weights [R, k] fp32 in; out [R, D] bf16;
    n [1] int32 the rows kt-kernel computes (R)."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor
    n: torch.Tensor


class KtExperts:
    def __init__(
        self,
        layer_parts: Mapping[int, Mapping[str, torch.Tensor]],
        geometry: KtGeometry,
        threads: KtThreads,
        max_tokens: int = KT_MAX_TOKENS,
    ):
        """`layer_parts`: per MoE layer the bank's stacked tensors (`w1` int8 [E, I, D/2], `w1_scale` uint8
        [E, I, D/32], ... as experts/bank.py holds them), read once here and then no longer needed."""
        geometry.check()
        self.ext, self.variant = load_kt()
        self.geometry, self.threads, self.max_tokens = geometry, threads, max_tokens
        pool = self.ext.WorkerPoolConfig()
        pool.subpool_count = len(threads.numa_nodes)
        pool.subpool_numa_map = list(threads.numa_nodes)
        pool.subpool_thread_count = list(threads.threads)
        self.infer = self.ext.CPUInfer(pool)
        self.layers = sorted(layer_parts)
        # the GPU-expert masks kt-kernel reads live at each forward: [L, E] bool, one row per layer
        self.masks = torch.zeros((len(self.layers), geometry.n_experts), dtype=torch.bool)
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        self._moes = {layer: self._load(layer, layer_parts[layer]) for layer in self.layers}
        self._stream_tasks: dict[tuple[int, int], tuple[object, KtStreamBuffers]] = {}  # kept: kt reads them

    def _load(self, layer: int, parts: Mapping[str, torch.Tensor]):
        g = self.geometry
        mask = self.masks[self._row[layer]]
        cfg = self.ext.moe.MOEConfig(g.n_experts, g.topk, g.dim, g.inter_dim, mask.data_ptr())
        cfg.layer_idx, cfg.pool, cfg.max_len, cfg.swiglu_limit = (
            layer,
            self.infer.backend_,
            self.max_tokens,
            g.swiglu_limit,
        )
        held = []  # what kt-kernel reads by pointer until its load task has run
        for part, name in _KT_PARTS.items():
            codes = parts[part].contiguous()
            scales = e8m0_as_bf16(parts[f"{part}_scale"])
            held += [codes, scales]
            setattr(cfg, f"{name}_projs", [[codes[e].data_ptr() for e in range(g.n_experts)]])
            setattr(cfg, f"{name}_scales", [[scales[e].data_ptr() for e in range(g.n_experts)]])
        cfg.quant_config.bits, cfg.quant_config.group_size, cfg.quant_config.zero_point = 4, 32, False
        moe = self._backend_class()(cfg)
        identity = torch.arange(g.n_experts, dtype=torch.int64)  # physical expert -> logical expert
        self.infer.submit(moe.load_weights_task(identity.data_ptr()))
        self.infer.sync()
        return moe

    def _backend_class(self):
        """The MXFP4 MoE of this build: the AMX / AVX-512 one where compiled in, else AVX2 (as kt-kernel picks)."""
        moe = self.ext.moe
        cls = getattr(moe, "AMXFP4_KGroup_MOE", None) or getattr(moe, "AVX2MXFP4_MOE", None)
        if cls is None:
            raise RuntimeError(f"kt-kernel build {self.variant} has no MXFP4 MoE")
        return cls

    def holds(self, layer: int) -> bool:
        return layer in self._row

    @property
    def describe(self) -> str:
        return f"kt-kernel {self.variant} build, {self.threads.describe()}, {len(self.layers)} MoE layers"

    def submit(
        self,
        layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        on_device: torch.Tensor | None = None,
    ) -> KtJob:
        """Start the routed experts of x [T, D] (ids [T, k] int64, -1 skipped; weights [T, k] fp32) that are
        not marked in on_device [E] bool. Returns at once; the work runs on kt-kernel's threads."""
        row = self._row[layer]
        self.masks[row] = False if on_device is None else on_device.to("cpu", torch.bool)
        x = x.to("cpu", torch.bfloat16).contiguous()
        ids = ids.to("cpu", torch.int64).contiguous()
        weights = weights.to("cpu", torch.float32).contiguous()
        out = torch.empty_like(x)
        moe, keep = self._moes[layer], [x, ids, weights, out]
        for start in range(0, x.shape[0], self.max_tokens):  # kt-kernel's buffers hold max_tokens rows
            stop = min(start + self.max_tokens, x.shape[0])
            n = torch.tensor([stop - start], dtype=torch.int32)
            keep.append(n)
            task = moe.forward_task(
                n.data_ptr(),
                ids.shape[1],
                ids[start].data_ptr(),
                weights[start].data_ptr(),
                x[start].data_ptr(),
                out[start].data_ptr(),
                False,  # not incremental: nothing deferred from another layer
            )
            self.infer.submit(task)
        return KtJob(self.infer, out, tuple(keep))

    def set_mask(self, layer: int, on_device: torch.Tensor) -> None:
        """The experts of `layer` kt-kernel skips (computed on the device), [E] bool, read at its next forward."""
        self.masks[self._row[layer]] = on_device.to("cpu", torch.bool)

    def stream_buffers(self, rows: int, device: torch.device) -> KtStreamBuffers:
        """Host buffers for a `rows`-token forward whose inputs the device copies in (pinned on CUDA)."""
        if rows > self.max_tokens:
            raise ValueError(f"{rows} rows exceed kt-kernel's {self.max_tokens}-token buffers")
        g, pin = self.geometry, device.type == "cuda"

        def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            t = torch.zeros(shape, dtype=dtype)
            return t.pin_memory() if pin else t

        n = make((1,), torch.int32)
        n[0] = rows
        return KtStreamBuffers(
            make((rows, g.dim), torch.bfloat16),
            make((rows, g.topk), torch.int64),
            make((rows, g.topk), torch.float32),
            make((rows, g.dim), torch.bfloat16),
            n,
        )

    def stream_task(self, layer: int, bufs: KtStreamBuffers):
        """`layer`'s forward over `bufs`, built once (kt-kernel reads every input through its pointer when the
        task runs, the mask of `set_mask` included): run it with `run_on_stream` as often as needed."""
        key = (layer, bufs.x.data_ptr())
        if key not in self._stream_tasks:
            b = bufs
            self._stream_tasks[key] = (
                self._moes[layer].forward_task(
                    b.n.data_ptr(), b.ids.shape[1], b.ids.data_ptr(), b.weights.data_ptr(), b.x.data_ptr(),
                    b.out.data_ptr(), False,
                ),
                b,
            )  # fmt: skip
        return self._stream_tasks[key][0]

    def run_on_stream(self, task, device: torch.device) -> None:
        if device.type == "cuda":
            self.infer.submit_with_cuda_stream(torch.cuda.current_stream(device).cuda_stream, task)
        else:
            self.infer.submit(task)

    def wait_on_stream(self, device: torch.device) -> None:
        if device.type == "cuda":
            self.infer.sync_with_cuda_stream(torch.cuda.current_stream(device).cuda_stream)
        else:
            self.infer.sync()

    def forward(self, layer, x, ids, weights, on_device=None) -> torch.Tensor:
        return self.submit(layer, x, ids, weights, on_device).wait()
