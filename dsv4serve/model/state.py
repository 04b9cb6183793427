"""Per-request incremental state: everything a forward needs from earlier tokens.

With this state a forward is exact at any chunk boundary (dsv4-model.md §2.12): the window keeps the
last `window_size - 1` keys, each compressor keeps its partial window (and for CSA the `A` half of
the last closed window), and the compressed entries / indexer keys grow by one per closed window.
Tensors are plain (unpaged) per request; a paged KV layout can replace them later behind the same
fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4serve.model.args import ModelArgs


@dataclass
class CompressorState:
    pending_kv: torch.Tensor  # [n_pending < ratio, coff * d] fp32, tokens past the last closed window
    pending_score: torch.Tensor  # [n_pending, coff * d] fp32, gate logits with `ape` added
    prev_kv: torch.Tensor | None = None  # [ratio, d] fp32: CSA `A` half of the last closed window
    prev_score: torch.Tensor | None = None
    entries: torch.Tensor | None = None  # [n_closed_windows, d] compute dtype

    @classmethod
    def empty(cls, ratio: int, head_dim: int, dtype: torch.dtype) -> "CompressorState":
        coff = 2 if ratio == 4 else 1
        width = coff * head_dim
        return cls(pending_kv=torch.zeros(0, width), pending_score=torch.zeros(0, width),
                   entries=torch.zeros(0, head_dim, dtype=dtype))

    @property
    def num_entries(self) -> int:
        return self.entries.shape[0]


@dataclass
class LayerState:
    window_kv: torch.Tensor  # [<= window_size - 1, head_dim] compute dtype, the most recent keys
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    @classmethod
    def empty(cls, args: ModelArgs, layer_id: int, dtype: torch.dtype) -> "LayerState":
        ratio = args.compress_ratios[layer_id]
        comp = CompressorState.empty(ratio, args.head_dim, dtype) if ratio else None
        idx = (CompressorState.empty(ratio, args.index_head_dim, dtype)
               if args.kind(layer_id) == "csa" else None)
        return cls(window_kv=torch.zeros(0, args.head_dim, dtype=dtype), compressor=comp, indexer=idx)


@dataclass
class SequenceState:
    """One request's state. `num_tokens` is the position of the next token to run."""

    layers: list[LayerState]
    mtp_layers: list[LayerState] = field(default_factory=list)
    num_tokens: int = 0
    mtp_num_tokens: int = 0

    @classmethod
    def new(cls, args: ModelArgs, dtype: torch.dtype, include_mtp: bool = True) -> "SequenceState":
        """Empty state for `args`; `dtype` is the compute dtype of the numerics the model runs."""
        layers = [LayerState.empty(args, i, dtype) for i in range(args.n_layers)]
        mtp = ([LayerState.empty(args, args.n_layers + j, dtype) for j in range(args.n_mtp_layers)]
               if include_mtp else [])
        return cls(layers=layers, mtp_layers=mtp)
