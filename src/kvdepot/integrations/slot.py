"""The process's one ``CacheEngine`` per engine integration, shared by its scheduler and worker.

Engines build their connector halves concurrently (TensorRT-LLM in two threads). The worker's
cache registration creates the engine (or, on a second registration after a model reload,
re-registers the existing one with the new memory); the scheduler reads ``current()`` and treats
"not yet" as "no hit", so neither half ever waits on the other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvdepot.engine import CacheEngine


class EngineSlot:
    """Holds at most one engine; creation and re-registration are serialized."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engine: CacheEngine | None = None

    def get_or_create(
        self, create: Callable[[], CacheEngine], reregister: Callable[[CacheEngine], None]
    ) -> tuple[CacheEngine, bool]:
        """The engine, and whether this call created it."""
        with self._lock:
            if self._engine is not None:
                reregister(self._engine)
                return self._engine, False
            self._engine = create()
            return self._engine, True

    def current(self) -> CacheEngine | None:
        """The engine if a worker has registered yet; never blocks."""
        return self._engine

    def destroy(self) -> None:
        """Close and drop the engine (tests, shutdown). Safe when there is none."""
        with self._lock:
            if self._engine is not None:
                self._engine.close()
            self._engine = None
