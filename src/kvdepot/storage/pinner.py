"""``ArenaPinner``: the host arena pinned ahead of use on a helper thread, up to its share.

    start_locked()             join the budget; pin the first segment here, the rest on the thread
    wait_for_room(timeout)     block (bounded) until memory is added; False at once if none is coming
    pending_slots              slots still to pin ahead (0: done, or an arena grown inline)
    wait(timeout) / close()

cudaHostAlloc runs at a few GB/s: done inline, the store that first needs a new segment would
stall the engine's step; done all at registration, start-up would wait for it. So the owner
starts the pinner when a pool is registered, and stores evict (or drop and count) until memory
arrives. Ahead of use the pinner pins the arena's *share* of the budget (``storage/budget.py``;
the whole arena without a budget, or for the only arena sharing it), so a fresh single-model
server does not drop a first big store because pinning lags, and a second model registering
later still finds its share (it reclaims it from arenas above theirs). Beyond its share an arena
grows on demand — a store found no free slot (``HostTier.on_short``), or a promotion waits for
room — from what no starving arena needs. Unpinned (CPU-only) arenas grow inline on demand: plain
allocation costs nothing up front. ``ahead=True`` runs the thread on an unpinned arena, so tests
run the CUDA behaviour on CPU.

Sharing a budget, the pinner also answers the budget's reclaim for this arena: it only *tries*
the lock and gives nothing if the arena is busy (the starving one asks again), so no lock order
exists between arenas.

Lock: the host tier's, passed in by the owner (the engine's). ``start_locked`` expects it held;
the thread takes it only to adopt a segment, never while allocating one.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from kvdepot.storage.host import HostTier

logger = logging.getLogger("kvdepot")

RETRY_S = 0.01  # a starving arena asks again after this, doubling up to MAX_RETRY_S
MAX_RETRY_S = 1.0


class Lock(Protocol):
    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...

    def release(self) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> Any: ...


class ArenaPinner:
    """Pins ``host``'s arena in the background, from the first ``start_locked`` on."""

    def __init__(self, host: HostTier, lock: Lock, *, ahead: bool | None = None) -> None:
        self.host, self._lock = host, lock
        self.ahead = host.pin_memory if ahead is None else ahead
        self._started = False
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._wake = threading.Event()  # a store was short, a promotion asks, memory came free, close
        self._room = threading.Condition()  # guards the counters below; notified after each attempt
        self._added = 0  # segments adopted by the thread
        self._asks = 0  # promotions that asked for room
        self._answered = 0  # asks answered (memory added, or none to be had)
        self._stalled = False  # the last attempt to pin ahead got no memory
        self._stopped = False  # the thread has ended (closed, or it failed)

    @property
    def started(self) -> bool:
        """Whether ``start_locked`` has run (it does its work once)."""
        return self._started

    @property
    def pending_slots(self) -> int:
        """Slots the thread still means to pin ahead (its share); 0 when stalled or not pinning ahead."""
        if self._thread is None or self._stalled or self._stopped or self._closing.is_set():
            return 0
        return max(0, self.host.target_slots() - self.host.allocated_slots)

    def start_locked(self) -> None:
        """Join the budget; pin the first segment here, so early stores find room, and the rest
        on a thread. Idempotent; unpinned arenas (without ``ahead``) start no thread."""
        if self._started:
            return
        self._started = True
        self.host.join_budget(self._give_back, self._wake.set)
        if not self.ahead:
            return
        self.host.grow_inline = False
        self.host.on_short = self._wake.set
        ahead = self.host.target_slots() - self.host.allocated_slots
        first = self.host.allocate_segment(ahead) if ahead > 0 else None
        if first is not None:
            self.host.add_segment(first)
        self._thread = threading.Thread(target=self._pin_arena, name="kvdepot-arena", daemon=True)
        self._thread.start()

    def _pin_arena(self) -> None:
        try:
            self._pin_until_closed()
        except Exception:  # noqa: BLE001 - the thread's boundary: cudaHostAlloc refused, say
            logger.exception("kvdepot: pinning the host arena failed; it keeps the memory it has")
        finally:
            self._stopped = True
            with self._room:
                self._room.notify_all()

    def _pin_until_closed(self) -> None:
        retry_s = RETRY_S
        while not self._closing.is_set():
            self._wake.clear()
            asks = self._asks
            added = self._grow_once(asks)
            with self._room:
                self._answered = asks
                self._room.notify_all()
            if added:
                retry_s = RETRY_S
                continue
            # Starving below its share: another arena may have been busy when asked; ask again later.
            self._wake.wait(retry_s if self._stalled else None)
            retry_s = min(2 * retry_s, MAX_RETRY_S) if self._stalled else RETRY_S

    def _grow_once(self, asks: int) -> bool:
        """Pin one segment: toward the arena's share, or beyond it when asked; False if none."""
        with self._lock:
            ahead = self.host.target_slots() - self.host.allocated_slots
            short = self.host.wants_segment()
        if ahead <= 0 and not (short or asks > self._answered):
            self._stalled = False
            return False
        segment = self.host.allocate_segment(ahead if ahead > 0 else None)  # slow, so outside the lock
        if segment is None:
            self._stalled = ahead > 0
            return False
        with self._lock:
            added = self.host.add_segment(segment)  # re-checks that it still fits
        self._stalled = False
        if added:
            with self._room:
                self._added += 1
        return added

    def _give_back(self, nbytes: int) -> int:
        """The budget's reclaim: whole segments back for a starving arena, if the lock is free now."""
        if not self._lock.acquire(blocking=False):
            return 0
        try:
            return self.host.give_back(nbytes)
        finally:
            self._lock.release()

    def wait_for_room(self, timeout: float) -> bool:
        """Block until the thread adds memory (True), or up to ``timeout``; False at once, or
        as soon as it finds none to add, when no memory is coming (no thread, or the arena at its
        size and the budget spent). For a promotion, which runs off the step loop and may wait."""
        if self._thread is None or self._stopped or self._closing.is_set() or timeout <= 0:
            return False
        with self._room:
            seen = self._added
            self._asks += 1
            ask = self._asks
            self._wake.set()
            self._room.wait_for(lambda: self._added != seen or self._answered >= ask or self._stopped, timeout)
            return self._added != seen

    def wait(self, timeout: float | None = None) -> None:
        """Block until the arena is pinned as far ahead as it goes (benchmarks; nothing else needs to)."""
        with self._room:
            self._room.wait_for(lambda: self.pending_slots == 0, timeout)

    def close(self) -> None:
        """Stop after the segment being allocated, and join the thread."""
        self._closing.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        with self._room:
            self._room.notify_all()
