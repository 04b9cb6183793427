"""Which page-aligned prompt prefixes have a saved model state, keyed by a hash chain of their pages.

The key of the first k pages is blake2b(key of the first k-1 pages + the k-th page's token ids), so
equal keys mean equal prefixes (up to a 128-bit collision). Entries hold KV pages of the shared pool
and are evicted least recently used. Tensor-free: the runner keeps the states themselves.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class PrefixEntry:
    num_tokens: int
    num_pages: int
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
            page = struct.pack(f"<{self.page_tokens}q", *token_ids[end - self.page_tokens:end])
            prev = hashlib.blake2b(prev + page, digest_size=16).digest()
            keys.append(prev)
        return keys

    def lookup(self, keys: list[bytes]) -> tuple[bytes, int] | None:
        """The longest cached prefix among `keys`: (key, tokens), refreshed as recently used."""
        for k in range(len(keys), 0, -1):
            entry = self.entries.get(keys[k - 1])
            if entry is not None and entry.ready:
                self.entries.move_to_end(keys[k - 1])
                return keys[k - 1], entry.num_tokens
        return None

    def insert(self, key: bytes, num_tokens: int, num_pages: int, ready: bool = True) -> None:
        self.entries[key] = PrefixEntry(num_tokens, num_pages, ready)

    def mark_ready(self, key: bytes) -> None:
        entry = self.entries.get(key)
        if entry is not None:
            entry.ready = True

    def pop_lru(self) -> tuple[bytes, PrefixEntry] | None:
        """Remove the least recently used saved state (never one still being saved)."""
        for key, entry in self.entries.items():
            if entry.ready:
                return key, self.entries.pop(key)
        return None

    @property
    def num_pages(self) -> int:
        return sum(e.num_pages for e in self.entries.values())
