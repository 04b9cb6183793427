"""One home for memory facts: the weights the worker really holds are the bytes `dsv4serve plan` prints,
and whether the MTP block is loaded is decided in one place (memory/weights.include_mtp)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from dsv4serve.checkpoint.loader import open_checkpoint
from dsv4serve.ipc.messages import Sourced, WorkerLaunch
from dsv4serve.memory.weights import include_mtp
from dsv4serve.model.backends import KernelBackends
from dsv4serve.model.numerics import NUMERICS_ON
from dsv4serve.worker.model_load import load_model


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer, each storage once."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _plan(model_dir, tmp_path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "dsv4serve", "plan", "--model", str(model_dir), "--gpu-memory", "80GiB", "--json"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "", "DSV4SERVE_CACHE_DIR": str(tmp_path), "HOME": str(tmp_path)},
    )
    return json.loads(out.stdout)["memory_plan"]


def test_the_worker_holds_the_bytes_plan_prints(tiny_dir, tmp_path):
    ckpt = open_checkpoint(tiny_dir)
    assert ckpt.args.n_mtp_layers > 0 and not include_mtp(ckpt.args)  # no speculative decoding: no MTP block
    launch = WorkerLaunch(
        "", "", str(tiny_dir), "cpu", Sourced(1), Sourced(1), Sourced(256), Sourced(None), Sourced(None)
    )
    numerics = NUMERICS_ON.__class__(backends=KernelBackends.every("triton"), batch_invariant=False)
    model, cache, _ = load_model(ckpt, launch, numerics, torch.device("cpu"))  # loads packed, as on CUDA
    assert cache is None and len(model.mtp) == 0
    plan = _plan(tiny_dir, tmp_path)
    assert plan["mtp_resident"] is False and plan["experts"]["all_resident"]
    assert _held_bytes(model) == plan["resident_weight_bytes"] + plan["experts"]["gpu_bytes"]
