"""Eviction policies: order only. The allocator (``HostTier``) decides what is evictable.

A policy tracks the keys it is told about and, asked for victims, yields candidates from
coldest to hottest; the tier skips pinned ones. Policies come from ``POLICIES`` by name.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvdepot.keys import ChunkKey


class LRUPolicy:
    """Least recently used first. ``touch`` on every hit and every insert."""

    def __init__(self) -> None:
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    def touch(self, key: ChunkKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[ChunkKey]:
        """Coldest first. Callers stop iterating before they mutate (decide, then evict)."""
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


POLICIES: dict[str, type[LRUPolicy]] = {"lru": LRUPolicy}
