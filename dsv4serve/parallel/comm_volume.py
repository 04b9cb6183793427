"""Communication per decode step over N GPUs, projected from the model's geometry (pure arithmetic).

    decode_collectives(args, batch_tokens, n_gpus, layout) -> [Collective]   what one step sends, by kind
    step_comm(collectives, link) -> StepComm                               bytes and seconds per step

Two layouts (dsv4serve/parallel/partition.py holds the first's split):
- "tp": attention tensor parallel (heads split, wo_b row parallel), experts split or owned (EP): every rank
  sees every token, so the MoE needs no dispatch: its partial sums (routed + shared) are reduced with the
  attention's, one all-reduce of [tokens, dim] bf16 after wo_b and one after the MoE, per layer; plus one for
  the vocabulary-parallel embedding and a gather of the fp32 logit shards to rank 0 (which samples).
- "dp_ep": attention data parallel (each rank its own sequences, attention weights whole on every rank) and
  experts owned (EP): per MoE layer each rank dispatches its tokens' routed copies to the experts' owners and
  combines the results back: an all-to-all each way (or all-gather + reduce-scatter of all tokens). Dispatch
  is FP8 with one e8m0 scale per 128 (the experts quantize their input so anyway: dsv4-model.md §2.10),
  combine bf16. Copies are counted per expert (top-k per token), the share (T-1)/T leaving the rank under
  uniform routing; sending a token once per destination rank (DeepEP does) would send fewer.

Time per collective = latency + bytes one rank sends / bus bandwidth (nccl-tests' "busbw" convention: a ring
all-reduce of S bytes sends 2(T-1)/T x S per rank, an all-gather or reduce-scatter (T-1)/T x S). Decode
messages are small (8 KiB a token), so at small batches the latency term is the whole cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dsv4serve.model.args import ModelArgs

Layout = Literal["tp", "dp_ep"]
BF16_BYTES, FP32_BYTES = 2, 4
FP8_SCALE_BLOCK = 128  # one e8m0 byte per 128 FP8 activations


@dataclass(frozen=True)
class Link:
    """An assumed interconnect: bus bandwidth per direction and a fixed cost per collective."""

    bus_gbps: float
    latency_us: float
    source: str


# H200 NVLink 4: 18 links, 900 GB/s bidirectional = 450 GB/s each way (MLCommons inference v4.1,
# NVIDIA/systems/H200-SXM-141GBx8_TRT_MaxQ.json); 380 GB/s one way measured on H100 NVLink 4
# (p2pBandwidthLatencyTest, NVIDIA/nccl#1264). Latency: 15 us a collective for eager NCCL calls (NCCL's own
# tuning model prices a 64-byte all-reduce at ~25 us on an H100 cluster, NVIDIA/nccl#1453); 3.5 us when
# graph-captured (a 1 KiB ring all-reduce on 4 x H800 NVLink, NVIDIA/nccl#1984).
NVLINK4_EAGER = Link(380.0, 15.0, "NVLink 4, 380 GB/s each way achieved, 15 us per eager NCCL collective")
NVLINK4_GRAPHED = Link(380.0, 3.5, "NVLink 4, 380 GB/s each way achieved, 3.5 us per graph-captured collective")


@dataclass(frozen=True)
class Collective:
    name: str
    op: Literal["all_reduce", "all_to_all", "all_gather", "reduce_scatter", "gather"]
    per_step: int  # how many times a decode step runs it
    message_bytes: int  # the tensor it moves: all-reduce's operand, a rank's all-to-all payload
    sent_bytes: int  # what the busiest rank puts on its links per call

    def seconds(self, link: Link) -> float:
        return link.latency_us * 1e-6 + self.sent_bytes / (link.bus_gbps * 1e9)


@dataclass(frozen=True)
class StepComm:
    calls: int
    sent_bytes: int  # per rank, per step
    seconds: float
    latency_seconds: float  # the part that is the per-call cost alone


def _all_reduce(name: str, per_step: int, message: int, n: int) -> Collective:
    return Collective(name, "all_reduce", per_step, message, 2 * (n - 1) * message // n)


def decode_collectives(
    args: ModelArgs, batch_tokens: int, n_gpus: int, layout: Layout, all_to_all: bool = True
) -> list[Collective]:
    """One decode step of `batch_tokens` rows (one token each, MTP off) over `n_gpus` ranks."""
    n, d, layers = n_gpus, args.dim, args.n_layers
    if n == 1:
        return []
    if layout == "tp":
        hidden = batch_tokens * d * BF16_BYTES  # [B, dim] bf16
        logits = batch_tokens * (args.vocab_size // n) * FP32_BYTES  # a rank's [B, V/T] fp32 shard
        return [
            _all_reduce("attention output (after wo_b)", layers, hidden, n),
            _all_reduce("MoE output (routed + shared)", layers, hidden, n),
            _all_reduce("embedding (vocab-parallel)", 1, hidden, n),
            Collective("logits to rank 0", "gather", 1, logits, (n - 1) * logits),  # rank 0 receives them all
        ]
    local = -(-batch_tokens // n)  # the busiest rank's tokens
    k, leaving = args.n_activated_experts, (n - 1) / n
    fp8_row = d + d // FP8_SCALE_BLOCK  # e4m3 values + e8m0 scales
    if all_to_all:
        dispatch = local * k * fp8_row
        combine = local * k * d * BF16_BYTES
        return [
            Collective("dispatch (FP8, top-k copies)", "all_to_all", layers, dispatch, round(leaving * dispatch)),
            Collective("combine (bf16, top-k copies)", "all_to_all", layers, combine, round(leaving * combine)),
        ]
    gathered = n * local * fp8_row  # every rank gets every token, then computes its own experts' share
    reduced = n * local * d * BF16_BYTES
    return [
        Collective("all-gather tokens (FP8)", "all_gather", layers, gathered, round(leaving * gathered)),
        Collective("reduce-scatter outputs (bf16)", "reduce_scatter", layers, reduced, round(leaving * reduced)),
    ]


def step_comm(collectives: list[Collective], link: Link) -> StepComm:
    calls = sum(c.per_step for c in collectives)
    sent = sum(c.per_step * c.sent_bytes for c in collectives)
    seconds = sum(c.per_step * c.seconds(link) for c in collectives)
    return StepComm(calls, sent, seconds, calls * link.latency_us * 1e-6)
