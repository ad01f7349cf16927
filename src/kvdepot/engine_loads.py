"""The load half of ``CacheEngine``: host slots -> pool blocks, whole or layer by layer.

    retrieve(keys, block_ids, skip_blocks=0, num_blocks=None, lease=None, stream=None) -> int
    retrieve_by_layer(...) -> (int, LayeredLoad | None)
    retrieve_signalled(..., on_layer) -> the same, each layer signalled as enqueued (a server's)
    retrieve_async(..., by_layer=False) -> FinishedLoad      done in the call (nothing to overlap)
    can_load_by_layer() -> bool
    PoolLoads      the same loads into one more pool: ``loads_into(pool)`` / ``drop_loads(loads)``

Its own module because it is the engine's longest path; it shares the engine's state (declared
below) and lock, and is never used apart from ``CacheEngine``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

from kvdepot.config import DepotConfig
from kvdepot.errors import LayoutError
from kvdepot.keys import ChunkKey
from kvdepot.layout import PoolLayout
from kvdepot.results import EngineStats, FinishedLoad, LayeredLoad
from kvdepot.storage.host import HostTier
from kvdepot.storage.promotions import Promotions
from kvdepot.transfer.base import BlockMover, ChunkCopy, split_lead
from kvdepot.transfer.inflight import InflightTransfers
from kvdepot.transfer.plan import PoolViews

# Loads by layer need each layer's part of a block to be one efficient copy (``can_load_by_layer``).
LAYER_PART_MIN_BYTES = 64 << 10
# A store's or a whole load's first bytes, enqueued before its block list is checked in full
# (``LoadPath._check_lead``): ~150 us of PCIe at 55 GB/s, longer than the check and the next
# window take cold (H200, run AH: 37 us and ~25 us at 256 blocks; a 4 MiB lead left the engines idle ~30 us).
LEAD_BYTES = 8 << 20

Lease = Hashable  # in-process any hashable names a lease (``engine_api.Lease``, or a server's own)


class LoadPath:
    """``CacheEngine``'s loads; the attributes are the engine's (set by its constructor)."""

    layout: PoolLayout
    host: HostTier
    mover: BlockMover
    _lock: threading.RLock
    _promotions: Promotions
    _transfers: InflightTransfers
    _views: PoolViews
    _tokens: Iterator[int]
    _stats: EngineStats

    release: Callable[[Lease], None]

    def _check_blocks(self, num_chunks: int, block_ids: Sequence[int], *, lead: bool = False) -> Callable[[], None] | None:
        """Check that ``block_ids`` can hold ``num_chunks`` chunks, and their ids. With ``lead``,
        a list longer than a lead (``LEAD_BYTES``) is only measured here: the check of its ids is
        returned, to run once the lead's copies are enqueued (``_check_lead``); else None."""
        if not self._views:
            raise LayoutError("no KV pool registered: call register_pool first")
        needed = num_chunks * self.layout.blocks_per_chunk
        if len(block_ids) < needed:
            raise LayoutError(
                f"{len(block_ids)} block ids cannot hold {num_chunks} chunks of {self.layout.chunk_size} tokens "
                f"({self.layout.tokens_per_block} per block: {needed} needed)"
            )
        if lead and self._transfers.streams is not None and needed > self._lead_blocks:
            return lambda: self.layout.check_block_ids(block_ids, distinct=True)
        self.layout.check_block_ids(block_ids, distinct=True)
        return None

    @property
    def _lead_blocks(self) -> int:
        return max(1, LEAD_BYTES // self.layout.bytes_per_block)

    def _check_lead(self, block_ids: Sequence[int], start: int, check: Callable[[], None] | None) -> None:
        """The ids of an operation's lead, ``block_ids[start:]``'s first ``_lead_blocks``, where
        the check of the whole list was put off (``check``; None: it was done). None of them may
        be one of the ``start`` ids before it: those are blocks a load must never write (the
        request's KV the engine holds, maybe shared with other requests).

        Why a lead: on a GPU host an operation starts with the CPU caches swept by the last one's
        DMA, and the first pass over a few hundred fresh block ids costs tens of microseconds
        there (issue 19) with the copy engines idle. The lead's blocks (``LEAD_BYTES``, ~150 us of
        PCIe) are checked alone and enqueued first; the whole list is checked while they copy,
        before anything else moves. So a bad id past the lead still raises ``LayoutError`` with
        nothing copied to or from a block outside the pool, listed twice within the lead, or
        before ``start``; but the lead's blocks may have been copied: a load has written its own
        chunks' bytes into them (blocks the caller gave it to fill), a store's reservations are
        undone (what they evicted stays evicted)."""
        if check is None:
            return
        lead = block_ids[start : start + self._lead_blocks]
        self.layout.check_block_ids(lead, distinct=True)
        if start and not set(lead).isdisjoint(itertools.islice(block_ids, start)):
            raise LayoutError("block ids of one request must be distinct")

    def _split_lead(self, copies: list[ChunkCopy], check: Callable[[], None] | None) -> tuple[list[ChunkCopy], list[ChunkCopy]]:
        """(lead, rest) of an operation's chunk parts: a lead only where its id check was put off."""
        return split_lead(copies, self._lead_blocks) if check is not None else ([], copies)

    @staticmethod
    def _finish_check(check: Callable[[], None] | None) -> None:
        """The check put off for a lead, where the operation ends without copying anything."""
        if check is not None:
            check()

    # ---- retrieve ---------------------------------------------------------------------------
    def retrieve(
        self, keys: Sequence[ChunkKey], block_ids: Sequence[int], *, skip_blocks: int = 0,
        num_blocks: int | None = None, lease: Lease | None = None, stream: Any = None,
    ) -> int:
        """Load cached blocks ``[skip_blocks, skip_blocks+num_blocks)`` of the request into the pool.

        Returns the end, in tokens from 0, of what is then valid (``skip_blocks * B`` if nothing
        was loaded). Loads stop at the first chunk not cached; the lease taken by ``lookup``
        guarantees the chunks it counted are still there. ``stream`` (default: the current one)
        is made to wait for the whole load.
        """
        return self._retrieve(keys, block_ids, skip_blocks, num_blocks, lease, stream, by_layer=False)[0]

    def retrieve_by_layer(
        self, keys: Sequence[ChunkKey], block_ids: Sequence[int], *, skip_blocks: int = 0,
        num_blocks: int | None = None, lease: Lease | None = None, stream: Any = None,
    ) -> tuple[int, LayeredLoad | None]:
        """``retrieve``, copied layer by layer where it can be (``can_load_by_layer``): ``stream``
        is then *not* made to wait, and the caller must wait on the returned ``LayeredLoad``
        layer by layer before each layer reads the blocks (and wholly before anything else does).
        Its first layers are enqueued in the call, the rest by the engine's layer thread, or by a
        wait that gets there first (``transfer/layered.py``); what nobody enqueued is enqueued by
        ``wait_all`` and the store handles' ``wait``.
        The load is ``None`` where it was done whole or nothing was loaded: ``stream`` then waits
        as after ``retrieve``. Raises ``TransferFailed`` where the copies cannot be enqueued
        (now, or from the load's ``wait_layer`` later)."""
        return self._retrieve(keys, block_ids, skip_blocks, num_blocks, lease, stream, by_layer=self.can_load_by_layer())

    def retrieve_signalled(
        self, keys: Sequence[ChunkKey], block_ids: Sequence[int], on_layer: Callable[[int, Any], None], *,
        skip_blocks: int = 0, num_blocks: int | None = None, lease: Lease | None = None, stream: Any = None,
    ) -> tuple[int, LayeredLoad | None]:
        """``retrieve_by_layer`` whose layers are each signalled as they are enqueued:
        ``on_layer(layer, copy stream)`` right after that layer's copies (``LayeredLoad``; a
        server's interprocess events, ``server/layer_progress.py``). Not part of the
        ``Engine`` protocol: only a server needs it."""
        return self._retrieve(keys, block_ids, skip_blocks, num_blocks, lease, stream, by_layer=self.can_load_by_layer(),
                              on_layer=on_layer)

    def retrieve_async(
        self, keys: Sequence[ChunkKey], block_ids: Sequence[int], *, skip_blocks: int = 0,
        num_blocks: int | None = None, lease: Lease | None = None, stream: Any = None, by_layer: bool = False,
    ) -> FinishedLoad:
        """``retrieve`` (``retrieve_by_layer`` with ``by_layer``) in the call: in-process a load
        is only enqueued, so there is nothing to overlap (``capabilities.async_loads`` is False)."""
        end, layered = self._retrieve(keys, block_ids, skip_blocks, num_blocks, lease, stream,
                                      by_layer=by_layer and self.can_load_by_layer())
        return FinishedLoad(end, layered)

    def can_load_by_layer(self) -> bool:
        """Whether loads can be split by layer here: a cross-layer pool (one view) on CUDA, a mover
        that copies by layer, and parts of at least ``LAYER_PART_MIN_BYTES`` (smaller copies run
        the copy engines far below PCIe speed: H200, run Q, 16 KiB host-to-device copies 0.10 of
        a plain copy, 64 KiB 0.72 and 128 KiB 0.83 including their issue)."""
        return (len(self._views) == 1 and self._views[0].is_cuda and self.layout.num_layers > 1
                and self.mover.copies_by_layer
                and self.layout.bytes_per_block // self.layout.num_layers >= LAYER_PART_MIN_BYTES)

    def _retrieve(
        self, keys: Sequence[ChunkKey], block_ids: Sequence[int], skip_blocks: int, num_blocks: int | None,
        lease: Lease | None, stream: Any, *, by_layer: bool, on_layer: Callable[[int, Any], None] | None = None,
    ) -> tuple[int, LayeredLoad | None]:
        started = time.perf_counter()
        B, bpc = self.layout.tokens_per_block, self.layout.blocks_per_chunk
        try:
            check = self._check_blocks(len(keys), block_ids, lead=not by_layer)
            # NOTE: skip_blocks is checked even without num_blocks: a negative one would index the
            # block list from its end and overwrite blocks the engine holds.
            if skip_blocks < 0 or (num_blocks is not None and num_blocks < 0):
                raise LayoutError(f"skip_blocks={skip_blocks} and num_blocks={num_blocks} must be >= 0")
            self._check_lead(block_ids, skip_blocks, check)  # the load's first blocks (where the check waits)
        except BaseException:
            # A load that raises has released its lease, wherever it failed: past this point the
            # lease's pins pass to the load's own (released with its copies), so a check that
            # fails after the lead has copied finds the lease gone; here it goes too, rather than
            # pinning the chunks until the lease times out.
            if lease is not None:
                self.release(lease)
            raise
        end_block = min(len(keys) * bpc, len(block_ids))
        if num_blocks is not None:
            end_block = min(end_block, skip_blocks + num_blocks)
        if end_block <= skip_blocks:
            if lease is not None:
                self.release(lease)  # nothing to load: the lookup's pins must not outlive the call
            self._finish_check(check)
            return skip_blocks * B, None
        self._promotions.settle(lease)  # a failed promotion is a shorter load, counted below
        pin = ("load", next(self._tokens))
        first, last = skip_blocks // bpc, -(-end_block // bpc)
        # With a lead only its chunks are pinned before its copies go; the others once the whole
        # list is checked, while the lead copies (issue 19, tenth pass: pinning and listing all
        # of a load's chunks took 16-40 us on H100 hosts before its first copy).
        now = last if check is None else min(last, -(-min(end_block, skip_blocks + self._lead_blocks) // bpc))
        with self._lock:
            self._transfers.poll_locked()
            copies = self._pin_copies(pin, keys, block_ids, first, now, skip_blocks, end_block)
            whole = now == last or len(copies) < now - first  # all of it pinned, or a miss ends the load
            if whole and lease is not None:
                self.host.release(lease)
        if not copies:
            self.release(pin)
            if num_blocks is not None:
                with self._lock:
                    self._stats.short_loads += 1
            self._finish_check(check)
            return skip_blocks * B, None
        layered = None
        if by_layer:  # the first layers now, the rest by the layer thread or the forward's waits (transfer/layered.py)
            layers = self.mover.scatter_layers(copies, self._views, self.layout.num_layers)
            layered = self._transfers.start_layered(layers, self.layout.num_layers, lambda: self.host.release(pin), stream,
                                                    on_layer)
        else:
            lead, rest = self._split_lead(copies, check)
            if not whole:
                whole_list = check

                def check_then_pin() -> None:  # while the lead copies
                    whole_list()  # type: ignore[misc]
                    with self._lock:
                        more = self._pin_copies(pin, keys, block_ids, now, last, skip_blocks, end_block)
                    copies.extend(more)
                    rest.extend(more)

                check = check_then_pin
            try:
                self._transfers.load(lambda: self.mover.scatter_many(rest, self._views), lambda: self.host.release(pin),
                                     stream, lead=(lambda: self.mover.scatter_many(lead, self._views)) if lead else None,
                                     check=check)
            finally:  # the check has pinned what it loads, or the load failed: the lease goes either way
                if not whole and lease is not None:
                    with self._lock:
                        self.host.release(lease)
        # The chunks are consecutive from ``first``: they end at the last one's end (or ``end_block``).
        loaded_blocks = min((first + len(copies)) * bpc, end_block) - skip_blocks
        with self._lock:
            self._stats.short_loads += num_blocks is not None and loaded_blocks < end_block - skip_blocks
            self._stats.loaded_chunks += len(copies)
            self._stats.layered_loads += layered is not None
            self._stats.bytes_loaded += loaded_blocks * self.layout.bytes_per_block
            self._stats.load_seconds += time.perf_counter() - started
        return (skip_blocks + loaded_blocks) * B, layered

    def _pin_copies(self, pin: tuple[str, int], keys: Sequence[ChunkKey], block_ids: Sequence[int], lo: int, hi: int,
                    skip_blocks: int, end_block: int) -> list[ChunkCopy]:
        """Pin the cached run of chunks ``lo..hi-1`` under ``pin`` (lock held), and each one's copy
        of blocks ``[skip_blocks, end_block)``; the run stops at the first chunk not cached."""
        bpc = self.layout.blocks_per_chunk
        cached = list(itertools.takewhile(self.host.contains, keys[lo:hi]))
        if cached:
            self.host.pin(pin, cached)  # one call for all: a call per chunk cost ~1 us each
        copies = []
        for c, key in enumerate(cached, lo):
            start, end = max(c * bpc, skip_blocks), min((c + 1) * bpc, end_block)  # this chunk's blocks to load
            copies.append(ChunkCopy(block_ids[start:end], self.host.slot(key), start - c * bpc, self.host.span(key)))
        return copies


class PoolLoads(LoadPath):
    """Loads from an engine's host tier into a pool other than the one attached to it.

    A one-copy TP group (``server/shard.py``) keeps one engine for every rank and loads each
    rank's pool from it. Attaching each rank's pool in turn serialized the ranks' loads: an
    attach waits for the copies in flight, and on CPU the copy itself ran under the shard's lock.
    A ``PoolLoads`` per pool shares the engine's host tier, lock, promotions, mover and counters,
    with block views and copy streams of its own, so loads into different pools run at once. The
    engine polls, waits for and closes it with its own transfers (``CacheEngine.drop_loads``)."""

    def __init__(self, engine: LoadPath, views: PoolViews, layout: PoolLayout,
                 transfers: InflightTransfers) -> None:
        self.layout, self._views, self._transfers = layout, views, transfers
        self.host, self.mover, self._lock, self._promotions = engine.host, engine.mover, engine._lock, engine._promotions
        self._tokens, self._stats, self.release = engine._tokens, engine._stats, engine.release

    @property
    def transfers(self) -> InflightTransfers:
        return self._transfers


class PoolsOwner(LoadPath):
    """``CacheEngine``'s loads into more pools than the attached one: each a ``PoolLoads``, whose
    transfers the engine polls, waits for and closes with its own."""

    config: DepotConfig
    _pool_loads: list[PoolLoads]

    def _check_views(self, views: Sequence[torch.Tensor], layout: PoolLayout) -> torch.device:
        if layout.geometry != self.layout.geometry or layout.dtype != self.layout.dtype:
            raise LayoutError(
                f"pool geometry {layout.geometry}/{layout.dtype} differs from the engine's {self.layout.geometry}/{self.layout.dtype}"
            )
        devices = {v.device for v in views}
        if len(devices) != 1:
            raise LayoutError(f"block views must live on one device, got {sorted(map(str, devices))}")
        return devices.pop()

    def loads_into(self, pool: torch.Tensor) -> PoolLoads:
        """Loads into ``pool`` beside the attached one, concurrent with loads into other pools
        (``engine_loads.PoolLoads``); ``drop_loads`` before the pool goes away."""
        layout = PoolLayout.from_pool(pool, self.layout.tokens_per_block, self.layout.chunk_size)
        views = PoolViews([pool.view(torch.uint8).reshape(layout.num_blocks, -1)])  # its copy plan, made once
        transfers = InflightTransfers(self._lock, self.config.load_layers_ahead, self._transfers.kit,
                                      layer_thread=self.config.load_layer_thread)
        transfers.attach(self._check_views(views, layout))
        loads = PoolLoads(self, views, layout, transfers)
        with self._lock:
            self._pool_loads.append(loads)
        return loads

    def drop_loads(self, loads: PoolLoads) -> None:
        """Wait for ``loads``' copies and forget it (its pool is about to go)."""
        loads.transfers.close()
        with self._lock:
            if loads in self._pool_loads:
                self._pool_loads.remove(loads)

    def _all_transfers(self) -> tuple[InflightTransfers, ...]:
        """The attached pool's transfers, then every other pool's."""
        return (self._transfers, *(loads.transfers for loads in list(self._pool_loads)))

    def _poll_locked(self) -> None:
        """Complete the finished transfers of every pool (a finished load's pins go at once)."""
        for transfers in self._all_transfers():
            transfers.poll_locked()
