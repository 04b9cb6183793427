"""The disk line of `dsv4serve doctor`: how fast experts page in from the disk that holds the checkpoint.

A host whose RAM cannot hold the expert bank (DeepSeek-V4-Flash's 137 GiB on a 128 GiB machine) leaves its last
layers in the memory-mapped shards; each miss there pages the expert in from disk (memory/decode_lanes.py's disk
tier, `plan --disk-bandwidth`). This measures that path: a scratch file of random bytes is written beside the
Hugging Face cache, flushed, dropped from the page cache (posix_fadvise DONTNEED), then read through a memory map
in expert-sized blocks at random offsets (DeepSeek-V4-Flash's w1 / w3 / w2 are 4 MiB each), as many at a time as
the expert staging reads (experts/staging.STAGE_THREADS), cold and then warm.
A cold read about as fast as the warm one means the file system kept the pages: that is no disk number, and the
check says so instead of printing it.
"""

from __future__ import annotations

import mmap
import os
import random
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dsv4serve.doctor_check import Check
from dsv4serve.doctor_host import existing_ancestor
from dsv4serve.experts.staging import STAGE_THREADS

DISK_FILE_BYTES = 256 * 1024**2  # a few hundred ms on an NVMe SSD; past every drive's own cache
DISK_BLOCK_BYTES = 4 * 1024**2  # one expert tensor of DeepSeek-V4-Flash (w1: 2,048 x 4,096 FP4 values)
WRITE_PIECE_BYTES = 64 * 1024**2
COLD_OVER_WARM_MAX = 0.8  # a "cold" read this close to the warm one came from the page cache


@dataclass(frozen=True)
class DiskRead:
    cold_gbps: float  # paged in from the disk
    warm_gbps: float  # the same reads from the page cache
    threads: int = 1  # blocks read at a time

    @property
    def from_disk(self) -> bool:
        """The cold read was slower than the page cache: the drop held, so it measured the disk."""
        return self.cold_gbps < COLD_OVER_WARM_MAX * self.warm_gbps


def _mapped_read(path: Path, n_bytes: int, block: int, order: list[int], threads: int) -> float:
    """GB/s of copying the file's blocks, in `order`, out of a read-only memory map (page faults, as the bank's
    mapped shards are read), `threads` blocks at a time (numpy's copy releases the GIL), as the staging does."""
    import numpy as np

    outs = [np.empty(block, dtype=np.uint8) for _ in range(threads)]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), n_bytes, prot=mmap.PROT_READ) as mapped:
        view = np.frombuffer(mapped, dtype=np.uint8)

        def copy(t: int, view: np.ndarray = view) -> None:
            for i in order[t::threads]:
                outs[t][:] = view[i * block : (i + 1) * block]

        with ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            list(pool.map(copy, range(threads)))
            seconds = time.perf_counter() - start
        del copy, view  # the buffer export must end before the map closes
    return n_bytes / seconds / 1e9


def _drop_cached(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure_disk_read(
    folder: Path, n_bytes: int = DISK_FILE_BYTES, block: int = DISK_BLOCK_BYTES, threads: int = STAGE_THREADS
) -> DiskRead:
    """Write a scratch file in `folder`, drop it from the page cache, read it through a map cold and warm with
    `threads` readers (the staging's count: experts/staging.py), module doc; the file is removed whatever happens."""
    import numpy as np

    n_bytes -= n_bytes % block
    rng = np.random.default_rng(0)  # random bytes: a compressing file system cannot shrink them
    fd, name = tempfile.mkstemp(prefix=".dsv4serve-disk-check-", dir=folder)
    path = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            for offset in range(0, n_bytes, WRITE_PIECE_BYTES):
                f.write(rng.bytes(min(WRITE_PIECE_BYTES, n_bytes - offset)))
            f.flush()
            os.fsync(f.fileno())
        _drop_cached(path)
        order = list(range(n_bytes // block))
        random.Random(0).shuffle(order)
        cold = _mapped_read(path, n_bytes, block, order, threads)
        warm = _mapped_read(path, n_bytes, block, order, threads)
        return DiskRead(cold, warm, threads)
    finally:
        path.unlink(missing_ok=True)


def check_disk_bandwidth(folder: Path, measure=measure_disk_read) -> Check:
    """What a bank's disk tier pages in at: `plan --disk-bandwidth` takes this number."""
    base = existing_ancestor(folder)
    data: dict = {"gbps": None, "path": str(base)}
    if not os.access(base, os.W_OK):
        return Check("disk read", "warn", f"not measured ({base} is not writable)", data=data)
    if shutil.disk_usage(base).free < 4 * DISK_FILE_BYTES:
        value = f"not measured ({base} has under {4 * DISK_FILE_BYTES >> 20} MiB free)"
        return Check("disk read", "warn", value, data=data)
    try:
        read = measure(base)
    except (OSError, ValueError) as exc:
        return Check("disk read", "warn", f"not measured ({exc})", data=data)
    data.update(cold_gbps=read.cold_gbps, warm_gbps=read.warm_gbps)
    if not read.from_disk:
        value = (
            f"not measured: the page cache kept the scratch file in {base} (cold {read.cold_gbps:.1f} GB/s, warm "
            f"{read.warm_gbps:.1f})"
        )
        fix = "the file system ignored the cache drop; pass plan --disk-bandwidth from the drive's spec sheet"
        return Check("disk read", "warn", value, fix, data)
    data["gbps"] = read.cold_gbps
    value = (
        f"{read.cold_gbps:.2f} GB/s paging in {DISK_BLOCK_BYTES >> 20} MiB blocks at random offsets through a "
        f"memory map, {read.threads} at a time as the expert staging reads ({base}; {read.warm_gbps:.1f} GB/s from "
        "the page cache)"
    )
    return Check("disk read", "ok", value, data=data)
