"""The kernel table is complete: every registered kernel resolves to a Triton kernel with a torch
reference and a test file that exercises it, and every Triton kernel in dsv4_kernels is registered."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import triton

import dsv4_kernels
from dsv4_kernels.registry import KERNELS, KERNELS_BY_NAME

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(dsv4_kernels.__file__).resolve().parent


def _jit_functions(path: Path) -> list[str]:
    """Names of the top-level functions decorated with triton.jit in a module's source."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if ast.unparse(target) in ("triton.jit", "jit"):
                    names.append(node.name)
    return names


def test_table_is_not_empty_and_names_are_unique() -> None:
    assert KERNELS
    assert len(KERNELS_BY_NAME) == len(KERNELS)


@pytest.mark.parametrize("spec", KERNELS, ids=lambda s: s.name)
def test_kernel_has_reference_test_and_compile_configs(spec) -> None:
    kernel = spec.load_kernel()
    assert isinstance(kernel, (triton.runtime.JITFunction, triton.runtime.interpreter.InterpretedFunction))
    references = spec.load_references()
    assert references and all(callable(ref) for ref in references)
    for ref in references:  # a reference is torch code, never a Triton kernel
        assert not isinstance(ref, (triton.runtime.JITFunction, triton.runtime.interpreter.InterpretedFunction))
        assert ref.__module__.endswith("_ref"), f"{ref.__name__} should live in a *_ref module"
    test_file = REPO / spec.test_module
    assert test_file.is_file(), f"{spec.name}: missing test file {spec.test_module}"
    source = test_file.read_text()
    # the test must call the kernel's wrapper module and every reference it is checked against
    module = spec.kernel.split(":")[0]
    assert f"from {module} import" in source, f"{spec.test_module} does not import {module}"
    for ref in spec.references:
        assert ref.split(":")[1] in source, f"{spec.test_module} never uses the reference {ref}"
    configs = spec.load_compile_configs()
    assert configs and all(set(sig) == set(kernel.arg_names) for _, sig, _ in configs)


def test_every_triton_kernel_is_registered() -> None:
    registered = {spec.kernel for spec in KERNELS}
    for path in sorted(PACKAGE.glob("*.py")):
        for name in _jit_functions(path):
            if name.startswith("_"):  # @triton.jit helpers inlined into a registered kernel
                continue
            assert f"dsv4_kernels.{path.stem}:{name}" in registered, f"{path.name}:{name} is not in KERNELS"
