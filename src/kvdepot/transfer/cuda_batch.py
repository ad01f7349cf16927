"""``cuMemcpyBatchAsync``: many host<->device copies handed to the CUDA driver in one call.

torch has no batched copy: every ``copy_`` is its own driver call (~7 us of host time on the
H200's host), which is what made one DMA per block slow to issue. The driver's batch entry point
takes arrays of addresses and sizes and runs them on the copy engines in stream order. Measured on
the H200 (the retired ``tools/uva_probe.py --batch``, perf-notes run O; one plain pinned copy of the same bytes as the ceiling):
one call of 256 copies of 4 MiB reached 0.98 in either direction and 0.96 both at once; 1 MiB
copies 0.95 and 0.89; 256 KiB copies 0.82 and 0.69 (small copies still cost the engines per copy).

Called with pointers into one int64 table (``plan.CopyList``: rows destination, source, size), so
that a window costs three additions and one foreign call: through the C helper where it is built
(``native``; 0.24 against ctypes' 0.69 us on the dev VM), else through ctypes (~1 us of Python):
cuda-bindings' wrapper wants one ``CUdeviceptr`` object per address, a Python object per block on
the very path this shortens. Only the CUDA 13 entry point (``cuMemcpyBatchAsync_v2``, no failure
index) is used: it is the one measured; on older drivers ``available()`` is False and the engine
picks another mover.

``CudaDriver`` is what the batch mover asks of the device (``BatchDriver``): the stream a move
goes on, a second stream beside it (lanes), and the call. Tests and CPU benches hand the mover
another driver (one that copies host memory, or nothing).
"""

from __future__ import annotations

import ctypes
import functools
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvdepot.transfer import native
from kvdepot.transfer.streams import current_stream

if TYPE_CHECKING:
    from kvdepot.transfer.plan import CopyList

_SYMBOL = "cuMemcpyBatchAsync_v2"
_SRC_ACCESS_ORDER_STREAM = 1  # read the source in stream order (after earlier work on the stream)


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("src_access_order", ctypes.c_int), ("src_hint", _Location), ("dst_hint", _Location),
                ("flags", ctypes.c_uint)]


# One attribute set for every copy of a batch (attrsIdxs = [0]); read-only, shared by all threads.
_ATTRIBUTES = _Attributes(_SRC_ACCESS_ORDER_STREAM)
_FIRST_INDEX = (ctypes.c_size_t * 1)(0)
_ARGS = (ctypes.addressof(_ATTRIBUTES), ctypes.addressof(_FIRST_INDEX))


@functools.cache
def _driver() -> tuple[Any, Any, int] | None:
    """(the batch entry point, cuGetErrorName, the entry point's address) of the loaded driver,
    or None without them."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = getattr(lib, _SYMBOL, None)
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    # dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream: plain ints, converted in C
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return fn, lib.cuGetErrorName, ctypes.cast(fn, ctypes.c_void_p).value


def available() -> bool:
    """Whether this machine's CUDA driver has the batch entry point."""
    return _driver() is not None


def memcpy_batch(copies: CopyList, lo: int, hi: int, stream: int) -> None:
    """Enqueue copies ``lo..hi`` of ``copies`` on ``stream`` (a raw CUDA stream handle, not the
    legacy default stream: the driver refuses it). Copies within one batch may run in any order,
    so no two may overlap; the batch as a whole is ordered on the stream. Raises RuntimeError
    with the driver's error name if it refuses the batch (it checks all of it before running any)."""
    if stream == 0:
        raise ValueError(f"{_SYMBOL} refuses the legacy default stream")
    if not 0 <= lo <= hi <= copies.count:
        raise ValueError(f"copies {lo}..{hi} are not within the list's {copies.count}")
    if hi == lo:
        return
    driver = _driver()
    if driver is None:
        raise RuntimeError(f"this CUDA driver has no {_SYMBOL} (CUDA 13 drivers have it)")
    fn, error_name, address = driver
    if native.NATIVE is not None:
        rc = native.NATIVE.batch_call(address, *copies.pointers(lo), hi - lo, *_ARGS, 1, stream)
    else:
        rc = fn(*copies.pointers(lo), hi - lo, *_ARGS, 1, stream)
    if rc != 0:
        name = ctypes.c_char_p()
        error_name(rc, ctypes.byref(name))
        raise RuntimeError(f"{_SYMBOL} failed: {(name.value or b'?').decode()} ({rc})")


class BatchDriver(Protocol):
    """What the batch mover needs of a device."""

    def stream(self, views: Sequence[torch.Tensor]) -> Any | None:
        """The current stream if the batch call can serve moves of ``views`` on it, else None
        (then the mover copies with torch)."""
        ...

    def pinned(self, hosts: Mapping[int, torch.Tensor]) -> bool:
        """Whether the batch call may copy to and from these host allocations (address -> a
        tensor in it)."""
        ...

    def lane(self, stream: Any) -> Any:
        """A second stream for moves issued on ``stream`` (made once per stream), ordered after
        ``stream``'s work so far."""
        ...

    def join(self, stream: Any, lane: Any) -> None:
        """Order ``stream``'s later work after ``lane``'s work so far."""
        ...

    def copy(self, copies: CopyList, lo: int, hi: int, stream: Any) -> None:
        """Enqueue copies ``lo..hi`` on ``stream``; RuntimeError where the driver refuses them."""
        ...


class CudaDriver:
    """The batch call on torch's current CUDA stream; lanes are torch streams, one per stream."""

    def __init__(self) -> None:
        self._lanes: dict[tuple[torch.device, int], torch.cuda.Stream] = {}
        self._lock = threading.Lock()  # a store's issuer and a load's caller make lanes at once
        self._bound = threading.local()  # devices whose context this thread has made current
        self._pinned = WeakMemo()  # allocation -> its pinned owner tensor
        self._seen = WeakMemo()  # id(buffer) -> a buffer found pinned

    def stream(self, views: Sequence[torch.Tensor]) -> Any | None:
        if not views or not views[0].is_cuda or not available():
            return None
        stream = current_stream(views[0].device)
        return None if stream.cuda_stream == 0 else stream

    def pinned(self, hosts: Mapping[int, torch.Tensor]) -> bool:
        # The batch call's copies run from pinned memory; torch copies pageable memory correctly,
        # synchronously. ``is_pinned`` asks the driver (~15 us on the H200's host as an operation
        # starts), so an allocation found pinned is remembered for as long as the tensor owning
        # it lives (an arena segment: a slot's base): while it does, its memory cannot be freed
        # and its address reused by pageable memory.
        # A buffer found pinned is remembered by itself too (a host slot's view, made once per
        # slot): then the next move that meets it reads no torch attribute, ~7 us cold against
        # ~15 for the owner's check (dev VM, caches swept), on the path to a move's first copy.
        for key, h in hosts.items():
            if self._seen.get(id(h)) is h:
                continue
            base = h._base
            owner = base if base is not None else h
            if self._pinned.get(key) is not owner:
                if h.is_cuda or not h.is_pinned():
                    return False
                with self._lock:
                    self._pinned.put(key, owner)
            with self._lock:
                self._seen.put(id(h), h)
        return True

    def lane(self, stream: Any) -> Any:
        key = (stream.device, stream.cuda_stream)
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = torch.cuda.Stream(stream.device)
        lane.wait_stream(stream)
        return lane

    def join(self, stream: Any, lane: Any) -> None:
        stream.wait_stream(lane)

    def copy(self, copies: CopyList, lo: int, hi: int, stream: Any) -> None:
        bound = self._bound.__dict__.get("devices")
        if bound is None:
            bound = self._bound.devices = set()
        if stream.device_index not in bound:
            # NOTE: a driver call needs the device's context current on this thread, which only a
            # runtime call makes it (a thread's first): without one, a thread that has so far only
            # set its stream (a store's head, an issuer with nothing to wait for) is refused (run R:
            # CUresult 1 until each thread had the context bound).
            stream.query()
            bound.add(stream.device_index)
        memcpy_batch(copies, lo, hi, stream.cuda_stream)


class WeakMemo:
    """int -> tensor, held weakly. Dead entries (allocations and buffers made and dropped by the
    thousand) are swept out whenever it has doubled since the last sweep: amortized constant time
    per entry however many stay alive (an arena's slot views may be tens of thousands). ``get``
    takes no lock (one dict read); callers serialize ``put``."""

    SWEEP_AT = 4096

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[torch.Tensor]] = {}
        self._sweep_at = self.SWEEP_AT

    def __len__(self) -> int:
        return len(self._refs)

    def get(self, key: int) -> torch.Tensor | None:
        ref = self._refs.get(key)
        return None if ref is None else ref()

    def put(self, key: int, tensor: torch.Tensor) -> None:
        if len(self._refs) >= self._sweep_at:
            self._refs = {k: r for k, r in self._refs.items() if r() is not None}
            self._sweep_at = max(self.SWEEP_AT, 2 * len(self._refs))
        self._refs[key] = weakref.ref(tensor)


CUDA_DRIVER = CudaDriver()
