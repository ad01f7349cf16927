"""Copy lists for movers that hand a driver addresses: a pool's fixed at registration, an
operation's in a few numpy calls.

    PoolViews(views)                 a registered pool's block views (a list) with their plan
    plan_of(views) -> PoolPlan | None   that plan (made here for a plain list); None where a
                                     view's rows are not plain bytes (no address arithmetic)
    copy_list(plan, copies, to_host) -> CopyList   one copy per maximal run of blocks that follow
                                     each other in the pool and in the host buffers
    head_list(plan, copies, to_host, max_bytes, max_copies) -> (CopyList, bytes, rest)   a move's
                                     first copies without numpy, and the chunk parts left (one view)
    block_addresses(plan, copies) -> (pool, host)  every listed block's addresses (one view)

Why a plan: block ``b`` of view ``v`` lives at ``base[v] + b * stride[v]`` for as long as the pool
is registered, so that arithmetic is set up once (``PoolViews``, which the engine makes anew at
every registration: a plan never outlives its pool). An operation then costs one Python pass
over its chunks (each host slot's address and allocation, as the host tier gave them with the
slot, ``ChunkCopy.span``, else asked of torch) and ~15 numpy calls for one view: it used to cost
~40 calls, which at ~1-2 us each was most of a 256-block operation's host time before its first
copy (issue 19).

Where the optional C helper is built (``native.NATIVE``), one-view lists (``head_list``, and
``copy_list`` of one view) are made by it, in one call: the same lists (tests compare them with
the Python ones, ``_head_list_py`` and ``_one_view``) for ~1/5 of the host time.

A run never crosses from one allocation into another, even where two lie back to back in the
address space (pinned arena segments often do): the driver refuses such a copy
(CUDA_ERROR_INVALID_VALUE, seen on the H200 as dropped stores in the MP server).
"""

from __future__ import annotations

import array
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

from kvdepot.transfer import native
from kvdepot.transfer.base import ChunkCopy


@dataclass(frozen=True)
class PoolPlan:
    """A pool's views as address arithmetic: view ``v``'s block ``b`` at ``base[v] + b * stride[v]``,
    ``seg[v]`` bytes; in a view-major host buffer of ``n`` blocks, view ``v``'s region starts at
    ``prefix[v] * n`` (``transfer.base.view_regions``)."""

    base: np.ndarray  # [V] int64
    stride: np.ndarray  # [V] int64
    seg: np.ndarray  # [V] int64
    prefix: np.ndarray  # [V] int64
    alloc: np.ndarray  # [V] int64: each view's allocation (its storage's address)
    per_block: int  # bytes of a block over all views
    first: tuple[int, int, int] = (0, 0, 0)  # view 0's base, stride and seg as Python ints (``head_list``)

    @property
    def views(self) -> int:
        return len(self.base)


class PoolViews(list):
    """The engine's registered views, with their ``PoolPlan`` made once (registering again makes
    a new ``PoolViews``, so nothing keyed on the old pool's addresses survives it)."""

    def __init__(self, views: Sequence[torch.Tensor]) -> None:
        super().__init__(views)
        self.plan = make_plan(self)


def make_plan(views: Sequence[torch.Tensor]) -> PoolPlan | None:
    """The plan of ``views``; None where a view is not 2-D bytes with contiguous rows."""
    if not views or any(v.dim() != 2 or v.element_size() != 1 or (v.shape[1] > 1 and v.stride(1) != 1) for v in views):
        return None
    seg = np.array([v.shape[1] for v in views], dtype=np.int64)
    return PoolPlan(
        base=np.array([v.data_ptr() for v in views], dtype=np.int64),
        stride=np.array([v.stride(0) for v in views], dtype=np.int64),
        seg=seg,
        prefix=np.cumsum(seg) - seg,
        alloc=np.array([v.untyped_storage().data_ptr() for v in views], dtype=np.int64),
        per_block=int(seg.sum()),
        first=(views[0].data_ptr(), views[0].stride(0), views[0].shape[1]),
    )


def plan_of(views: Sequence[torch.Tensor]) -> PoolPlan | None:
    return views.plan if isinstance(views, PoolViews) else make_plan(views)


_NO_HOSTS: Mapping[int, torch.Tensor] = MappingProxyType({})


class CopyList:
    """Copies as one int64 table (rows: destination, source, size), so that a window of it is
    three pointers into one array for the driver, and ``ends``: each copy's end in bytes from
    the start of the move (for windows). ``hosts``: each host allocation the copies touch (its
    address) with a tensor in it, gathered in the pass that reads their addresses: a driver that
    needs pinned memory checks these, not every chunk again.

    ``of_rows`` makes one from Python lists without numpy (``array.array``), ``of_raw`` from the
    C helper's bytes: the table and ``ends`` are then made only if asked for. A numpy call costs
    5-15x its hot-loop time when an operation starts on a GPU host whose caches the last
    operation's DMA swept (issue 19)."""

    def __init__(self, table: np.ndarray, hosts: Mapping[int, torch.Tensor] = _NO_HOSTS) -> None:
        self._table: np.ndarray | None = table
        self._raw: array.array[int] | None = None
        self._ends: np.ndarray | None = None
        self.count = table.shape[1]
        self.address = table.ctypes.data if self.count else 0
        self.hosts = hosts

    @classmethod
    def of_rows(cls, dst: list[int], src: list[int], sizes: list[int],
                hosts: Mapping[int, torch.Tensor] = _NO_HOSTS) -> CopyList:
        raw = array.array("q", dst)
        raw.extend(src)
        raw.extend(sizes)
        return cls.of_raw(raw, raw.buffer_info()[0] if sizes else 0, len(sizes), hosts)

    @classmethod
    def of_raw(cls, raw: array.array[int] | bytes, address: int, count: int,
               hosts: Mapping[int, torch.Tensor] = _NO_HOSTS) -> CopyList:
        """From a buffer of three rows of ``count`` int64 at ``address``, which it keeps alive."""
        listing = cls.__new__(cls)
        listing._table, listing._raw, listing._ends = None, raw, None
        listing.count, listing.hosts, listing.address = count, hosts, address
        return listing

    @property
    def table(self) -> np.ndarray:
        if self._table is None:
            self._table = np.frombuffer(self._raw, dtype=np.int64).reshape(3, self.count)
        return self._table

    @property
    def ends(self) -> np.ndarray:
        if self._ends is None:
            self._ends = np.cumsum(self.table[2])
        return self._ends

    @property
    def dst(self) -> np.ndarray:
        return self.table[0]

    @property
    def src(self) -> np.ndarray:
        return self.table[1]

    @property
    def sizes(self) -> np.ndarray:
        return self.table[2]

    def pointers(self, lo: int) -> tuple[int, int, int]:
        """Addresses of copy ``lo``'s destination, source and size entries."""
        step = self.count * 8
        at = self.address + lo * 8
        return at, at + step, at + 2 * step


def copy_list(plan: PoolPlan, copies: Sequence[ChunkCopy], *, to_host: bool) -> CopyList:
    """One copy per maximal run of listed block segments that follow each other both in the pool
    and in the host buffers (one contiguous span on each side, in one allocation each), over all
    views in order; rows ordered for the direction (``to_host``: host <- pool)."""
    if plan.views == 1 and native.NATIVE is not None:
        return _native_list(plan, copies, to_host, _NO_LIMIT, _NO_LIMIT)[0]
    hosts: dict[int, torch.Tensor] = {}
    table = _one_view(plan, copies, to_host, hosts) if plan.views == 1 else _many_views(plan, copies, to_host, hosts)
    return CopyList(table if table is not None else np.zeros((3, 0), dtype=np.int64), hosts)


def _table(count: int, to_host: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """An empty copy table and its pool, host and size rows for the direction."""
    table = np.empty((3, count), dtype=np.int64)
    return (table, table[1], table[0], table[2]) if to_host else (table, table[0], table[1], table[2])


def _ids(ids: list[int]) -> np.ndarray:
    """Block ids as int64, packed in C (twice as fast as ``np.array`` over Python ints)."""
    return np.frombuffer(struct.pack(f"{len(ids)}q", *ids), dtype=np.int64)


def _one_view(plan: PoolPlan, copies: Sequence[ChunkCopy], to_host: bool,
              hosts: dict[int, torch.Tensor]) -> np.ndarray | None:
    """The usual case (TensorRT-LLM's cross-layer pool): block ``k`` of the move sits at
    ``base[chunk] + k * seg`` in its slot, so whether a chunk's part continues the one before
    it in the host (the same base, in the same allocation) is decided per chunk, in the one
    Python pass over the chunks; the rest is ~15 numpy calls whatever the size, written
    straight into the table."""
    seg, stride = int(plan.seg[0]), int(plan.stride[0])
    ids: list[int] = []
    counts, bases, forced = [], [], []
    last = None
    for c in copies:
        count = len(c.block_ids)
        if not count:
            continue
        at, alloc = c.addresses()
        here = (at + (c.first - len(ids)) * seg, alloc)
        if here != last:
            if ids:
                forced.append(len(ids))  # a run starts here whatever the pool does
            hosts.setdefault(alloc, c.host)
        last = here
        bases.append(here[0])
        counts.append(count)
        ids += c.block_ids
    total = len(ids)
    if not total:
        return None
    block = _ids(ids)
    starts = np.empty(total, dtype=bool)  # a run starts at block k
    starts[0] = True
    if stride == seg:  # rows back to back: consecutive ids are one span of the pool
        np.not_equal(np.diff(block), 1, out=starts[1:])
    else:
        starts[1:] = True
    if forced:
        starts[forced] = True
    run = np.flatnonzero(starts)
    table, pool_at, host_at, sizes = _table(len(run), to_host)
    np.take(np.repeat(np.array(bases, dtype=np.int64), counts), run, out=host_at)
    host_at += run * seg
    np.take(block, run, out=pool_at)
    pool_at *= stride
    pool_at += int(plan.base[0])
    np.subtract(run[1:], run[:-1], out=sizes[:-1])
    sizes[-1] = total - run[-1]
    sizes *= seg
    return table


def _many_views(plan: PoolPlan, copies: Sequence[ChunkCopy], to_host: bool,
                hosts: dict[int, torch.Tensor]) -> np.ndarray | None:
    """Per-layer views (vLLM's caches): the same arithmetic on [views, blocks] arrays, and a run
    may continue into the next view where both sides happen to be back to back."""
    ids: list[int] = []
    rows = []  # per chunk: blocks, host address, allocation, slot blocks, first - index in the move
    for c in copies:
        if len(c.block_ids):
            host = c.host
            at, alloc = c.addresses()
            hosts.setdefault(alloc, host)
            rows.append((len(c.block_ids), at, alloc, host.numel() // plan.per_block, c.first - len(ids)))
            ids += c.block_ids
    if not ids:
        return None
    meta = np.array(rows, dtype=np.int64)
    per = np.repeat(meta, meta[:, 0], axis=0)  # per block: its chunk's row
    total = len(ids)
    position = np.arange(total, dtype=np.int64) + per[:, 4]  # the block's position in its slot
    seg = plan.seg[:, None]
    host = per[:, 1] + plan.prefix[:, None] * per[:, 3] + seg * position
    pool = plan.base[:, None] + plan.stride[:, None] * _ids(ids)
    starts = np.ones(host.shape, dtype=bool)
    starts[:, 1:] = ((np.diff(pool, axis=1) != seg) | (np.diff(host, axis=1) != seg)
                     | (np.diff(per[:, 2]) != 0))
    # Across views: the last block of view v and the first of view v+1 (one allocation each side).
    starts[1:, 0] = ((pool[:-1, -1] + plan.seg[:-1] != pool[1:, 0]) | (host[:-1, -1] + plan.seg[:-1] != host[1:, 0])
                     | (plan.alloc[:-1] != plan.alloc[1:]) | (per[-1, 2] != per[0, 2]))
    run = np.flatnonzero(starts.ravel())
    table, pool_at, host_at, sizes = _table(len(run), to_host)
    np.take(pool.ravel(), run, out=pool_at)
    np.take(host.ravel(), run, out=host_at)
    sizes[:] = np.add.reduceat(np.repeat(plan.seg, total), run)
    return table


_NO_LIMIT = (1 << 63) - 1


def _native_list(plan: PoolPlan, copies: Sequence[ChunkCopy], to_host: bool, max_bytes: int,
                 max_copies: int) -> tuple[CopyList, int, list[ChunkCopy]]:
    """``head_list`` by the C helper (which keeps ``head_list``'s rules)."""
    base, stride, seg = plan.first
    raw, address, count, taken, index, k, hosts = native.NATIVE.list_one_view(  # type: ignore[union-attr]
        base, stride, seg, copies, to_host, min(max_bytes, _NO_LIMIT), min(max_copies, _NO_LIMIT))
    rest = list(copies[index + 1 if k else index :])
    if k:
        rest.insert(0, copies[index].part(k))
    return CopyList.of_raw(raw, address, count, hosts), taken, rest


def head_list(plan: PoolPlan, copies: Sequence[ChunkCopy], *, to_host: bool, max_bytes: int,
              max_copies: int) -> tuple[CopyList, int, list[ChunkCopy]]:
    """The first copies of a one-view move, about ``max_bytes`` in at most ``max_copies`` copies,
    built without numpy (by the C helper where it is built, else ``_head_list_py``); their
    bytes; and the chunk parts left.

    Why: ``copy_list`` costs ~15 numpy calls whatever the size, and on the H200's host each
    costs several microseconds when an operation starts (issue 19: 80-150 us for 256 blocks, most
    of a 256 KiB-block move's ~220 us before its first copy). A few blocks' addresses in Python
    cost ~1 us each there, so the copy engines start on them at once and copy while the rest of
    the list is built. Runs merge as in ``copy_list``; a chunk may be split between the two parts
    (its rest starts a new copy, one more than ``copy_list`` alone would make)."""
    assert plan.views == 1
    if native.NATIVE is not None:
        return _native_list(plan, copies, to_host, max_bytes, max_copies)
    return _head_list_py(plan, copies, to_host=to_host, max_bytes=max_bytes, max_copies=max_copies)


def _head_list_py(plan: PoolPlan, copies: Sequence[ChunkCopy], *, to_host: bool, max_bytes: int,
                  max_copies: int) -> tuple[CopyList, int, list[ChunkCopy]]:
    """``head_list`` in plain Python."""
    assert plan.views == 1
    base, stride, seg = plan.first  # not numpy scalars: each costs microseconds cold
    pool_at: list[int] = []
    host_at: list[int] = []
    sizes: list[int] = []
    hosts: dict[int, torch.Tensor] = {}
    taken, pool_end, host_end, last_alloc = 0, -1, -1, -1

    def listed(rest: list[ChunkCopy]) -> tuple[CopyList, int, list[ChunkCopy]]:
        rows = (host_at, pool_at, sizes) if to_host else (pool_at, host_at, sizes)
        return CopyList.of_rows(*rows, hosts), taken, rest

    for index, c in enumerate(copies):
        at, alloc = c.addresses()
        at += c.first * seg
        for k, block in enumerate(c.block_ids):
            here = base + block * stride
            joins = here == pool_end and at == host_end and alloc == last_alloc
            if taken >= max_bytes or (not joins and len(sizes) == max_copies):
                return listed([c.part(k), *copies[index + 1 :]])
            if joins:
                sizes[-1] += seg
            else:
                hosts.setdefault(alloc, c.host)
                pool_at.append(here)
                host_at.append(at)
                sizes.append(seg)
            pool_end, host_end, last_alloc = here + seg, at + seg, alloc
            at += seg
            taken += seg
    return listed([])


def block_addresses(plan: PoolPlan, copies: Sequence[ChunkCopy]) -> tuple[np.ndarray, np.ndarray]:
    """(pool, host) address of every listed block of a one-view pool, in list order: for moves
    that copy parts of blocks (a load layer by layer), which never merge."""
    assert plan.views == 1
    seg = int(plan.seg[0])
    ids: list[int] = []
    counts, bases = [], []
    for c in copies:
        if len(c.block_ids):
            bases.append(c.addresses()[0] + (c.first - len(ids)) * seg)
            counts.append(len(c.block_ids))
            ids += c.block_ids
    host = np.repeat(np.array(bases, dtype=np.int64), counts) + np.arange(len(ids), dtype=np.int64) * seg
    return _ids(ids) * int(plan.stride[0]) + int(plan.base[0]), host
