"""What every benchmark prints last: a plain fixed-width table, and min / median / max of repeats."""

from __future__ import annotations

import statistics


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """First column left-aligned, the rest right-aligned, a dashed rule under the header."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = [
        "  ".join(str(c).ljust(widths[0]) if i == 0 else str(c).rjust(widths[i]) for i, c in enumerate(r))
        for r in [headers, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)
