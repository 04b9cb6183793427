"""Kernel tests run the Triton kernels in the interpreter, on CPU tensors.

TRITON_INTERPRET is read when @triton.jit decorates a function (triton.knobs.runtime.interpret), so
it must be set before any dsv4_kernels kernel module is imported; importing triton itself earlier
(another test module, transformers, torch) is harmless. This file is imported when pytest collects
tests/kernels, before the test modules there. The guard below fails loudly if a kernel module was
imported earlier without the interpreter (the kernels would then need a GPU driver).
The compile checks (test_compile.py) build in a child process without the variable.

The variable stays set for the rest of the pytest process (unsetting it after collection would
break the interpreter, which also reads it while running): a test that starts a child process that
must run real kernels on a GPU has to drop TRITON_INTERPRET from the child's environment, as
test_compile.py does.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

from dsv4_kernels.registry import KERNELS

for _name in sorted({spec.kernel.split(":")[0] for spec in KERNELS}):
    _module = sys.modules.get(_name)
    if _module is not None and getattr(_module, "interpreting", lambda: True)() is False:
        raise RuntimeError(
            f"{_name} was imported before tests/kernels/conftest.py set TRITON_INTERPRET=1; "
            "its kernels were built for a GPU. Import kernel modules lazily in other tests."
        )
