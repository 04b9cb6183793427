"""The safetensors files of a checkpoint folder: which tensor lives where, read one at a time.

Only the JSON headers are read up front; tensor data is read memory-mapped, tensor by tensor, so a
149 GiB checkpoint never needs 149 GiB of RAM. Only safetensors are read (no pickle).
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, with a message that says which file or tensor and why."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors dtype name, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    file: str  # shard file name inside the folder
    begin: int = 0  # the tensor's bytes in the file, [begin, end) (0, 0: not known, e.g. a tensor list)
    end: int = 0


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names, dtypes and shapes from one safetensors file, without reading its data."""
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: safetensors header of {n} bytes is not plausible")
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
    data = 8 + n  # the data section follows the length and the header
    return {
        name: TensorInfo(meta["dtype"], tuple(meta["shape"]), path.name, *(data + o for o in meta["data_offsets"]))
        for name, meta in header.items()
        if name != "__metadata__"
    }


class SafetensorsFolder:
    """All tensors of a folder of safetensors shards, located through the index file when present."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.files = self._shard_files()
        self.infos: dict[str, TensorInfo] = {}
        for file in self.files:
            for name, info in read_header(self.folder / file).items():
                if name in self.infos:
                    raise CheckpointError(
                        f"{self.folder}: tensor {name} appears in both {self.infos[name].file} and {file}"
                    )
                self.infos[name] = info
        self._check_index()
        self._handles: dict[str, object] = {}
        self._maps: dict[str, mmap.mmap] = {}

    def _shard_files(self) -> list[str]:
        index = self.folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.folder / f).is_file()]
            if missing:
                raise CheckpointError(
                    f"{self.folder}: the index names shard files that are not there: "
                    f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                    f"(an interrupted download? run it again)"
                )
            return files
        files = sorted(p.name for p in self.folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.folder}: no *.safetensors files (only safetensors checkpoints are read)")
        return files

    def _check_index(self) -> None:
        index = self.folder / INDEX_FILE
        if not index.is_file():
            return
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        for name, file in weight_map.items():
            info = self.infos.get(name)
            if info is None or info.file != file:
                where = "is in no shard" if info is None else f"is in {info.file}"
                raise CheckpointError(f"{index}: maps {name} to {file}, but it {where}")

    def read(self, name: str, cut: tuple[slice, ...] | None = None) -> torch.Tensor:
        """One tensor, copied out of its memory-mapped shard; with `cut`, only that part of it is read (a
        tensor-parallel rank's shard: safetensors' get_slice reads just the bytes the slice covers)."""
        info = self.infos[name]
        handle = self._handles.get(info.file)
        if handle is None:
            handle = safe_open(str(self.folder / info.file), framework="pt")
            self._handles[info.file] = handle
        if cut is None:
            return handle.get_tensor(name)  # type: ignore[attr-defined]
        return handle.get_slice(name)[cut]  # type: ignore[attr-defined]

    def view(self, name: str) -> torch.Tensor:
        """One tensor's bytes, uint8 [nbytes], a view of its memory-mapped shard: no copy is made, the pages come
        in as the view is read (a copy out of it pages them in on whatever thread runs it). Read it, never write:
        the map is private, so a write would only change this process's copy of the page."""
        info = self.infos[name]
        mapped = self._maps.get(info.file)
        if mapped is None:
            with open(self.folder / info.file, "rb") as f:
                mapped = self._maps[info.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return torch.frombuffer(mapped, dtype=torch.uint8, count=info.end - info.begin, offset=info.begin)

    def close(self) -> None:
        self._handles.clear()
        self._maps.clear()  # the views still alive keep their maps open
