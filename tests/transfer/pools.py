"""Pools, host buffers and a host-memory batch driver shared by the transfer tests."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from kvdepot.transfer.base import view_regions

DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.int8]


def random_bytes(shape, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


@st.composite
def cases(draw):
    num_blocks = draw(st.integers(1, 12))
    order = draw(st.permutations(range(num_blocks)))
    ids = order[: draw(st.integers(0, num_blocks))]  # distinct ids, random order, random count
    return dict(
        num_blocks=num_blocks,
        layers=draw(st.integers(1, 3)),
        kv=draw(st.sampled_from([1, 2])),
        elems=draw(st.integers(1, 24)),
        dtype=draw(st.sampled_from(DTYPES)),
        # one cross-layer view, one view per layer (strided), or two views of different widths
        per_layer=draw(st.sampled_from([False, True, "uneven"])),
        ids=ids,
        first=draw(st.integers(0, 3)),
        spare=draw(st.integers(0, 2)),  # host positions after the copied ones
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make_pool(c, device):
    """A pool of ``c['dtype']`` with random bytes, and its block views (uint8)."""
    gen = torch.Generator().manual_seed(c["seed"])
    pool = torch.empty(c["num_blocks"], c["layers"], c["kv"], c["elems"], dtype=c["dtype"])
    pool.view(torch.uint8).copy_(random_bytes(pool.view(torch.uint8).shape, gen))
    pool = pool.to(device)
    raw = pool.view(torch.uint8)
    if c["per_layer"] == "uneven" and c["layers"] > 1:  # segments of two sizes: layer 0, then the rest
        views = [raw[:, :1].reshape(c["num_blocks"], -1), raw[:, 1:].reshape(c["num_blocks"], -1)]
    elif c["per_layer"]:
        views = [raw[:, layer].reshape(c["num_blocks"], -1) for layer in range(c["layers"])]
    else:
        views = [raw.reshape(c["num_blocks"], -1)]
    return pool, views, gen


def host_buffer(positions: int, block_bytes: int, gen: torch.Generator, device: str) -> torch.Tensor:
    buf = random_bytes((positions * block_bytes,), gen)
    return buf.pin_memory() if device == "cuda" else buf


def run_on_side_stream(device, fn):
    if device == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        side.synchronize()
    else:
        fn()


def regions(views, buf):
    return [region.cpu().clone() for _, region in view_regions(views, buf)]


class HostDriver:
    """A ``cuda_batch.BatchDriver`` on CPU memory: each call copies at once with memmove (the copy
    engines, played synchronously), reading the copy list through the same three pointers the CUDA
    driver gets; with ``unpinned`` it calls every host buffer pageable. It records every call (rows, stream, thread), refuses call number ``refuse_call``
    (as the driver does: before copying any of it), and, with ``gate_call``, holds that call until
    ``gate`` is set (a driver call in progress, for tests of two threads)."""

    def __init__(self, refuse_call: int | None = None, gate_call: int | None = None, unpinned: bool = False) -> None:
        self.refuse_call, self.gate_call, self.unpinned = refuse_call, gate_call, unpinned
        self.pinned_checks: list[int] = []  # host allocations per ``pinned`` call
        self.gate, self.entered = threading.Event(), threading.Event()
        self.calls: list[dict[str, Any]] = []
        self.lanes: list[str] = []
        self.joins: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()

    def stream(self, views) -> Any:
        return "stream"

    def pinned(self, hosts) -> bool:
        self.pinned_checks.append(len(hosts))
        return not self.unpinned

    def lane(self, stream: Any) -> Any:
        self.lanes.append(f"lane{len(self.lanes) + 1}")
        return self.lanes[-1]

    def join(self, stream: Any, lane: Any) -> None:
        self.joins.append((stream, lane))

    def copy(self, copies, lo: int, hi: int, stream: Any) -> None:
        count = hi - lo
        dst, src, sizes = (np.ctypeslib.as_array((ctypes.c_int64 * count).from_address(p)).tolist()
                           for p in copies.pointers(lo))
        with self._lock:
            self.calls.append({"dst": dst, "src": src, "sizes": sizes, "stream": stream,
                               "thread": threading.current_thread().name})
            number = len(self.calls)
        if number == self.gate_call:
            self.entered.set()
            assert self.gate.wait(30)
        if number == self.refuse_call:
            raise RuntimeError("cuMemcpyBatchAsync_v2 failed: CUDA_ERROR_INVALID_VALUE (1)")
        for d, s, n in zip(dst, src, sizes, strict=True):
            ctypes.memmove(d, s, n)

    def bytes_moved(self) -> int:
        return sum(sum(c["sizes"]) for c in self.calls)
