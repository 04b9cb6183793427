"""Triton kernels for DeepSeek-V4, each beside its torch reference.

Imported as `dsv4_kernels` (the folder `kernels/` has no `__init__.py` of its own), so the PyPI
package `kernels`, which transformers probes for, is neither shadowed nor shadows this one.
"""

import os as _os

if _os.environ.get("TRITON_INTERPRET") == "1":  # the CPU's interpreter: helpers called without re-patching
    from dsv4_kernels.interpreter_calls import install as _install

    _install()
