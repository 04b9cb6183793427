"""Test support: counting what code would launch on a GPU, and refusing host syncs, on the CPU.

    with launch_guard(forbid_syncs=True) as seen:
        fn()
    seen.aten_launches, seen.triton_launches   # counts; a sync raises HostSync

aten ops are seen through a TorchDispatchMode: each op counts as one device kernel launch except the
ones that launch none (views, reshapes, allocations without a fill: VIEW_OPS; an op that returns its
input, such as `to` its own dtype). Triton launches are
seen at the interpreter's launch (`InterpretedFunction.run`), whose own torch work is not counted.
Host syncs (with forbid_syncs they raise): aten `_local_scalar_dense` / `item` (item(), int(t), bool(t);
inference mode shows the latter; a device-to-host copy, not counted as a launch),
`nonzero`, `bincount`, `unique` variants, `masked_select`, an index with a boolean mask, and
`Tensor.tolist` / `Tensor.item` (patched: on the CPU tolist bypasses the dispatcher).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import InterpretedFunction

VIEW_OPS = {
    "view", "_unsafe_view", "as_strided", "t", "transpose", "expand", "unsqueeze", "squeeze", "slice",
    "select", "permute", "alias", "detach", "_reshape_alias", "reshape", "flatten", "unflatten",
    "empty", "empty_strided", "empty_like", "split", "unbind", "view_as", "lift_fresh", "_to_copy_noop",
}  # fmt: skip
SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "bincount", "unique", "_unique", "_unique2", "unique_consecutive",
            "unique_dim", "masked_select", "repeat_interleave"}  # fmt: skip


class HostSync(AssertionError):
    pass


@dataclass
class Seen:
    aten: Counter = field(default_factory=Counter)
    triton: Counter = field(default_factory=Counter)
    syncs: list[str] = field(default_factory=list)

    @property
    def aten_launches(self) -> int:
        return sum(self.aten.values())

    @property
    def triton_launches(self) -> int:
        return sum(self.triton.values())


class _Mode(TorchDispatchMode):
    def __init__(self, seen: Seen, forbid: bool):
        super().__init__()
        self.seen, self.forbid, self.paused = seen, forbid, False

    def sync(self, what: str) -> None:
        self.seen.syncs.append(what)
        if self.forbid:
            raise HostSync(f"host sync: {what}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            name = func.overloadpacket.__name__
            bool_index = name.startswith("index") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool
                for a in args
                if isinstance(a, (list, tuple))
                for i in a
            )
            if name in SYNC_OPS or bool_index:
                self.sync(name)
            out = func(*args, **kwargs)
            if (
                name not in VIEW_OPS
                and name not in ("_local_scalar_dense", "item")
                and not _returns_input(func, args, out)
            ):
                self.seen.aten[name] += 1
            return out
        return func(*args, **kwargs)


def _returns_input(func, args, out) -> bool:
    """True for an op that handed back its input unchanged (`to` the same dtype, `contiguous` of a
    contiguous tensor): no kernel ran. An in-place or out= op (`add_`, `copy_`, `index_put_`) also returns
    its input, and does launch a kernel: its schema marks the argument it writes."""
    if not (bool(args) and isinstance(args[0], torch.Tensor) and out is args[0]):
        return False
    schema = getattr(func, "_schema", None)
    writes = schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    return not writes


@contextmanager
def launch_guard(forbid_syncs: bool = True):
    seen = Seen()
    mode = _Mode(seen, forbid_syncs)
    real_run, real_tolist, real_item = InterpretedFunction.run, torch.Tensor.tolist, torch.Tensor.item

    def run(self, *args, **kwargs):
        seen.triton[self.__name__] += 1
        mode.paused, was = True, mode.paused
        try:
            return real_run(self, *args, **kwargs)
        finally:
            mode.paused = was

    def host_read(real, what):
        def read(t, *a, **k):
            if not mode.paused:
                mode.sync(what)
            return real(t, *a, **k)

        return read

    with (
        mock.patch.object(InterpretedFunction, "run", run),
        mock.patch.object(torch.Tensor, "tolist", host_read(real_tolist, "tolist")),
        mock.patch.object(torch.Tensor, "item", host_read(real_item, "item")),
        mode,
    ):
        yield seen
