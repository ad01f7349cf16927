"""The streams and events ``InflightTransfers`` works with: CUDA's, or ones whose work is done at once.

    kit.streams(device, count) -> tuple | None   the engine's side streams (None: copies run inline)
    kit.current(device) -> stream                  the calling thread's current stream
    kit.event() -> event                           record(stream) / query() / synchronize()
    kit.use(stream) -> context                     make ``stream`` (and its device) current here

``CUDA`` is the only kit the engine uses by itself. ``ImmediateStreams`` is for CPU benches and
tests (``CacheEngine(streams=ImmediateStreams())``): every copy is done by the time it has been
enqueued, so its events have always passed, yet a store still goes through the issuer thread and
a load through the side-stream path — the code paths of a GPU, with their thread hand-offs,
measured and tested on a machine without one.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch


class StreamKit(Protocol):
    def streams(self, device: torch.device, count: int) -> tuple[Any, ...] | None:
        """``count`` distinct side streams on ``device``, or None where copies run inline (CPU)."""
        ...

    def current(self, device: torch.device) -> Any: ...

    def event(self) -> Any: ...

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...


class CudaStreams:
    """torch's CUDA streams and events; a CPU pool gets none (its copies run inline)."""

    def streams(self, device: torch.device, count: int) -> tuple[Any, ...] | None:
        if device.type != "cuda":
            return None
        return tuple(torch.cuda.Stream(device) for _ in range(count))

    def current(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def event(self) -> Any:
        return torch.cuda.Event()

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        # NOTE: torch's stream context also makes the stream's device current when it is not
        return torch.cuda.stream(stream)


CUDA = CudaStreams()


class ImmediateEvent:
    """An event whose work is always done (its copies ran when they were enqueued)."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class ImmediateStream:
    """A stream on which every enqueued copy has already run: ordering is trivially kept."""

    _ids = itertools.count(1)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream_id = next(self._ids)

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> ImmediateEvent:
        return ImmediateEvent()


class ImmediateStreams:
    """Side streams for any device whose copies run synchronously when enqueued (CPU benches and
    tests). ``current`` is the thread's stream inside ``use``, else one caller stream per device."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._callers: dict[torch.device, ImmediateStream] = {}

    def streams(self, device: torch.device, count: int) -> tuple[Any, ...]:
        return tuple(ImmediateStream(device) for _ in range(count))

    def current(self, device: torch.device) -> Any:
        using = getattr(self._local, "stream", None)
        return using if using is not None else self._callers.setdefault(device, ImmediateStream(device))

    def event(self) -> ImmediateEvent:
        return ImmediateEvent()

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        before, self._local.stream = getattr(self._local, "stream", None), stream
        try:
            yield
        finally:
            self._local.stream = before
