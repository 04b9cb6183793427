"""Byte sizes as people write them: 32GiB, 24GB, 128G, 1.5TiB, 1048576."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (write e.g. 32GiB, 24GB, 128G or a byte count)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def gib(n_bytes: int) -> str:
    return f"{n_bytes / 1024**3:.2f} GiB"
