"""Triton kernels for DeepSeek-V4, each beside its torch reference.

Imported as `dsv4_kernels` (the folder `kernels/` has no `__init__.py` of its own), so the PyPI
package `kernels`, which transformers probes for, is neither shadowed nor shadows this one.
"""
