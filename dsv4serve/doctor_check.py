"""One line of the `dsv4serve doctor` report: what was found, and what to do about it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["ok", "warn", "fail"]


@dataclass(frozen=True)
class Check:
    name: str  # short label: "torch", "gpu 0", "pinned memory"
    status: Status
    value: str  # what was found, in words
    fix: str = ""  # what to do about it (empty when status is ok)
    data: dict[str, Any] = field(default_factory=dict)  # the same facts for --json
