"""--moe-backend at worker start-up (worker/model_load.load_model on dsv4-tiny, 3 expert slots): an explicit
hybrid without kt-kernel stops the start with the flag and the reason; auto without it falls back to the
offload path; auto with it computes misses on the CPU. kt-kernel's absence is simulated where it is installed."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from dsv4serve.checkpoint.loader import open_checkpoint
from dsv4serve.experts import moe_backend
from dsv4serve.experts.attach import moe_layers
from dsv4serve.ipc.messages import Sourced, WorkerLaunch
from dsv4serve.model.numerics import NUMERICS_ON
from dsv4serve.worker.model_load import StartupError, load_model

CPU = torch.device("cpu")
NUM = dataclasses.replace(NUMERICS_ON, batch_invariant=False)  # hybrid refuses batch invariance
MISSING = (False, "kt-kernel is not installed (pip install --no-deps kt-kernel==0.7.2 gguf)")


def launch(tiny_dir, backend: Sourced) -> WorkerLaunch:
    one = Sourced(1)
    return WorkerLaunch(
        "", "", str(tiny_dir), "cpu", one, one, Sourced(64), Sourced(None), Sourced(None), Sourced(3, "cli"),
        moe_backend=backend,
    )  # fmt: skip


@pytest.fixture
def ckpt(tiny_dir):
    c = open_checkpoint(tiny_dir)
    yield c
    c.source.close()


def test_explicit_hybrid_without_kt_kernel_stops_the_start(ckpt, tiny_dir, monkeypatch):
    monkeypatch.setattr(moe_backend, "kt_kernel_available", lambda: MISSING)
    with pytest.raises(StartupError, match=r"--moe-backend hybrid needs kt-kernel: kt-kernel is not installed"):
        load_model(ckpt, launch(tiny_dir, Sourced("hybrid", "cli")), NUM, CPU)


def test_auto_without_kt_kernel_is_the_offload_path(ckpt, tiny_dir, monkeypatch):
    monkeypatch.setattr(moe_backend, "kt_kernel_available", lambda: MISSING)
    model, cache, _ = load_model(ckpt, launch(tiny_dir, Sourced("auto")), NUM, CPU)
    assert cache is not None and all(m.cpu_experts is None for m in moe_layers(model))


@pytest.mark.skipif(importlib.util.find_spec("kt_kernel") is None, reason="kt-kernel not installed")
def test_auto_with_kt_kernel_is_hybrid(ckpt, tiny_dir):
    model, cache, _ = load_model(ckpt, launch(tiny_dir, Sourced("auto")), NUM, CPU)
    hybrids = {id(m.cpu_experts) for m in moe_layers(model)}
    assert cache is not None and len(hybrids) == 1 and None not in {m.cpu_experts for m in moe_layers(model)}
