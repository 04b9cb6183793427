"""One request's handle on the paged KV pool: its sequence slot, its page table and its length.

With the pool's contents this is everything a forward needs from earlier tokens, so a forward is
exact at any chunk boundary (dsv4-model.md §2.12). The tensors live in the pool (kv_pool.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsv4serve.model.kv_pool import KvPool


@dataclass
class SequenceState:
    """`num_tokens` is the position of the next token to run (MTP layers: `mtp_num_tokens`)."""

    pool: KvPool
    slot: int  # the window ring and compressor carry of this sequence
    pages: list[int] = field(default_factory=list)  # physical page of each page_tokens-long token range
    num_tokens: int = 0
    mtp_num_tokens: int = 0
