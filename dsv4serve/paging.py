"""Reference-counted ids of fixed-size pieces of the KV pool (pages, sequence slots); tensor-free.

An id is handed out with one reference; sharing it (a cached prefix and the requests that start from
it hold the same pages) adds references; it returns to the free list when the last one is released.
The scheduler owns the engine's allocators; a standalone pool (model tests) owns its own.
"""

from __future__ import annotations


class OutOfIds(RuntimeError):
    """Every id is in use."""


class IdAllocator:
    def __init__(self, capacity: int):
        self.capacity = 0
        self._refs: list[int] = []
        self._free: list[int] = []
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        """Raise the capacity (never lowers it); the new ids are free."""
        if capacity > self.capacity:
            self._free.extend(range(capacity - 1, self.capacity - 1, -1))  # lowest id handed out first
            self._free.sort(reverse=True)
            self._refs.extend([0] * (capacity - self.capacity))
            self.capacity = capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int = 1) -> list[int]:
        """n fresh ids, each with one reference; all or none."""
        if n > len(self._free):
            raise OutOfIds(f"{n} ids asked for, {len(self._free)} of {self.capacity} free")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def share(self, ids: list[int]) -> list[int]:
        """One more reference on each id (which must be in use); returns a new list of the same ids."""
        for i in ids:
            if self._refs[i] <= 0:
                raise ValueError(f"id {i} is not in use")
            self._refs[i] += 1
        return list(ids)

    def release(self, ids: list[int]) -> None:
        for i in ids:
            if self._refs[i] <= 0:
                raise ValueError(f"id {i} released more often than taken")
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free.append(i)

    def refs(self, i: int) -> int:
        return self._refs[i]
