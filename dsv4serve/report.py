"""The startup report: every effective setting, its source, and why it is what it is."""

from __future__ import annotations

import dataclasses
from typing import Any

from dsv4serve.config import ServeConfig, display, options


def settings_rows(cfg: ServeConfig) -> list[dict[str, Any]]:
    rows = []
    for name, opt in options().items():
        setting = getattr(cfg, name)
        rows.append(
            {
                "setting": name,
                "flag": opt.flag(name),
                "value": display(name, setting),
                "source": setting.source.value,
                "note": setting.note,
            }
        )
    return rows


def settings_json(cfg: ServeConfig) -> dict[str, Any]:
    """Machine-readable settings; secrets are reported as set / not set, never echoed."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        setting = getattr(cfg, f.name)
        value = display(f.name, setting) if options()[f.name].secret else setting.value
        out[f.name] = {"value": value, "source": setting.source.value, "note": setting.note}
    return out


def format_table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    line = "  ".join(c.ljust(widths[c]) for c in columns)
    rule = "  ".join("-" * widths[c] for c in columns)
    body = ["  ".join(str(r[c]).ljust(widths[c]) for c in columns).rstrip() for r in rows]
    return "\n".join([line.rstrip(), rule, *body])


def format_settings(cfg: ServeConfig) -> str:
    return "effective settings\n" + format_table(settings_rows(cfg), ("flag", "value", "source", "note"))
