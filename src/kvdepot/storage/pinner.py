"""``ArenaPinner``: the host arena pinned on a helper thread, segment by segment.

cudaHostAlloc runs at a few GB/s: done inline, the store that first needs a new segment would
stall the engine's step; done all at registration, start-up would wait for it. So the owner
starts the pinner when a pool is registered, and stores evict (or drop and count) until memory
arrives. Unpinned (CPU-only) arenas grow inline: plain allocation costs nothing up front.

Lock: the host tier's, passed in by the owner (the engine's). ``start_locked`` expects it held;
the thread takes it only to adopt a segment, never while allocating one.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Any

from kvdepot.storage.host import HostTier


class ArenaPinner:
    """Pins ``host``'s arena in the background, from the first ``start_locked`` on."""

    def __init__(self, host: HostTier, lock: AbstractContextManager[Any]) -> None:
        self.host, self._lock = host, lock
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    def start_locked(self) -> None:
        """Pin the first segment here, so early stores find room, and the rest on a thread.
        Idempotent; a no-op for unpinned arenas."""
        if not self.host.pin_memory or self._thread is not None:
            return
        first = self.host.allocate_segment()
        if first is not None:
            self.host.add_segment(first)
        self.host.grow_inline = False
        self._thread = threading.Thread(target=self._pin_arena, name="kvdepot-arena", daemon=True)
        self._thread.start()

    def _pin_arena(self) -> None:
        while not self._closing.is_set():
            segment = self.host.allocate_segment()  # slow, so outside the lock; adoption re-checks
            if segment is None:
                return
            with self._lock:
                self.host.add_segment(segment)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the host arena is fully allocated (benchmarks; nothing else needs to wait)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        """Stop after the segment being allocated, and join the thread."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join()
