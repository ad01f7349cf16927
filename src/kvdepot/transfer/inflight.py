"""Copies in flight on CUDA side streams, completed in order by polling their events.

    run(copy, on_done, stream, store=, on_fail=) -> token | None   run now (CPU) or enqueue (CUDA)
    poll_locked() / poll()        run ``on_done`` of every transfer whose copy has finished
    is_complete(token) / wait_for(token) / wait_all()

``on_done`` (commit a store's slots, unpin a load's) runs under the owner's lock: the tracker
holds no lock of its own but is given the lock that guards what its callbacks touch (the
engine's, which guards the host tier). ``poll_locked`` expects it held; the others take it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch


class InflightTransfers:
    """The engine's side streams and its FIFO of ``(token, event, on_done)``, oldest first."""

    def __init__(self, lock: AbstractContextManager[Any]) -> None:
        self._lock = lock  # the owner's: guards the FIFO and what the callbacks touch
        self.streams: tuple[Any, ...] | None = None  # None: CPU pool, copies run inline
        self.inflight: deque[tuple[int, Any, Callable[[], None]]] = deque()
        self._tokens = itertools.count(1)

    def attach(self, device: torch.device) -> None:
        """Make the streams for a pool on ``device``. Call with the lock held and nothing in flight."""
        if device.type == "cuda":
            # Three distinct streams from torch's pool: store, load, and a spare used when the
            # caller's own stream happens to be one of ours (torch hands pool streams out in
            # rotation, so an engine's forward stream can alias a side stream).
            self.streams = tuple(torch.cuda.Stream(device) for _ in range(3))
        else:
            self.streams = None

    def run(
        self, copy: Callable[[], None], on_done: Callable[[], None], stream: Any, *, store: bool,
        on_fail: Callable[[], None] | None = None,
    ) -> int | None:
        """Run ``copy`` now (CPU) or enqueue it on a side stream ordered after ``stream`` (CUDA).

        If ``copy`` raises, ``on_fail`` (or ``on_done``) runs first so no slot or pin leaks.
        """
        try:
            if self.streams is None:
                copy()
            else:
                caller = stream if stream is not None else torch.cuda.current_stream(self.streams[0].device)
                side = self.side_stream(store, caller)
                side.wait_stream(caller)
                with torch.cuda.stream(side):
                    copy()
                    event = torch.cuda.Event()
                    event.record(side)
        except BaseException:
            with self._lock:
                (on_fail or on_done)()
            raise
        if self.streams is None:
            with self._lock:
                on_done()
            return None
        if not store:
            caller.wait_event(event)  # the forward pass reads what the load wrote
        with self._lock:
            token = next(self._tokens)
            self.inflight.append((token, event, on_done))
        return token

    def side_stream(self, store: bool, caller: Any) -> Any:
        """The stream a copy runs on: never the caller's, or the caller would wait for it."""
        assert self.streams is not None
        side = self.streams[0 if store else 1]
        return self.streams[2] if side == caller else side

    def poll_locked(self) -> None:
        while self.inflight and self.inflight[0][1].query():
            _token, _event, on_done = self.inflight.popleft()
            on_done()

    def poll(self) -> None:
        with self._lock:
            self.poll_locked()

    def is_complete(self, token: int) -> bool:
        with self._lock:
            self.poll_locked()
            return not any(t == token for t, _, _ in self.inflight)

    def wait_for(self, token: int) -> None:
        while True:
            with self._lock:
                pending = next((e for t, e, _ in self.inflight if t == token), None)
            if pending is None:
                return
            pending.synchronize()
            with self._lock:
                self.poll_locked()

    def wait_all(self) -> None:
        with self._lock:
            while self.inflight:
                self.inflight[0][1].synchronize()
                self.poll_locked()
