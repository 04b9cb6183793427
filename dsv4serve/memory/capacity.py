"""How many KV tokens the worker allocates, and the measured memory snapshot the chunk planner gets.

CPU: the pool holds --num-tokens, or CPU_KV_CAPACITY_TOKENS (host memory; a modest default), and the
snapshot is host RAM. CUDA: after the weights (and expert slots) are on the device, the free memory
is measured (memory_probe), the platform margin and the activations of one planned chunk are kept
back, and the pool takes the rest (capped by max_model_len x max_num_seqs); an explicit --num-tokens
is honoured or refused by name. After the pool exists, one probe prefill calibrates the activation
bytes per token, and the plan is made from that measurement.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from dsv4serve.memory.chunk_planner import PLATFORM_MARGIN_BYTES, MemorySnapshot, PrefillGeometry, activation_bytes
from dsv4serve.memory.kv_geometry import kv_geometry
from dsv4serve.memory.probe import host_snapshot, measure_activation_bytes, take_snapshot
from dsv4serve.model.args import ModelArgs

log = logging.getLogger("dsv4serve.worker")
CPU_KV_CAPACITY_TOKENS = 131072  # the CPU reference path keeps the pool in host memory; a modest default
PROBE_TOKENS_MAX = 2048  # the calibration prefill: the planned chunk, at most this many tokens


class CapacityError(RuntimeError):
    """The device cannot hold the KV the settings ask for; the message names the flag and the limit."""


def kv_capacity(
    args: ModelArgs,
    device: torch.device,
    entry_bytes: int,
    num_slots: int,
    max_tokens: int,
    num_tokens: int | None,
    memory_ratio: float,
    reserve_tokens: int,
    geometry: PrefillGeometry,
    graph_bytes: int = 0,
    include_mtp: bool = False,
) -> int:
    """KV tokens for the pool, aligned down to whole pages. `max_tokens`: what could ever be used
    (max_model_len x max_num_seqs); `reserve_tokens`: a chunk whose activations stay free (CUDA);
    `graph_bytes`: what the decode graphs captured after the pool will hold (memory/graph_memory.py)."""
    page = args.page_tokens
    if device.type != "cuda":
        return ((num_tokens or min(CPU_KV_CAPACITY_TOKENS, max_tokens)) // page) * page or page
    kv = kv_geometry(args, include_mtp, entry_bytes=entry_bytes)  # the MTP block's KV when it is loaded
    snap = take_snapshot("cuda", memory_ratio)
    keep = (
        PLATFORM_MARGIN_BYTES[snap.platform]
        + kv.seq_state_bytes * num_slots
        + activation_bytes(geometry.activation_bytes_per_token, geometry.fixed_bytes, reserve_tokens, 0)
        + graph_bytes
    )
    fits = max(0, int((snap.free_bytes - keep) / kv.bytes_per_token)) if kv.bytes_per_token else max_tokens
    fits = (fits // page) * page
    if num_tokens is not None:
        if num_tokens > fits:
            raise CapacityError(
                f"--num-tokens {num_tokens} does not fit: {snap.free_bytes / 2**30:.2f} GiB free "
                f"after the weights holds {fits} KV tokens beside the {snap.platform} margin, "
                f"the sequence slots and a {reserve_tokens}-token prefill; lower --num-tokens"
            )
        return (num_tokens // page) * page or page
    if fits < page:
        raise CapacityError(
            f"no room for one {page}-token KV page after the weights "
            f"({snap.free_bytes / 2**30:.2f} GiB free, --memory-ratio {memory_ratio})"
        )
    return min(fits, -(-max_tokens // page) * page)


def planner_snapshot(
    device: torch.device, memory_ratio: float, probe: Callable[[int], object] | None, probe_tokens: int
) -> MemorySnapshot:
    """The snapshot the chunk planner plans from: host RAM on CPU; on CUDA free memory measured after
    every allocation, with the activation bytes per token of a `probe_tokens` probe prefill."""
    if device.type != "cuda":
        return host_snapshot(memory_ratio)
    measured = None
    if probe is not None and probe_tokens > 0:
        try:
            measured = measure_activation_bytes(probe, probe_tokens, "cuda")
        except torch.OutOfMemoryError as exc:  # the estimate (with its safety factor) stands in
            log.warning(
                "the %d-token calibration prefill ran out of memory (%s); planning from the geometry estimate",
                probe_tokens,
                exc,
            )
            torch.cuda.empty_cache()
        if measured is not None:
            log.info("calibration prefill of %d tokens: %d activation bytes per token", probe_tokens, measured)
    return take_snapshot("cuda", memory_ratio, measured_activation_bytes_per_token=measured)
