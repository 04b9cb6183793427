"""dsv4_kernels.interpreter_calls: inside a launch, a @triton.jit helper's call (ours, or triton.language's own, such
as tl.sum, which reaches the builtins through triton.language.core) does not re-patch triton.language; the launch
patches tl and tl.core once and undoes both when it ends, also when a program raises."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as interp

from dsv4_kernels.interpreter_calls import install


@triton.jit
def _twice(x):
    return x + x


@triton.jit
def _helpers_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    for _ in tl.static_range(4):
        x = _twice(x)  # our helper, 4 calls a program
    tl.store(out_ptr + offs, x + tl.sum(x, axis=0))  # and triton.language's own


@triton.jit
def _failing_kernel(x_ptr, BLOCK: tl.constexpr):
    x = _twice(tl.load(x_ptr + tl.arange(0, BLOCK)))
    tl.store(x_ptr + tl.arange(0, BLOCK), x + tl.sum(x, axis=0))
    tl.static_assert(BLOCK < 0, "the test's program fails")  # raised as the program runs, after both helpers


def _patches_made(monkeypatch: pytest.MonkeyPatch, programs: int) -> tuple[int, torch.Tensor]:
    """(the interpreter's module patches during one launch of `programs` programs, its output)."""
    seen = []
    real = interp._patch_builtin
    monkeypatch.setattr(interp, "_patch_builtin", lambda pkg, *a: (seen.append(pkg), real(pkg, *a))[1])
    x = torch.arange(programs * 8, dtype=torch.float32)
    out = torch.empty_like(x)
    _helpers_kernel[(programs,)](x, out, BLOCK=8)
    monkeypatch.undo()
    return len(seen), out


def test_installed_and_helpers_do_not_repatch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert install() and install()  # the root conftest installed it; a second call changes nothing
    one, out_one = _patches_made(monkeypatch, 1)
    eight, out_eight = _patches_made(monkeypatch, 8)
    assert one == eight > 0, (one, eight)  # the launch's own patches only: none for 5 helper calls a program
    x = torch.arange(64, dtype=torch.float32)
    want = 16 * x + (16 * x).view(8, 8).sum(1).repeat_interleave(8)
    assert torch.equal(out_eight, want) and torch.equal(out_one, want[:8])


def test_a_launch_leaves_triton_language_as_it_found_it() -> None:
    before = (tl.load, tl.core.load, tl.sum, tl.core.tensor.__add__)
    x = torch.ones(8)
    _helpers_kernel[(1,)](x, torch.empty_like(x), BLOCK=8)
    assert (tl.load, tl.core.load, tl.sum, tl.core.tensor.__add__) == before
    with pytest.raises(Exception, match="fails"):
        _failing_kernel[(1,)](x.clone(), BLOCK=8)
    assert (tl.load, tl.core.load, tl.sum, tl.core.tensor.__add__) == before
    out = torch.empty_like(x)
    _helpers_kernel[(1,)](x, out, BLOCK=8)  # a launch after a failed one runs as before
    assert torch.equal(out, torch.full((8,), 16.0 + 128.0))
