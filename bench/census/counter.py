"""Counting what a step would do on a GPU, on the CPU: device kernel launches and host-device syncs.

    with StepCounter(locate) as seen:
        step()
    seen.launches, seen.syncs, seen.host_tensors, fingerprint(seen)

Launches (each one `Launch`):
- every aten op that reaches the dispatcher (a TorchDispatchMode sees them) and would run a device
  kernel. Not counted, because they launch none: the ops of NO_KERNEL (views, metadata, allocations
  without a fill, the CPU-side half of `torch.tensor`, a host read), and any op whose outputs all share
  storage with its inputs and that is not in place (a `reshape` / `contiguous` / `to` that turned out
  to be a view or a no-op: composite ops reach the mode unexpanded under inference mode). An in-place
  op (`add_`, `copy_`, `index_put_`) always counts. A copy between host and device counts as one.
- every Triton kernel launch: `kernel[grid](...)` ends in `InterpretedFunction.run` (interpreter) or
  `JITFunction.run` (GPU), wrapped here; the grid and the tensor arguments' shapes are recorded. The
  interpreter's own torch work inside the launch (host copies of the arguments) is not counted.

Host-device syncs (each one `Sync`, with the file:line that caused it), the ops that make a GPU host
wait for the device:
- a scalar read: aten `item` / `_local_scalar_dense` (item(), int(t), float(t)), `is_nonzero` (bool(t),
  `if t:`), `equal`; `Tensor.tolist` (patched: on the CPU it bypasses the dispatcher);
- an output whose size depends on the data: `nonzero`, one-argument `where`, `argwhere`,
  `masked_select`, `bincount`, `unique` and its variants, `repeat_interleave` with tensor repeats and
  no output_size, and aten `index` / `index_put(_)` with a boolean index (a boolean mask is a nonzero);
- a device tensor built from host data: `torch.tensor(data, device=...)` / `torch.as_tensor(data,
  device=...)` of Python lists, scalars or numpy arrays (patched; a blocking pageable host-to-device copy
  on a GPU). The same calls without a device argument, or with the string "cpu" (a host buffer by
  intent: the census's own device is a torch.device("cpu"), as a worker's is torch.device("cuda")),
  build a host tensor, which is no sync by itself: they are listed apart (`host_tensors`), as the copy
  that may follow is invisible on the CPU.
A locator may place an op on host-side tensors (component HOST, e.g. the expert-slot cache's
bookkeeping): it is then neither a launch nor a sync, only counted (`host_ops`).
Not counted either: the cast of `dsv4_kernels.outputs.as_gpu_stored`, by which a kernel wrapper turns the fp32
the interpreter stores into the bf16 a GPU kernel stores (a no-op on a GPU); `interpreter_casts` lists them.
Not visible on the CPU: `.to(device)` / `.cpu()` of a tensor (both devices are the CPU, so nothing is
copied or dispatched) and waits on CUDA events or streams (the CPU paths skip them).
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

REPO = Path(__file__).resolve().parents[2]
PROJECT_ROOTS = (str(REPO / "dsv4serve") + "/", str(REPO / "kernels") + "/")

NO_KERNEL = {
    # views and metadata
    "view", "_unsafe_view", "as_strided", "t", "transpose", "expand", "unsqueeze", "squeeze", "slice",
    "select", "permute", "alias", "detach", "detach_", "_reshape_alias", "unflatten", "split",
    "split_with_sizes", "unbind", "chunk", "narrow", "view_as", "expand_as", "movedim", "diagonal",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "resolve_conj", "resolve_neg",
    # allocations without a fill, and resizes
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resize_", "set_",
    # torch.tensor(...)'s host tensor (the host-to-device copy is counted as a sync by the factory patch)
    "lift_fresh", "lift_fresh_copy",
    # host reads: a device-to-host copy, counted as a sync
    "item", "_local_scalar_dense", "is_nonzero",
}  # fmt: skip
SCALAR_READS = {"item", "_local_scalar_dense", "is_nonzero", "equal", "allclose"}
DATA_SIZED = {"nonzero", "nonzero_static", "argwhere", "masked_select", "bincount", "unique", "_unique",
              "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive"}  # fmt: skip
BOOL_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_"}

HOST = "host"  # a locator's component for an op on host-side tensors: counted apart, not as a launch
Locate = Callable[[FrameType], tuple[str, int | None, str]]  # frame -> (file:line, layer, component)


@dataclass(frozen=True)
class Launch:
    kind: str  # "aten" | "triton"
    name: str  # aten op (overload packet) or Triton kernel name
    site: str  # file:line of the first project frame ("?" when none)
    layer: int | None  # the transformer layer, None outside the layers
    component: str
    signature: tuple  # (name, ((shape, dtype), ...), grid): the fingerprint entry
    scalars: tuple = ()  # a Triton launch's non-tensor arguments (a CUDA graph bakes them in)


@dataclass(frozen=True)
class Sync:
    what: str
    site: str
    layer: int | None
    component: str


@dataclass
class Seen:
    launches: list[Launch] = field(default_factory=list)
    syncs: list[Sync] = field(default_factory=list)
    host_tensors: list[str] = field(default_factory=list)  # sites of torch.tensor(...) without a device
    host_ops: list[str] = field(default_factory=list)  # sites of aten ops the locator placed on the host (HOST)
    interpreter_casts: list[str] = field(default_factory=list)  # as_gpu_stored's casts: the callers' sites

    def count(self, kind: str | None = None) -> int:
        return sum(1 for launch in self.launches if kind is None or launch.kind == kind)


def project_frame(frame: FrameType | None, roots: tuple[str, ...]) -> FrameType | None:
    """The innermost frame (from `frame` outwards) whose file lies under one of `roots`."""
    while frame is not None and not frame.f_code.co_filename.startswith(roots):
        frame = frame.f_back
    return frame


def site_of(frame: FrameType | None) -> str:
    if frame is None:
        return "?"
    path = Path(frame.f_code.co_filename)
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
    return f"{shown}:{frame.f_lineno}"


def file_locator(roots: tuple[str, ...] = PROJECT_ROOTS) -> Locate:
    """Sites only: every event is in no layer and component "other"."""
    return lambda frame: (site_of(project_frame(frame, roots)), None, "other")


def _shapes(values) -> tuple:
    return tuple((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in values if isinstance(t, torch.Tensor))


def _sync_reason(name: str, args: tuple, kwargs: dict) -> str | None:
    if name in SCALAR_READS or name in DATA_SIZED:
        return "item" if name == "_local_scalar_dense" else name  # item's decomposition outside inference mode
    if name == "where" and len(args) == 1:
        return "where(cond)"
    if name == "repeat_interleave" and kwargs.get("output_size") is None:
        repeats = args[1] if len(args) > 1 else args[0]  # overloads (repeats) and (self, repeats, dim)
        if isinstance(repeats, torch.Tensor):
            return "repeat_interleave without output_size"
    indices = args[1] if name in BOOL_INDEXED and len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
        return f"{name} with a boolean mask"
    return None


def _launches_kernel(name: str, args: tuple, kwargs: dict, out) -> bool:
    if name in NO_KERNEL:
        return False
    if name.endswith("_") or "out" in kwargs:
        return True  # in place: writes its input
    inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
    outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return not outputs or any(t.untyped_storage().data_ptr() not in inputs for t in outputs)


def _interpreter_cast(frame: FrameType | None) -> FrameType | None:
    """The frame of `as_gpu_stored` (module doc) when it issued the op: among the few innermost frames."""
    from dsv4_kernels.outputs import as_gpu_stored

    for _ in range(4):  # torch's frames between Tensor.to and the dispatch mode, then the caller of Tensor.to
        if frame is None or frame.f_code is as_gpu_stored.__code__:
            return frame
        frame = frame.f_back
    return None


class _Mode(TorchDispatchMode):
    def __init__(self, counter: StepCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.counter
        if c.paused:
            return out
        name = func.overloadpacket.__name__
        reason = _sync_reason(name, args, kwargs)
        frame = sys._getframe(1)
        if reason is not None:
            c.sync(reason, frame)
        if _launches_kernel(name, args, kwargs, out):
            cast = _interpreter_cast(frame)
            if cast is not None:
                c.seen.interpreter_casts.append(site_of(project_frame(cast.f_back, c.roots)))
                return out
            site, layer, component = c.locate(frame)
            if component == HOST:
                c.seen.host_ops.append(site)
            else:
                signature = (name, _shapes(tree_leaves((args, kwargs))), None)
                c.seen.launches.append(Launch("aten", name, site, layer, component, signature))
        return out


def _triton_runners() -> list[type]:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return [InterpretedFunction, JITFunction]


class StepCounter:
    """A context that records every launch and sync (module doc) until it exits. `locate` turns the
    frame of an event into (file:line, layer, component); the default gives sites only."""

    def __init__(self, locate: Locate | None = None, roots: tuple[str, ...] = PROJECT_ROOTS):
        self.roots = roots
        self.locate: Locate = locate or file_locator(roots)
        self.seen = Seen()
        self.paused = False
        self._patches: list = []
        self._mode = _Mode(self)

    def sync(self, what: str, frame: FrameType) -> None:
        site, layer, component = self.locate(frame)
        if component == HOST:  # a read of a host tensor: no device involved
            self.seen.host_ops.append(site)
        else:
            self.seen.syncs.append(Sync(what, site, layer, component))

    def __enter__(self) -> Seen:
        self._patches = [mock.patch.object(cls, "run", self._triton_run(cls.run)) for cls in _triton_runners()]
        self._patches.append(mock.patch.object(torch.Tensor, "tolist", self._host_read(torch.Tensor.tolist)))
        for name in ("tensor", "as_tensor"):
            self._patches.append(mock.patch.object(torch, name, self._factory(getattr(torch, name), name)))
        for p in self._patches:
            p.start()
        self._mode.__enter__()
        return self.seen

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for p in reversed(self._patches):
            p.stop()

    def _triton_run(self, real: Callable) -> Callable:
        counter = self

        def run(fn, *args, grid, warmup, **kwargs):
            if warmup or counter.paused:
                return real(fn, *args, grid=grid, warmup=warmup, **kwargs)
            frame = sys._getframe(1)
            name = getattr(fn, "__name__", type(fn).__name__)
            bound = _bound(fn, args, kwargs)
            if callable(grid):
                grid = grid(bound)
            grid = tuple(int(g) for g in grid)
            site, layer, component = counter.locate(frame)
            tensors = [v for v in bound.values() if isinstance(v, torch.Tensor)]
            scalars = tuple((k, v) for k, v in bound.items() if isinstance(v, (int, float)) and k not in kwargs)
            launch = Launch("triton", name, site, layer, component, (name, _shapes(tensors), grid), scalars)
            counter.seen.launches.append(launch)
            counter.paused = True  # the interpreter's own host copies of the arguments are no launches
            try:
                return real(fn, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                counter.paused = False

        return run

    def _host_read(self, real: Callable) -> Callable:
        counter = self

        def tolist(t, *args, **kwargs):
            if not counter.paused:
                counter.sync("tolist", sys._getframe(1))
            return real(t, *args, **kwargs)

        return tolist

    def _factory(self, real: Callable, name: str) -> Callable:
        counter = self

        def factory(data, *args, **kwargs):
            if not counter.paused and not isinstance(data, torch.Tensor):
                frame = sys._getframe(1)
                device = kwargs.get("device", args[1] if name == "as_tensor" and len(args) > 1 else None)
                if device is not None and device != "cpu":  # "cpu" spelled out: a host buffer by intent
                    counter.sync(f"torch.{name}(host data, device=)", frame)
                else:
                    counter.seen.host_tensors.append(site_of(project_frame(frame, counter.roots)))
            return real(data, *args, **kwargs)

        return factory


def _bound(fn, args: tuple, kwargs: dict) -> dict:
    """A Triton launch's arguments by parameter name (the jitted Python function's signature)."""
    try:
        params = inspect.signature(fn.fn).parameters
    except (AttributeError, TypeError, ValueError):
        return dict(enumerate(args))
    bound = dict(zip(params, args))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    return bound


def fingerprint(seen: Seen) -> tuple[list[tuple], str]:
    """The step's op sequence [(op, input shapes / dtypes, Triton grid), ...] and its hash (16 hex)."""
    entries = [launch.signature for launch in seen.launches]
    return entries, hashlib.sha256(repr(entries).encode()).hexdigest()[:16]
