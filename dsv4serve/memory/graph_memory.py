"""What the decode step's CUDA graphs hold on the device (worker/graphs.py, worker/spec_graphs.py), planned
before they exist.

    decode_graph_bytes(args, max_rows, max_model_len, speculative_tokens=0) -> bytes

The buckets are captured largest first into one shared private pool, so the pool is about one forward of
the largest bucket (--max-num-seqs rows): per row the per-token working set of one layer (the chunk
planner's geometry estimate, times its safety factor), plus the fixed per-step bytes at that row count
(the logits [rows, vocab] fp32 and the indexer's score tile sized from max_model_len). The memory plan
reserves it before the KV cache, and the worker captures the graphs before it measures the free memory
the chunk planner plans from, so a prefill chunk never counts on memory the graphs hold; the start-up
report prints the measured figure beside this estimate.

With --speculative-tokens N the largest forward is the verify step of max_rows x (N + 1) tokens (its working
set replaces the decode bucket's), and every verify bucket (rows, n) for n = 1 .. N and every MTP draft-chain
bucket keeps its outputs alive between replays: the logits of each position fp32 and the streams [hc, D] bf16.
"""

from __future__ import annotations

import math

from dsv4serve.memory.chunk_planner import GEOMETRY_SAFETY_FACTOR, prefill_geometry
from dsv4serve.model.args import ModelArgs

STREAM_ENTRY_BYTES = 2  # the streams a verify / chain bucket returns, in the compute dtype (bf16 on a GPU)


def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, ... below max_rows, then max_rows: the buckets worker/graphs.bucket_sizes captures."""
    sizes, n = [], 1
    while n < max_rows:
        sizes.append(n)
        n *= 2
    return [*sizes, max_rows]


def decode_graph_bytes(args: ModelArgs, max_rows: int, max_model_len: int, speculative_tokens: int = 0) -> int:
    tokens = max_rows * (1 + speculative_tokens)  # the largest forward: a verify step's rows x (N + 1)
    geometry = prefill_geometry(args, max_model_len, tokens)
    per_token = math.ceil(geometry.activation_bytes_per_token * GEOMETRY_SAFETY_FACTOR)
    working = tokens * per_token + geometry.fixed_bytes
    if speculative_tokens <= 0:
        return working
    per_output = args.vocab_size * 4 + args.hc_mult * args.dim * STREAM_ENTRY_BYTES
    verify = sum(r * (n + 1) for r in batch_buckets(max_rows) for n in range(1, speculative_tokens + 1))
    chain = sum(batch_buckets(max_rows)) if speculative_tokens > 1 else 0
    return working + (verify + chain) * per_output
