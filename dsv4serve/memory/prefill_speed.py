"""A cold prefill's routed-expert transfers with the experts offloaded, projected (pure), and the size of the prefill
stream's device area (experts/prefill_stream.py).

    planned_stream_group(n_experts) -> int                 experts per streamed range
    stream_area_bytes(n_experts, expert_bytes) -> int      the area's two ranges, planned beside the slots
    project_prefill(bytes, slots, chunk_tokens, topk, tiers, bandwidths) -> PrefillProjection

Model of one prefill chunk of C tokens (every constant names its source or says it is an assumption): each MoE
layer routes C x k routes, C k / E an expert on average; past 4 an expert (the stream's threshold) nearly every
expert is used. Per layer the experts outside the slots (the slots spread evenly over the layers) cross PCIe:
- in place (the kernel reads the pinned bank): once per block of up to 64 of an expert's routes, ceil(C k / (64 E))
  blocks at the average load, at IN_PLACE_GBPS, the GPU's scattered loads from pinned host memory;
- streamed: once, at the host-to-device copy rate.
A layer outside the pinned tier is staged by the host before either (decode_lanes.fetch_seconds_per_byte: a host
copy, after a page-in for the disk tier). Only these transfers are counted, not the GPU's GEMMs or attention: the
tokens/s are the bound a 32 GB card's cold prefill meets first, not a promise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsv4serve.memory.decode_lanes import TIERS, BankTiers, fetch_seconds_per_byte
from dsv4serve.memory.decode_speed import GB, Bandwidths, DecodeBytes

STREAM_BUFFERS = 2  # experts/prefill_stream.BUFFERS: one range computes while the next is copied
STREAM_GROUP_MAX = 16  # experts a range: 16 ranges a layer of 256 (2 x 16 x 12.75 MiB = 408 MiB of device memory)
# measured: the FP4 kernel reading every used expert in place from pinned host memory, one H200 on PCIe 5.0
# (bench/RESULTS.md, 2026-12-04: 26.7 GB/s at batch 1, where the same host's pinned copies ran at 51.6 GB/s)
IN_PLACE_GBPS = 26.7
ROUTE_BLOCK = 64  # the kernel's route block at prefill (fp4_moe_choices.pick_block_m)
PROMPT_TOKENS = 100_000  # the cold prompt the printout prices (users.md: agents' prompts run 20K-300K tokens)


def planned_stream_group(n_experts: int) -> int:
    """Experts per streamed range: a 16th of a layer, at most STREAM_GROUP_MAX (at least 1)."""
    return max(1, min(STREAM_GROUP_MAX, n_experts // 16))


def stream_area_bytes(n_experts: int, expert_bytes: int) -> int:
    return STREAM_BUFFERS * planned_stream_group(n_experts) * expert_bytes


@dataclass(frozen=True)
class PrefillProjection:
    chunk_tokens: int
    in_place_seconds: float  # a chunk's expert transfers, read in place
    streamed_seconds: float  # the same, streamed
    streamed_bytes: int  # bytes a chunk streams over PCIe
    blocks_per_expert: int  # in-place reads of an expert a chunk

    def tokens_per_second(self, streamed: bool = True) -> float:
        return self.chunk_tokens / (self.streamed_seconds if streamed else self.in_place_seconds)

    def to_json(self) -> dict:
        return {
            "chunk_tokens": self.chunk_tokens,
            "streamed_tokens_per_second": round(self.tokens_per_second(), 1),
            "in_place_tokens_per_second": round(self.tokens_per_second(False), 1),
            "streamed_bytes_per_chunk": self.streamed_bytes,
            "in_place_reads_per_expert": self.blocks_per_expert,
            "prompt_tokens": PROMPT_TOKENS,
            "prompt_seconds_streamed": round(PROMPT_TOKENS / self.tokens_per_second(), 1),
        }


def project_prefill(
    b: DecodeBytes, slots: int, chunk_tokens: int, topk: int, tiers: BankTiers, bw: Bandwidths
) -> PrefillProjection:
    """Transfers of a `chunk_tokens` prefill chunk (module doc); `tiers`: where the bank holds the layers."""
    if chunk_tokens < 1:
        raise ValueError(f"a prefill chunk holds at least one token, got {chunk_tokens}")
    per_layer = b.n_experts // b.n_moe_layers
    outside = max(0.0, per_layer - slots / b.n_moe_layers)  # experts a layer reads from the host
    blocks = max(1, math.ceil(chunk_tokens * topk / (ROUTE_BLOCK * per_layer)))
    r = bw.rates()
    shares = {"pinned": tiers.pinned, "pageable": tiers.pageable, "disk": tiers.disk}
    in_place = streamed = 0.0
    for tier in TIERS:
        layers = shares[tier] * b.n_moe_layers
        staging = fetch_seconds_per_byte(tier, r) - 1 / r.h2d  # the host's part of a fetch (0 when pinned)
        in_place += layers * outside * b.expert_bytes * (staging + blocks / (IN_PLACE_GBPS * GB))
        streamed += layers * outside * b.expert_bytes * (staging + 1 / r.h2d)
    streamed_bytes = round(b.n_moe_layers * outside * b.expert_bytes)
    return PrefillProjection(chunk_tokens, in_place, streamed, streamed_bytes, blocks)


def prefill_lines(p: PrefillProjection, h2d_source: str) -> list[str]:
    """The plan's printout of a projection."""
    t, s = p.tokens_per_second(), p.tokens_per_second(False)
    return [
        f"projected cold prefill, routed-expert transfers only (memory/prefill_speed.py; the GPU's compute not "
        f"counted): {p.chunk_tokens:,}-token chunks stream {p.streamed_bytes / 2**30:.2f} GiB of experts each at the "
        f"host-to-device rate ({h2d_source}): {t:,.0f} tokens/s, a {PROMPT_TOKENS:,}-token prompt in "
        f"{PROMPT_TOKENS / t:,.0f} s",
        f"- read in place instead ({p.blocks_per_expert} reads of each expert a chunk at {IN_PLACE_GBPS:g} GB/s, "
        f"measured on an H200's host): {s:,.0f} tokens/s",
        f"- a chunk twice as large streams about the same bytes for twice the tokens (~{2 * t:,.0f} tokens/s), but its "
        "activations take slots from decode: `plan --max-prefill-length N` shows both",
    ]
