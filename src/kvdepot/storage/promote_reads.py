"""A promotion's reads: several chunks in flight at once, their targets finished in order.

    reads = PromoteReads(tiers, disk, streams)
    reads.run(keys, reserve, held, placed) -> Promoted  the chunks of one promotion: the count
                                                    of consecutive chunks placed from the first,
                                                    and the bytes of them read
    reads.read_into(key, view, held) -> level|None  one chunk, from the highest tier that has it
    reads.close()                                   join the reader threads

Why several at once: one chunk at a time leaves every per-read cost unoverlapped — Redis's round
trip and its checksum pass, the disk's latency — and reads only one Redis Cluster master at a
time. ``streams`` reader threads (shared by all promotions) each read one chunk, on their own
connection (redis-py's pool hands each caller one).

The contract is the one-at-a-time one (``manager.TierManager.promote``): ``reserve(key)`` is
asked in key order, for at most ``streams`` chunks ahead of the oldest unfinished one; targets are
finished (``done(ok)``) in key order, each exactly once, and only once its read is over — a slot
is never freed while a read still writes into it, even when the promotion ends by an exception.
A miss or a refusal stops it: nothing more is reserved; reads already under way finish into their
targets (committed when good, not counted).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple, Protocol

from kvdepot.keys import ChunkKey
from kvdepot.storage.base import Tier
from kvdepot.storage.codec import Payload

logger = logging.getLogger("kvdepot")

Done = Callable[[bool], None]
# ``reserve(key)``: None = refused (stop); (view, done) = read the chunk into the writable
# ``view`` (exactly one chunk long), then call ``done(ok)``; (None, done) = already there.
Target = tuple[memoryview | None, Done]
Reserve = Callable[[ChunkKey], Target | None]
# ``placed(key, level, view)``: a chunk read from ``tiers[level]`` (level > 0) is in ``view``,
# its target not finished yet (the slot is still WRITING): the caller may queue copies upward.
Placed = Callable[[ChunkKey, int, memoryview], None]


class Promoted(NamedTuple):
    count: int  # consecutive chunks placed from the first (or there already)
    read_bytes: int  # of those, the bytes read from a lower tier


class HeldReads(Protocol):
    """What the reads need of the disk: objects opened ahead of their read (``DiskTier``)."""

    def get_into(self, key: ChunkKey, out: Payload, *, held: int | None = None) -> int | None: ...

    def let_go(self, held: Sequence[int | None]) -> None: ...


class PromoteReads:
    def __init__(self, tiers: Sequence[Tier], disk: HeldReads | None, streams: int) -> None:
        self.tiers, self.disk, self.streams = list(tiers), disk, streams
        self._readers = ThreadPoolExecutor(streams, thread_name_prefix="kvdepot-read")

    def run(self, keys: Sequence[ChunkKey], reserve: Reserve, held: list[int | None], placed: Placed) -> Promoted:
        """Read ``keys`` into the targets ``reserve`` offers; ``held``: the disk's descriptors per
        key (``DiskTier.hold``), every one closed by the time this returns."""
        count, nxt, read = 0, 0, 0
        stopped = failed = False  # stopped: reserve nothing more; failed: count nothing more
        reading: deque[tuple[ChunkKey, memoryview | None, Done, Future[int | None] | None]] = deque()
        try:
            while True:
                while not stopped and nxt < len(keys) and len(reading) < self.streams:
                    target = reserve(keys[nxt])
                    if target is None:
                        stopped = True
                        break
                    view, done = target
                    fd, held[nxt] = held[nxt], None
                    if view is None:  # there already: nothing to read
                        self._let_go(fd)
                        reading.append((keys[nxt], None, done, None))
                    else:
                        view = memoryview(view).cast("B")
                        reading.append((keys[nxt], view, done, self._readers.submit(self.read_into, keys[nxt], view, fd)))
                    nxt += 1
                if not reading:
                    return Promoted(count, read)
                key, view, done, future = reading.popleft()
                level = _outcome(key, future)
                try:
                    if level and view is not None:
                        placed(key, level, view)
                finally:
                    done(view is None or level is not None)
                failed = failed or (view is not None and level is None)
                stopped = stopped or failed
                count += not failed
                read += 0 if failed or view is None else view.nbytes
        finally:
            for key, view, done, future in reading:  # only after an exception: finish every target
                done(view is None or _outcome(key, future) is not None)  # once its read is over
            if self.disk is not None:
                self.disk.let_go(held)  # the chunks after a miss, a refusal or an error

    def read_into(self, key: ChunkKey, view: memoryview, held: int | None = None) -> int | None:
        """The level of the tier read once ``view`` holds ``key``'s verified payload of exactly
        ``view``'s length; None if no tier has it so (a copy that is missing or fails its
        checksum: the next tier is tried). ``held``: the disk's descriptor for ``key``, always
        closed. Runs on a reader thread."""
        for level, tier in enumerate(self.tiers):
            try:
                if tier is self.disk:
                    fd, held = held, None  # get_into closes it
                    got = self.disk.get_into(key, view, held=fd)
                else:
                    got = tier.get_into(key, view)
                if got == view.nbytes:
                    return level
            except ValueError:  # longer than a chunk: not this engine's chunk
                pass
        self._let_go(held)
        return None

    def close(self) -> None:
        """Join the reader threads (idle once every promotion has returned)."""
        self._readers.shutdown(wait=True)

    def _let_go(self, fd: int | None) -> None:
        if fd is not None and self.disk is not None:
            self.disk.let_go([fd])


def _outcome(key: ChunkKey, future: Future[int | None] | None) -> int | None:
    """The level a read found its chunk at, once the read is over (None: no read, or it failed)."""
    if future is None:
        return None
    try:
        return future.result()
    except Exception:  # the reader threads' boundary: a tier's bug is a failed read, never a lost target
        logger.warning("promotion read of chunk %s failed", key.hex(), exc_info=True)
        return None
