"""The WorkerLaunch a test starts a dsv4-tiny worker from, shared by the engine tests (tests/e2e, through
their conftest) and the worker set-up tests (tests/unit): one set of defaults, one rule for overrides."""

from __future__ import annotations

from pathlib import Path

from dsv4serve.ipc.messages import Sourced, WorkerLaunch


def launch_for(model_dir: Path, **overrides) -> WorkerLaunch:
    """A launch for dsv4-tiny on the CPU; a plain override value is a setting given on the command line."""
    base = dict(
        to_worker="",
        from_worker="",
        model_path=str(model_dir),
        device="cpu",
        max_num_seqs=Sourced(8),
        max_queued_requests=Sourced(16),
        max_model_len=Sourced(4096, "model-rule"),
        max_prefill_length=Sourced(None),
        num_tokens=Sourced(None),
        # the engine tests compare tokens with the model run alone, and requests with each other: bitwise
        batch_invariant=Sourced(True, "cli"),
    )
    given = {
        k: v if k in ("device", "model_path", "log_level") or isinstance(v, Sourced) else Sourced(v, "cli")
        for k, v in overrides.items()
    }
    return WorkerLaunch(**{**base, **given})
