"""What the decode step's CUDA graphs hold on the device (worker/graphs.py), planned before they exist.

    decode_graph_bytes(args, max_rows, max_model_len) -> bytes

The buckets are captured largest first into one shared private pool, so the pool is about one forward of
the largest bucket (--max-num-seqs rows): per row the per-token working set of one layer (the chunk
planner's geometry estimate, times its safety factor), plus the fixed per-step bytes at that row count
(the logits [rows, vocab] fp32 and the indexer's score tile sized from max_model_len). The memory plan
reserves it before the KV cache, and the worker captures the graphs before it measures the free memory
the chunk planner plans from, so a prefill chunk never counts on memory the graphs hold; the start-up
report prints the measured figure beside this estimate.
"""

from __future__ import annotations

import math

from dsv4serve.memory.chunk_planner import GEOMETRY_SAFETY_FACTOR, prefill_geometry
from dsv4serve.model.args import ModelArgs


def decode_graph_bytes(args: ModelArgs, max_rows: int, max_model_len: int) -> int:
    geometry = prefill_geometry(args, max_model_len, max_rows)
    per_row = math.ceil(geometry.activation_bytes_per_token * GEOMETRY_SAFETY_FACTOR)
    return max_rows * per_row + geometry.fixed_bytes
