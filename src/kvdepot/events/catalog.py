"""What has been announced where: sink calls in, wire events out. Single-threaded (the
publisher's thread owns it), so it takes no lock.

A described chunk is remembered with its tokens and block hashes (``hashes.py``): while some
medium holds it, for as long as that lasts (its ``BlockRemoved`` needs the hashes); otherwise
among the last ``loose_limit`` described, so a store that comes later (write-behind, a
promotion) can still be announced. Memory: ~4 bytes per token plus ~100 per chunk held.

Several engines may report one prefix (a server's TP ranks share the keys; every rank's prefix has
the same hashes), so holdings are kept per (medium, prefix) as a set of (holder, key):
``BlockStored`` goes out for the first holding and ``BlockRemoved`` after the last has gone. A
holder is whatever names the reporting engine (``KVEventPublisher.sink(holder)``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from kvdepot.events.base import EventSpace, Medium
from kvdepot.events.hashes import BlockHasher
from kvdepot.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvdepot.keys import ChunkKey


@dataclass
class _Chunk:
    tokens: bytes  # this chunk's tokens, little-endian u32
    hashes: list[int]  # one per engine block
    parent: int | None  # the hash of the block before this chunk (None: first chunk)
    block_size: int
    holds: int = 0  # (holder, medium) pairs holding it


@dataclass
class CatalogStats:
    described: int = 0  # chunks whose tokens are known (cumulative)
    unknown: int = 0  # stores skipped: the chunk was never described (or forgotten)
    forgotten: int = 0  # described chunks dropped from the bounded loose table


Holding = tuple[Hashable, ChunkKey]  # (holder: the engine that reported it, its chunk key)


class Catalog:
    def __init__(self, loose_limit: int = 1 << 16) -> None:
        self._held: dict[ChunkKey, _Chunk] = {}
        self._loose: OrderedDict[ChunkKey, _Chunk] = OrderedDict()
        self._holders: dict[tuple[Medium, int], set[Holding]] = {}  # by (medium, last block hash)
        self._hashers: dict[tuple[str, str], BlockHasher] = {}
        self._loose_limit = loose_limit
        self.stats = CatalogStats()

    def _get(self, key: ChunkKey) -> _Chunk | None:
        chunk = self._held.get(key)
        if chunk is None:
            chunk = self._loose.get(key)
            if chunk is not None:
                self._loose.move_to_end(key)
        return chunk

    def describe(self, keys: Sequence[ChunkKey], tokens: bytes, space: EventSpace) -> None:
        """Remember the chunks ``keys`` cover in ``tokens`` (little-endian u32 bytes); a described
        prefix is skipped, so describing a prompt again costs a dict lookup per chunk."""
        size, block = space.chunk_size, space.tokens_per_block
        count = min(len(keys), len(tokens) // (4 * size))
        first, parent = 0, None
        while first < count and (known := self._get(keys[first])) is not None:
            parent, first = known.hashes[-1], first + 1
        if first == count:
            return
        hasher = self._hashers.get((space.model_id, space.cache_salt))
        if hasher is None:
            hasher = self._hashers[(space.model_id, space.cache_salt)] = BlockHasher(space.model_id, space.cache_salt)
        hashes = hasher.hashes(tokens[first * size * 4 : count * size * 4], block, parent)
        per = size // block
        for c in range(first, count):
            mine = hashes[(c - first) * per : (c - first + 1) * per]
            self._loose[keys[c]] = _Chunk(tokens[c * size * 4 : (c + 1) * size * 4], mine, parent, block)
            parent = mine[-1]
        self.stats.described += count - first
        while len(self._loose) > self._loose_limit:
            self._loose.popitem(last=False)
            self.stats.forgotten += 1

    def stored(self, holder: Hashable, medium: Medium, keys: Sequence[ChunkKey]) -> list[KVEvent]:
        """``BlockStored`` events for the chunks ``medium`` newly holds; chained neighbours merge."""
        new: list[_Chunk] = []
        for key in keys:
            chunk = self._get(key)
            if chunk is None:
                self.stats.unknown += 1
                continue
            holding = self._holders.setdefault((medium, chunk.hashes[-1]), set())
            if (holder, key) in holding:
                continue
            holding.add((holder, key))
            if not chunk.holds:
                self._held[key] = self._loose.pop(key)
            chunk.holds += 1
            if len(holding) == 1:
                new.append(chunk)
        return [_stored_event(medium, run) for run in _chained_runs(new)]

    def removed(self, holder: Hashable, medium: Medium, keys: Sequence[ChunkKey]) -> list[KVEvent]:
        """One ``BlockRemoved`` for the announced chunks of ``medium`` that no holder holds now."""
        gone: list[int] = []
        for key in keys:
            chunk = self._held.get(key)
            if chunk is None:
                continue
            holding = self._holders.get((medium, chunk.hashes[-1]))
            if not holding or (holder, key) not in holding:
                continue
            holding.discard((holder, key))
            chunk.holds -= 1
            if not chunk.holds:
                self._loose[key] = self._held.pop(key)
            if not holding:
                del self._holders[(medium, chunk.hashes[-1])]
                gone.extend(chunk.hashes)
        if not gone:
            return []
        kind, locality, ownership = medium.wire
        return [BlockRemoved(block_hashes=gone, medium=kind, locality=locality, ownership=ownership)]

    def cleared(self) -> list[KVEvent]:
        """Nothing is held any more (the descriptions stay)."""
        for key, chunk in list(self._held.items()):
            chunk.holds = 0
            self._loose[key] = chunk
        self._held.clear()
        self._holders.clear()
        return [AllBlocksCleared()]

    @property
    def held_chunks(self) -> int:
        return len(self._held)


def _chained_runs(chunks: list[_Chunk]) -> list[list[_Chunk]]:
    runs: list[list[_Chunk]] = []
    for chunk in chunks:
        last = runs[-1][-1] if runs else None
        if last is not None and chunk.parent == last.hashes[-1] and chunk.block_size == last.block_size:
            runs[-1].append(chunk)
        else:
            runs.append([chunk])
    return runs


def _stored_event(medium: Medium, run: list[_Chunk]) -> BlockStored:
    kind, locality, ownership = medium.wire
    tokens = np.frombuffer(b"".join(c.tokens for c in run), dtype="<u4").tolist()
    return BlockStored(
        block_hashes=[h for c in run for h in c.hashes], parent_block_hash=run[0].parent, token_ids=tokens,
        block_size=run[0].block_size, lora_id=None, medium=kind, lora_name=None, locality=locality, ownership=ownership,
    )
