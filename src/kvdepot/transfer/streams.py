"""The streams and events ``InflightTransfers`` works with: CUDA's, or ones whose work is done at once.

    kit.streams(device, count) -> tuple | None   the engine's side streams (None: copies run inline)
    kit.current(device) -> stream                  the calling thread's current stream
    kit.event() -> event                           record(stream) / query() / synchronize()
    kit.use(stream) -> context                     make ``stream`` (and its device) current here
    kit.after(stream, other)                       ``stream``'s later work waits for ``other``'s so far

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

    def after(self, stream: Any, other: Any) -> None: ...


_STREAMS: dict[tuple[int, int, int], torch.cuda.Stream] = {}  # torch Stream objects by (id, device, type)


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)`` for a device with an index, in ~1 us instead of ~6
    (H200 host, run Y): the stream's (id, device, type) straight from torch's C API, its Stream
    object made once. A stream object is only a handle: a new stream that reuses a dead one's id
    is the same stream to CUDA."""
    key = torch._C._cuda_getCurrentStream(device.index if device.index is not None else torch.cuda.current_device())
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) > 256:  # streams made and dropped by the thousand: keep it bounded
            _STREAMS.clear()
        stream = _STREAMS[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return stream


# (event, stream): what ``Event.record(stream)`` and ``stream.wait_event(event)`` end in. A CPU
# build of torch has no such C methods, and nothing here may touch ``torch.cuda.Event`` at import:
# vLLM's CPU worker replaces it with a placeholder that has none of its methods.
_RECORD = getattr(torch._C._CudaEventBase, "record", None)
_WAIT = getattr(torch._C._CudaEventBase, "wait", None)


class _Using:
    """``torch.cuda.stream(stream)`` in a third of its time (~10 us on the H200's host, twice per
    transfer): the previous streams of the current device and of ``stream``'s, set back on exit;
    torch's setter makes ``stream``'s device current while it is in use, as torch's context does."""

    __slots__ = ("_to", "_back")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._to = (stream.stream_id, stream.device_index, stream.device_type)
        self._back: tuple[tuple[int, int, int], ...] = ()

    def __enter__(self) -> None:
        here = torch._C._cuda_getDevice()
        back = (torch._C._cuda_getCurrentStream(here),)
        if self._to[1] != here:  # its device's stream first, then the current device's
            back = (torch._C._cuda_getCurrentStream(self._to[1]), *back)
        self._back = back
        torch._C._cuda_setStream(stream_id=self._to[0], device_index=self._to[1], device_type=self._to[2])

    def __exit__(self, *exc: object) -> None:
        for sid, index, kind in self._back:
            torch._C._cuda_setStream(stream_id=sid, device_index=index, device_type=kind)


class CudaStreams:
    """torch's CUDA streams and events; a CPU pool gets none (its copies run inline)."""

    def __init__(self) -> None:
        self._events = threading.local()

    def streams(self, device: torch.device, count: int) -> tuple[Any, ...] | None:
        if device.type != "cuda":
            return None
        return tuple(torch.cuda.Stream(device) for _ in range(count))

    def current(self, device: torch.device) -> Any:
        return current_stream(device)

    def event(self) -> Any:
        return torch.cuda.Event()

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return _Using(stream)

    def after(self, stream: Any, other: Any) -> None:
        # ``stream.wait_stream(other)`` with one event per thread and device, recorded again each
        # time (a wait holds the record it was enqueued after), not a new event per transfer; by
        # torch's C methods, under the three Python frames of its wrappers, since every store and
        # load makes this call before its first copy (issue 19).
        events = self._events.__dict__.get("by_device")
        if events is None:
            events = self._events.by_device = {}
        event = events.get(other.device_index)
        if event is None:
            event = events[other.device_index] = torch.cuda.Event()
        if _RECORD is None or _WAIT is None:  # NOTE: a torch without CUDA's C event methods
            event.record(other)
            stream.wait_event(event)
        else:
            _RECORD(event, other)
            _WAIT(event, stream)


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

    def after(self, stream: Any, other: Any) -> None:
        pass

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        before, self._local.stream = getattr(self._local, "stream", None), stream
        try:
            yield
        finally:
            self._local.stream = before
