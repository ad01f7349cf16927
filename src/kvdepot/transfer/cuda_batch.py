"""``cuMemcpyBatchAsync``: many host<->device copies handed to the CUDA driver in one call.

torch has no batched copy: every ``copy_`` is its own driver call (~7 us of host time on the
H200's host), which is what made one DMA per block slow to issue. The driver's batch entry point
takes arrays of addresses and sizes and runs them on the copy engines in stream order. Measured on
the H200 (the retired ``tools/uva_probe.py --batch``, perf-notes run O; one plain pinned copy of the same bytes as the ceiling):
one call of 256 copies of 4 MiB reached 0.98 in either direction and 0.96 both at once; 1 MiB
copies 0.95 and 0.89; 256 KiB copies 0.82 and 0.69 (small copies still cost the engines per copy).

Called through ctypes with numpy arrays as the address lists: cuda-bindings' wrapper wants one
``CUdeviceptr`` object per address, a Python object per block on the very path this shortens.
Only the CUDA 13 entry point (``cuMemcpyBatchAsync_v2``, no failure index) is used: it is the one
measured; on older drivers ``available()`` is False and the engine picks another mover.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

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


@functools.cache
def _driver() -> tuple[Any, Any] | None:
    """(the batch entry point, cuGetErrorName) of the loaded driver, or None without them."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = getattr(lib, _SYMBOL, None)
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    return fn, lib.cuGetErrorName


def available() -> bool:
    """Whether this machine's CUDA driver has the batch entry point."""
    return _driver() is not None


def memcpy_batch(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int) -> None:
    """Enqueue copies ``src[i] -> dst[i]`` of ``sizes[i]`` bytes on ``stream`` (a raw CUDA stream
    handle, not the legacy default stream: the driver refuses it). Copies within one batch may
    run in any order, so no two may overlap; the batch as a whole is ordered on the stream."""
    if stream == 0:
        raise ValueError(f"{_SYMBOL} refuses the legacy default stream")
    arrays = [np.ascontiguousarray(a, dtype=np.uint64) for a in (dst, src, sizes)]
    count = len(arrays[0])
    if any(len(a) != count for a in arrays):
        raise ValueError(f"dst, src and sizes differ in length: {[len(a) for a in arrays]}")
    if count == 0:
        return
    driver = _driver()
    if driver is None:
        raise RuntimeError(f"this CUDA driver has no {_SYMBOL} (CUDA 13 drivers have it)")
    fn, error_name = driver
    rc = fn(*(a.ctypes.data_as(ctypes.c_void_p) for a in arrays), ctypes.c_size_t(count),
            ctypes.byref(_ATTRIBUTES), _FIRST_INDEX, ctypes.c_size_t(1), ctypes.c_void_p(stream))
    if rc != 0:
        name = ctypes.c_char_p()
        error_name(rc, ctypes.byref(name))
        raise RuntimeError(f"{_SYMBOL} failed: {(name.value or b'?').decode()} ({rc})")
