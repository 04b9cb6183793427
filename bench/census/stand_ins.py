"""Torch stand-ins for Triton kernels that the interpreter runs too slowly to census a step in minutes.

    with stand_ins(("head_logits_kernel",)):
        step()        # head_logits_kernel launches still happen (and are counted), torch computes them

The interpreter costs about 1-2 ms per program instance and op; the head's [vocab, M] grid is 1,010
programs at dsv4-tiny's real vocabulary (129,280): ~40 s of a ~47 s decode step. Its stand-in computes
the kernel's contract (fp32 logits = y @ w^T, the bf16 weight as stored, dsv4_kernels/head_logits.py)
with one torch matmul from the launch's own arguments, so the launch, its grid and its arguments are
what the step issued. A counter sees the launch (it wraps the launch, this patch the execution below
it) and pauses its own counting during the stand-in's torch work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest import mock

import torch


def _head_logits(a: dict) -> None:
    """head_logits_kernel(y_ptr [M, K] fp32, w_ptr [V, K] bf16, out_ptr [M, V] fp32, M, V, K, strides...)."""
    m, v = a["M"], a["V"]
    out = torch.as_strided(a["out_ptr"], (m, v), (a["stride_om"], 1))
    out.copy_(a["y_ptr"][:m].float() @ a["w_ptr"][:v].float().T)


STAND_INS: dict[str, tuple[Callable[[dict], None], tuple[str, ...]]] = {
    # kernel name -> (stand-in, the parameters it reads: checked against the kernel's signature)
    "head_logits_kernel": (_head_logits, ("y_ptr", "w_ptr", "out_ptr", "M", "V", "stride_om")),
}


@contextmanager
def stand_ins(names: tuple[str, ...] = tuple(STAND_INS)) -> Iterator[None]:
    """Run the named kernels' launches as their torch stand-ins (interpreter only; a GPU runs them). The
    patch is on the interpreter's grid executor, below the launch a counter wraps, so the two nest in any
    order."""
    from triton.runtime.interpreter import GridExecutor

    real = GridExecutor.__call__

    def execute(executor, *args, **kwargs):
        name = executor.fn.__name__
        if name not in names or name not in STAND_INS:
            return real(executor, *args, **kwargs)
        stand_in, needs = STAND_INS[name]
        params = list(executor.arg_names)
        missing = [n for n in needs if n not in params]
        if missing:
            raise RuntimeError(f"{name}'s signature changed (no {missing}): update bench/census/stand_ins.py")
        bound = dict(zip(params, args))
        bound.update({k: v for k, v in kwargs.items() if k in params})
        stand_in(bound)

    with mock.patch.object(GridExecutor, "__call__", execute):
        yield
