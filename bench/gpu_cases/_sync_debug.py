"""Host syncs in a decode step: torch.cuda.set_sync_debug_mode around it, each sync named by the project line
that made it (bench/gpu_cases/decode_step.py's notes).

    with sync_debug("warn") as sites: step()       # sites: Counter of "dsv4serve/model/moe.py:215 (fn)"
    describe_syncs(sites)                          # "no host sync" or "N host syncs: site xK, ..."
    project_site(traceback.extract_tb(exc.__traceback__))   # where an "error"-mode sync was raised
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


def project_site(frames: list[traceback.FrameSummary]) -> str:
    """The innermost frame in the project's code (dsv4serve/, dsv4_kernels/) as `path:line (function)`."""
    for f in reversed(frames):
        parts = Path(f.filename).parts
        for root in ("dsv4serve", "dsv4_kernels"):
            if root in parts:
                at = len(parts) - 1 - parts[::-1].index(root)
                return f"{'/'.join(parts[at:])}:{f.lineno} ({f.name})"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def describe_syncs(sites: Counter[str]) -> str:
    if not sites:
        return "no host sync"
    top = ", ".join(f"{site} x{count}" for site, count in sites.most_common(6))
    more = f", {len(sites) - 6} more sites" if len(sites) > 6 else ""
    return f"{sum(sites.values())} host syncs: {top}{more}"


@contextmanager
def sync_debug(mode: str) -> Iterator[Counter[str]]:
    """The block under torch.cuda.set_sync_debug_mode(mode). Under "warn" torch warns at every host sync; the
    Counter gets each one's project line (from the stack at the warning) instead of a printed warning."""
    sites: Counter[str] = Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                sites[project_site(traceback.extract_stack())] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode("default")
