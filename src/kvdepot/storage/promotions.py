"""Lower-tier hits promoted into host memory in the background, one promotion per lease.

    find(keys, found, lease) -> int   chunks after the host hit ``keys[:found]`` that the lower
                                      tiers hold; with ``lease``, start promoting them
    settle(lease)                     before ``lease``'s load: wait (bounded) for its promotion
    wait(lease)                       the same, leaving the promotion to the lease's loads
    done(lease) / release(lease) / wait_all(timeout) / close()

A promoted chunk is read straight into a reserved host slot (reserve; the tier reads into it, the
disk with ``get_into``; commit) and pinned under the lease that found it at commit, so the load
that follows finds it. A slot being written is WRITING: invisible to lookups and never evicted;
a failed read frees it and pins nothing. An arena whose pinner is still adding memory is waited
for (``room``, bounded by the lease timeout) rather than ending the promotion. Host-tier calls
run under the host tier's lock, which the owner passes in (the engine's); the read into a slot
runs outside it. The tables of futures are only read and written by single dict/set operations (atomic under the
GIL), so they take no lock of their own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any

from kvdepot.keys import ChunkKey
from kvdepot.storage.host import HostTier
from kvdepot.storage.manager import Reserve, Target, TierManager

logger = logging.getLogger("kvdepot")


class Promotions:
    """The engine's promotions from disk/Redis into host memory, by lease until its load takes it."""

    def __init__(
        self, host: HostTier, lower: TierManager | None, lock: AbstractContextManager[Any], lease_timeout_s: float,
        room: Callable[[float], bool] = lambda _timeout: False,
    ) -> None:
        self.host, self.lower, self._lock, self._lease_timeout_s = host, lower, lock, lease_timeout_s
        self._room = room  # waits (up to its timeout) for memory the arena's pinner adds; False: none coming
        self._by_lease: dict[Any, Future[int]] = {}  # by lease, until its load takes it
        self._running: set[Future[int]] = set()  # every promotion still running

    @property
    def running(self) -> int:
        return len(self._running)

    def find(self, keys: Sequence[ChunkKey], found: int, lease: Any) -> int:
        """How many chunks after the host hit ``keys[:found]`` the lower tiers hold.

        Bounded: tiers answer within their timeouts. With ``lease`` they are promoted in the
        background (unless the lease has a promotion already); without one nothing is promoted.
        """
        if self.lower is None:
            return 0
        self.lower.note_hits(keys[:found])
        more = self.lower.find(keys[found:]) if found < len(keys) else 0
        # One promotion per lease: a second look under the same lease (a lookup that waited for
        # the first) must not start another, which would orphan the first one's pins.
        if more and lease is not None and lease not in self._by_lease:
            future = self.lower.promote(keys[found : found + more], self._reserve(lease))
            self._by_lease[lease] = future
            with self._lock:
                self._running.add(future)
            future.add_done_callback(self._running.discard)
        return more

    def settle(self, lease: Any) -> None:
        """Take ``lease``'s promotion (its load runs now) and wait for it, up to the lease timeout."""
        self._wait(lease, self._by_lease.pop(lease, None) if lease is not None else None)

    def wait(self, lease: Any) -> None:
        """Wait, up to the lease timeout, for ``lease``'s promotion, leaving it to its load."""
        self._wait(lease, self._by_lease.get(lease))

    def _wait(self, lease: Any, promotion: Future[int] | None) -> None:
        if promotion is not None:
            try:
                promotion.result(timeout=self._lease_timeout_s)
            except Exception:  # noqa: BLE001 - a failed read is a shorter load, which the load reports
                logger.warning("kvdepot: promotion for %s failed", lease, exc_info=True)

    def done(self, lease: Any) -> bool:
        """Whether the lower-tier part of ``lease``'s hit has been read into host memory."""
        future = self._by_lease.get(lease)
        return future is None or future.done()

    def promoted(self, lease: Any) -> int | None:
        """Chunks ``lease``'s finished promotion put in host memory (0 if it failed); None while
        it runs or when there is none. A promotion can stop short (a corrupt chunk, a full arena):
        what was promised must then shrink to this, never be assumed."""
        future = self._by_lease.get(lease)
        if future is None or not future.done():
            return None
        try:
            return int(future.result())
        except Exception:  # noqa: BLE001 - a failed read promoted nothing more
            return 0

    def release(self, lease: Any) -> None:
        """Unpin what ``lease`` holds. A promotion started for it runs on (a prefetch for later
        requests) and drops the pins it adds when it finishes."""
        future = self._by_lease.pop(lease, None)
        if future is not None:
            future.add_done_callback(lambda _f: self.release(lease))
        with self._lock:
            self.host.release(lease)

    def wait_all(self, timeout: float | None = None) -> None:
        """Block until every promotion started so far has finished."""
        for future in list(self._running):
            try:
                future.result(timeout=timeout)
            except Exception:  # noqa: BLE001 - a failed promotion only means fewer prefetched chunks
                logger.debug("kvdepot: a promotion failed", exc_info=True)

    def close(self) -> None:
        """Shutdown: cancel the promotions not started yet and forget which lease started which."""
        for future in list(self._running):
            future.cancel()
        self._by_lease.clear()

    def _reserve(self, lease: Any) -> Reserve:
        """Targets for promoted chunks: a WRITING host slot each, committed and pinned under
        ``lease`` when the read succeeds, freed when it fails.

        An arena with no free slot and nothing evictable may still be growing: a fresh engine's
        pinner thread adds memory at a few GB/s, far slower than a promotion of gigabytes reads.
        Then the promotion (off the step loop) waits for that memory, up to the lease timeout in
        all, rather than stopping early; an arena at its full size, full of pinned chunks, stops
        it at once."""
        deadline: list[float] = []  # set at the promotion's first wait

        def reserve(key: ChunkKey) -> Target | None:
            while True:
                with self._lock:
                    if self.host.present(key):
                        if not self.host.contains(key):
                            return None  # another promotion writes it
                        self.host.pin(lease, [key], self._lease_timeout_s)
                        return None, _nothing
                    slot = self.host.reserve(key, count_drop=False)
                if slot is not None:
                    break
                if not deadline:
                    deadline.append(time.monotonic() + self._lease_timeout_s)
                if not self._room(deadline[0] - time.monotonic()):
                    with self._lock:  # a last try, counted as a dropped write if it fails
                        slot = self.host.reserve(key)
                    if slot is None:
                        return None
                    break

            def done(ok: bool) -> None:
                with self._lock:
                    self.host.commit(key, ok)
                    if ok:
                        self.host.pin(lease, [key], self._lease_timeout_s)

            return memoryview(slot.numpy()), done  # a slot holds exactly one chunk

        return reserve


def _nothing(ok: bool) -> None:
    pass
