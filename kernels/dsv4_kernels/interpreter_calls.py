"""Under the Triton interpreter (TRITON_INTERPRET=1, the CPU's way to run these kernels): a @triton.jit helper
called from a kernel costs what its body costs, not ~0.2 ms of re-patching triton.language first.

Triton's interpreter (3.6 / 3.7, `triton.runtime.interpreter`) patches triton.language's builtins to its numpy
semantics when a kernel launch starts (`GridExecutor.__call__` -> `_patch_lang`, undone when the launch ends), and
again at EVERY call of a device function (`InterpretedFunction.__call__` -> `_patch_lang`): `inspect.getmembers`
over tl, tl.tensor and tl.math, for each `_round_bf16` or `_dequant_e2m1` of each program, and over triton.language.core
for each `tl.sum` or `tl.max` (triton/language/standard.py reaches the builtins through `core`, which a launch of a
kernel that names only `tl` does not patch). That second patch is never undone; once the modules a function sees are
patched it changes nothing (the same modules, the same wrapped members), yet it was ~20% of a whole-model run's
interpreter time (tests/kernels/test_model_kernels.py).

`install()` wraps `_patch_lang`: a launch patches both tl and tl.core up front (undone when it ends, core too, where
the interpreter left core patched after the launch), and a device function's call inside it, which then finds every
module it sees patched, returns a scope that restores nothing, as the discarded one did. Installed by
`dsv4_kernels/__init__.py` when TRITON_INTERPRET=1; a Triton without these internals is left as it is (only slower).
No effect on a GPU build.
"""

from __future__ import annotations

import inspect
import types

_INSTALLED = "_dsv4_device_calls_unpatched"


class _Restored:
    """The scope of a patch that was not made: nothing to restore."""

    def restore(self) -> None:
        pass


def install() -> bool:
    """Wrap the interpreter's `_patch_lang` (module doc); True when installed (now or before)."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    original = getattr(interp, "_patch_lang", None)
    executor = getattr(interp, "GridExecutor", None)
    if original is None or executor is None:
        return False
    if getattr(original, _INSTALLED, False):
        return True
    covered: list[frozenset[int]] = []  # the language modules each launch in progress patched (innermost last)
    launching = [False]  # a GridExecutor call is about to make its own patch
    both = types.FunctionType((lambda: None).__code__, {"tl": tl, "core": tl.core})  # sees tl and tl.core

    def langs(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        if not launching[0] and covered and langs(fn) <= covered[-1]:
            return _Restored()  # a device function inside a launch whose patch is in place
        if not launching[0]:
            return original(fn)
        scope = original(both)  # the launch's own patch, of both modules: covered until its restore
        launching[0] = False
        covered.append(langs(both))
        restore = scope.restore

        def restore_and_uncover() -> None:
            covered.pop()
            restore()

        scope.restore = restore_and_uncover
        return scope

    launch = executor.__call__

    def call(self, *args, **kwargs):
        launching[0] = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            launching[0] = False

    setattr(patch_lang, _INSTALLED, True)
    interp._patch_lang = patch_lang
    executor.__call__ = call
    return True
