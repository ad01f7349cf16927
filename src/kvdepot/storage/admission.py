"""Disk admission policies: which chunks the write-behind copies to disk.

"always" admits every chunk; "second_hit" admits a chunk from its second sighting (stored or hit)
on, so one-off prompts do not cost disk bandwidth. Picked by name from ``ADMISSION``.
"""

from __future__ import annotations

from collections import OrderedDict

from kvdepot.keys import ChunkKey


class AlwaysAdmit:
    def admit(self, key: ChunkKey) -> bool:
        return True


class SecondHit:
    """Admit a chunk from its second sighting on; remembers the last ``memory`` keys seen."""

    def __init__(self, hits: int = 2, memory: int = 1 << 16) -> None:
        self.hits, self.memory = hits, memory
        self._seen: OrderedDict[ChunkKey, int] = OrderedDict()

    def admit(self, key: ChunkKey) -> bool:
        count = self._seen.pop(key, 0) + 1
        self._seen[key] = count
        if len(self._seen) > self.memory:
            self._seen.popitem(last=False)
        return count >= self.hits


ADMISSION: dict[str, type[AlwaysAdmit] | type[SecondHit]] = {"always": AlwaysAdmit, "second_hit": SecondHit}
