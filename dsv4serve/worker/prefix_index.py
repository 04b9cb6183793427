"""Which page-aligned prompt prefixes have a saved model state, keyed by a hash chain of their pages.

The key of the first k pages is blake2b(key of the first k-1 pages + the k-th page's token ids), so
equal keys mean equal prefixes (up to a 128-bit collision). An entry holds references on the KV pages
of its prefix (shared with the requests that start from it) and a snapshot slot with the window ring
and compressor carry at its end; entries are evicted least recently used. Tensor-free.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class PrefixEntry:
    num_tokens: int
    pages: list[int]  # page ids, one reference each held by this entry
    slot: int  # the snapshot slot
    ready: bool = True  # False until the step that saves the state has run


class PrefixIndex:
    def __init__(self, page_tokens: int):
        self.page_tokens = page_tokens
        self.entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()  # least recently used first

    def page_keys(self, token_ids: list[int], max_tokens: int) -> list[bytes]:
        """keys[k - 1] identifies the first k whole pages, for every whole page within `max_tokens`."""
        keys: list[bytes] = []
        prev = b""
        for end in range(self.page_tokens, max_tokens + 1, self.page_tokens):
            page = struct.pack(f"<{self.page_tokens}q", *token_ids[end - self.page_tokens : end])
            prev = hashlib.blake2b(prev + page, digest_size=16).digest()
            keys.append(prev)
        return keys

    def lookup(self, keys: list[bytes]) -> PrefixEntry | None:
        """The longest cached prefix among `keys`, refreshed as recently used."""
        for k in range(len(keys), 0, -1):
            entry = self.entries.get(keys[k - 1])
            if entry is not None and entry.ready:
                self.entries.move_to_end(keys[k - 1])
                return entry
        return None

    def insert(self, key: bytes, entry: PrefixEntry) -> None:
        self.entries[key] = entry

    def mark_ready(self, slot: int) -> None:
        """The step that saves the snapshot in `slot` has run."""
        for entry in self.entries.values():
            if entry.slot == slot:
                entry.ready = True

    def pop_lru(self) -> tuple[bytes, PrefixEntry] | None:
        """Remove the least recently used saved state (never one still being saved)."""
        for key, entry in self.entries.items():
            if entry.ready:
                return key, self.entries.pop(key)
        return None
