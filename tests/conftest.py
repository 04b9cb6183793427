"""Shared fixtures: the built-in dsv4-tiny checkpoint, built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the published DeepSeek-V4-Flash config and tensor list, without weights (tests/data/.../README.md)
REAL_MODEL = REPO / "tests" / "data" / "DeepSeek-V4-Flash"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Once the test modules have set TRITON_INTERPRET (tests/kernels/conftest.py, the census tests): a @triton.jit
    helper's call skips the interpreter's re-patch of triton.language (kernels/dsv4_kernels/interpreter_calls.py),
    also in a process that imported dsv4_kernels before the variable was set. Not earlier: triton.language imported
    before TRITON_INTERPRET=1 leaves tl.sum a compiled-only function that the interpreter cannot call."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from dsv4_kernels.interpreter_calls import install

        install()


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder holding dsv4-tiny; DSV4SERVE_TEST_CACHE reuses one across runs (local dev)."""
    from dsv4serve.tiny.builder import ensure_tiny

    reuse = os.environ.get("DSV4SERVE_TEST_CACHE")
    cache = Path(reuse) if reuse else tmp_path_factory.mktemp("dsv4serve-cache")
    ensure_tiny(cache)
    return cache


@pytest.fixture(scope="session")
def tiny_split_dir(tiny_cache: Path) -> Path:
    """dsv4-tiny-split (tiny/spec.TINY_SPLIT_CONFIG): dsv4-tiny widened so that 2 or 4 tensor-parallel ranks split it."""
    from dsv4serve.tiny.builder import ensure_tiny

    return ensure_tiny(tiny_cache, split=True)


@pytest.fixture(scope="session")
def tiny_dir(tiny_cache: Path) -> Path:
    from dsv4serve.tiny.builder import tiny_folder

    return tiny_folder(tiny_cache)


@pytest.fixture(scope="module")
def tiny_mtp(tiny_dir: Path):
    """dsv4-tiny's dense model with its MTP block (the speculative-decoding tests), one per test module: tests
    attach drafters and pools to it. One torch thread, as the engine's CPU worker runs."""
    import torch

    from dsv4serve.checkpoint.loader import load_dense_state_dict
    from dsv4serve.model.transformer import Transformer

    torch.set_num_threads(1)
    args, state = load_dense_state_dict(tiny_dir)
    model = Transformer(args).eval()
    model.load_state_dict(state, strict=True)
    return model


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    if not (REAL_MODEL / "config.json").is_file():
        pytest.fail(
            f"{REAL_MODEL} is missing: the real DeepSeek-V4-Flash config and tensor list are part of the "
            "repository (tests/data/DeepSeek-V4-Flash); restore them from git"
        )
    return REAL_MODEL
