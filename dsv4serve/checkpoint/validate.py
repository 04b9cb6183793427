"""Checking a checkpoint's tensors against the schema its config implies, before any data is read."""

from __future__ import annotations

from typing import Literal

from dsv4serve.checkpoint import hf_names
from dsv4serve.checkpoint.source import CheckpointError, TensorInfo
from dsv4serve.model.schema import TensorSpec

Layout = Literal["official", "hf"]
FLOAT_DTYPES = ("F32", "BF16", "F16")
MAX_LISTED = 8


def detect_layout(names: set[str]) -> Layout:
    if "embed.weight" in names or any(n.startswith("layers.") for n in names):
        return "official"
    if any(hf_names.is_hf_name(n) for n in names):
        return "hf"
    sample = ", ".join(sorted(names)[:3])
    raise CheckpointError(
        f"tensor names fit neither the official DeepSeek layout (embed.weight, layers.N.*) "
        f"nor the transformers layout (model.*): {sample}"
    )


def official_view(infos: dict[str, TensorInfo], layout: Layout) -> tuple[dict[str, TensorInfo], list[str]]:
    """The checkpoint's tensors under official names, plus the names that map to nothing."""
    if layout == "official":
        return dict(infos), []
    out: dict[str, TensorInfo] = {}
    unknown: list[str] = []
    for name, info in infos.items():
        official = hf_names.hf_to_official(name)
        if official is not None:
            if official in out:
                raise CheckpointError(f"two tensors both map to {official}; one is {name}")
            out[official] = info
            continue
        stacked = hf_names.hf_stacked_experts(name)
        if stacked is None or len(info.shape) != 3:
            unknown.append(name)
            continue
        for part, shape in hf_names.split_stacked_shapes(*stacked, info.shape).items():
            out[part] = TensorInfo(info.dtype, shape, info.file)
    return out, unknown


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f" ... and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else "")


def check_tensors(infos: dict[str, TensorInfo], layout: Layout, specs: list[TensorSpec], where: str) -> None:
    """Raise CheckpointError naming every missing, unexpected, mis-typed or mis-shaped tensor.

    The official layout must match dtypes exactly (the FP8/FP4 formats depend on them); a transformers
    checkpoint may store float tensors in any float dtype (they are cast on load).
    """
    view, unknown = official_view(infos, layout)
    expected = {s.name: s for s in specs}
    missing = [n for n in expected if n not in view]
    unexpected = unknown + sorted(n for n in view if n not in expected)
    if layout == "hf":  # name what is stored, not what it was taken for
        stored = {hf_names.hf_to_official(n): n for n in infos}
        unexpected = [stored.get(n, n) for n in unexpected]
    problems: list[str] = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s): {_listing(unexpected)}")
    wrong: list[str] = []
    for name, spec in expected.items():
        info = view.get(name)
        if info is None:
            continue
        if info.shape != spec.shape:
            wrong.append(f"{name} has shape {list(info.shape)}, the config implies {list(spec.shape)}")
        elif not _dtype_ok(info.dtype, spec, layout):
            wrong.append(f"{name} has dtype {info.dtype}, the config implies {spec.dtype}")
    if wrong:
        problems.append(
            f"{len(wrong)} tensor(s) do not fit the config: "
            + "; ".join(wrong[:MAX_LISTED])
            + (f" ... and {len(wrong) - MAX_LISTED} more" if len(wrong) > MAX_LISTED else "")
        )
    if problems:
        raise CheckpointError(f"{where} does not match its config.json: " + " | ".join(problems))


def _dtype_ok(dtype: str, spec: TensorSpec, layout: Layout) -> bool:
    if layout == "hf" and spec.role == "dense" and spec.dtype in FLOAT_DTYPES:
        return dtype in FLOAT_DTYPES
    return dtype == spec.dtype
