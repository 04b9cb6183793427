"""KV cache bytes of the model (dsv4-model.md §2.11): per token amortized over the compressed entries and the
indexer keys, and per sequence fixed (the windows and the compressors' fp32 carry), for a bf16 cache.

    kv = kv_geometry(args, include_mtp)
    kv_bytes(kv, tokens)    kv_tokens_for(kv, n_bytes)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from dsv4serve.model.args import ModelArgs


@dataclass(frozen=True)
class KvGeometry:
    bytes_per_token: Fraction  # amortized cache bytes per token, all layers
    seq_state_bytes: int  # fixed per sequence: windows + compressor rings
    terms: tuple[tuple[str, str], ...]


def _carry_bytes(ratio: int, d: int) -> int:
    """A compressor's fp32 carry per sequence (model/kv_pool.py): kv + score of up to `ratio` pending
    tokens (2d wide when windows overlap, ratio 4), plus the overlap's previous `A` half (ratio x d)."""
    overlap = ratio == 4
    return 2 * ratio * (2 if overlap else 1) * d * 4 + (2 * ratio * d * 4 if overlap else 0)


def kv_geometry(args: ModelArgs, include_mtp: bool = False, entry_bytes: int = 2) -> KvGeometry:
    """dsv4-model.md §2.11, for a cache stored in bf16 (entry_bytes 2 per dim)."""
    layers = range(args.n_all_layers if include_mtp else args.n_layers)
    per_token, window, rings = Fraction(0), 0, 0
    for i in layers:
        r, kind = args.compress_ratios[i], args.kind(i)
        window += args.window_size * args.head_dim * entry_bytes  # the raw window, every layer
        if r:
            per_token += Fraction(args.head_dim * entry_bytes, r)  # one compressed entry per r tokens
            rings += _carry_bytes(r, args.head_dim)
        if kind == "csa":
            per_token += Fraction(args.index_head_dim * entry_bytes, r)  # indexer keys
            rings += _carry_bytes(r, args.index_head_dim)
    terms = (
        ("compressed entries + indexer keys per token", f"{float(per_token):,.1f} B"),
        ("window per sequence", f"{window:,} B"),
        ("compressor carry per sequence (fp32)", f"{rings:,} B"),
    )
    return KvGeometry(per_token, window + rings, terms)


def kv_bytes(kv: KvGeometry, tokens: int) -> int:
    return math.ceil(kv.bytes_per_token * tokens)


def kv_tokens_for(kv: KvGeometry, n_bytes: int) -> int:
    return max(0, math.floor(Fraction(n_bytes) / kv.bytes_per_token)) if kv.bytes_per_token else 0
