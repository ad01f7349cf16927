"""The process's one engine per engine integration, in either mode, shared by its connector halves.

Engines build their connector halves concurrently (TensorRT-LLM in two threads). The worker's
cache registration attaches the engine: it creates it (a ``CacheEngine``, or a ``RemoteEngine``
registered with the server), or, on a later registration (a model reload, a new pool), keeps the
one there if it can serve the new memory (in-process: re-registered) and replaces it otherwise.
The scheduler reads ``current()`` and treats "not yet" as "no hit", so neither half ever waits on
the other.

    EngineSlot[E]()
      attach(create, keep) -> (engine, created)   keep(old): True if old now serves the new memory
      current() -> E | None                       the engine if one is attached and ready; never blocks
      destroy()                                   close and drop it (tests, shutdown)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from kvdepot.engine_api import Engine

E = TypeVar("E", bound=Engine)


class EngineSlot(Generic[E]):
    """Holds at most one engine; attaching and destroying are serialized."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engine: E | None = None

    def attach(self, create: Callable[[], E], keep: Callable[[E], bool]) -> tuple[E, bool]:
        """The engine for the memory being registered, and whether this call created it."""
        with self._lock:
            old = self._engine
            if old is not None and keep(old):
                return old, False
            if old is not None:
                self._engine = None
                old.close()
            self._engine = create()
            return self._engine, True

    def current(self) -> E | None:
        """The engine if a worker has attached one and it is ready (a remote one: registered with
        a live server); never blocks."""
        engine = self._engine
        return engine if engine is not None and engine.ready else None

    def destroy(self) -> None:
        """Close and drop the engine (tests, shutdown). Safe when there is none."""
        with self._lock:
            engine, self._engine = self._engine, None
            if engine is not None:
                engine.close()
