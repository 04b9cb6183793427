"""The CPU torch path's loops compiled by numba (model/sinkhorn_cpu.py, hadamard_cpu.py, moe_cpu.py, ...): one
way to compile them, with numba's on-disk cache, once per process, and to stand down where numba cannot.

`compile_loop` compiles a plain-Python loop function without fast-math (the IEEE operations as written: every
loop here is held bit for bit to a torch reference) and runs it once on sample arguments so that the compile (or
the cache load) happens now. Where numba is missing or cannot compile, it logs the reason once, records it for
`dsv4serve doctor` (`failure`), and returns None: the caller's torch ops serve instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_failures: dict[str, str] = {}  # what -> why it did not compile


def compile_loop(
    fn: Callable[..., None],
    sample: tuple[Any, ...],
    what: str,
    instead: str,
    helpers: tuple[Callable[..., Any], ...] = (),
) -> Callable[..., None] | None:
    """fn compiled (numba.njit, cached on disk, GIL released) and run once on `sample`; None where it fails (logged:
    `what` did not compile, `instead` serves). `helpers`: the plain functions fn calls (and those they call, listed
    first), each bound to its own name in fn's module: compiled first and put in that name's place there (numba
    resolves fn's calls in fn's module)."""
    try:
        import numba  # lazy: ~0.3 s to import, and only the CPU's torch path needs it

        for helper in helpers:
            bound = fn.__globals__.get(helper.__name__)
            if bound is not helper and getattr(bound, "py_func", None) is not helper:
                raise ValueError(f"{helper.__name__} is not what {fn.__module__} calls by that name")
            if bound is helper:  # not compiled yet in this process
                fn.__globals__[helper.__name__] = _jit(numba, helper)
        loop = _jit(numba, fn)
        loop(*sample)
    except Exception as exc:  # numba missing or failing on this machine: the caller's torch ops serve, slower
        log.warning("numba cannot compile the CPU's %s (%s); %s", what, record_failure(what, exc), instead)
        return None
    _failures.pop(what, None)
    return loop


def _jit(numba: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn compiled lazily: cached on disk, the GIL released, no bounds checks, IEEE division (x / 0 is inf or NaN, as
    in torch; numba's default raises ZeroDivisionError and checks every divisor). numba's disk cache (files beside
    each module in __pycache__) is keyed by the source file's stamp, not by these options: after changing them,
    delete those files."""
    return numba.njit(fn, cache=True, nogil=True, boundscheck=False, error_model="numpy")


def record_failure(what: str, exc: BaseException) -> str:
    """Note why `what` did not compile (for `failure` and doctor) and return that reason; also the bf16 head's
    kernels, which llvmlite compiles (model/head_bf16_cpu.py)."""
    _failures[what] = f"{type(exc).__name__}: {exc}"
    return _failures[what]


def failure(what: str) -> str | None:
    """Why `what` did not compile in this process (None: it compiled, or was not tried)."""
    return _failures.get(what)
