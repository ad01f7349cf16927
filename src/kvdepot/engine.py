"""``CacheEngine``: lookup / store / retrieve of whole chunks between an engine's KV pool and
kvdepot's tiers, in this process. It satisfies ``engine_api.Engine`` (whose docstring lists the
primitives and their pre- and post-conditions); thread-safe. Calls take chunk keys
(``chunk_keys(tokens)`` at the edge):

    probe(keys, skip_tokens=0, lease=None) -> Hit      lookup(...) -> int (its tokens)
    try_probe(...) -> Hit | None / try_release(lease) -> bool   never wait (None/False: busy)
    store(keys, block_ids, stream=None) -> StoreHandle
    retrieve(keys, block_ids, skip_blocks=0, num_blocks=None, lease=None, stream=None) -> int
    retrieve_by_layer(...) -> (int, LayeredLoad | None)  retrieve_async(...) -> FinishedLoad

``block_ids`` is a request's block list in token order (block ``i`` holds tokens
``[i*B, (i+1)*B)``). A store copies every chunk of ``keys`` that is not cached yet.
A retrieve writes only the blocks ``[skip_blocks, skip_blocks + num_blocks)`` — never blocks
the engine already holds — and returns how many tokens from position 0 are then valid.

On CUDA, copies run on the engine's own store/load streams: a store waits for an event on the
caller's (forward) stream and never makes the forward stream wait; a load makes the caller's
stream wait for it. Slots written by a store become visible to lookups once the copy completes;
slots read by a load stay pinned until it completes. Lease timeouts run on the engine's
``clock`` (monotonic seconds; tests pass a fake one). Its side streams come from ``streams``
(CUDA's; CPU benches and tests pass ``transfer.streams.ImmediateStreams`` to run the GPU's store
issuer and side-stream paths on a CPU pool).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvdepot.config import DepotConfig, load_config
from kvdepot.engine_api import Capabilities
from kvdepot.engine_loads import Lease, PoolLoads, PoolsOwner
from kvdepot.errors import ConfigError, LayoutError
from kvdepot.events.base import NULL_SINK, EventSink, EventSpace
from kvdepot.keys import ChunkHasher, ChunkKey, Namespace
from kvdepot.layout import PoolLayout
from kvdepot.results import EngineStats, Hit, LayeredLoad, StoreHandle
from kvdepot.storage.host import HostTier
from kvdepot.storage.manager import Lent, TierManager
from kvdepot.storage.pinner import ArenaPinner
from kvdepot.storage.promotions import Promotions
from kvdepot.transfer import MOVERS, BatchBlockMover, cuda_batch
from kvdepot.transfer.base import BlockMover, ChunkCopy, LateMove
from kvdepot.transfer.inflight import InflightTransfers
from kvdepot.transfer.numa import near_gpu
from kvdepot.transfer.plan import PoolViews
from kvdepot.transfer.streams import CUDA, StreamKit

__all__ = ["STAGED_BELOW_BYTES", "CacheEngine", "EngineStats", "Hit", "LayeredLoad", "StoreHandle"]

# Where the driver has a batched copy call, every block size goes as one DMA per run, a window
# of them per call (transfer/batch.py): on the H200 (perf-notes, run O) it matched or beat the
# staged mover at 256 KiB blocks and beat it from 1 MiB up, with no SMs and no staging memory.
# Without that call, blocks of 2 MiB and more run a DMA each near the ceiling; smaller ones are
# gathered on the device first (transfer/staged.py).
STAGED_BELOW_BYTES = 2 << 20


class CacheEngine(PoolsOwner):
    """Chunks of one KV pool geometry, cached in kvdepot's tiers.

    One lock (``_lock``, re-entrant) guards the host tier and the stats. The helpers the engine
    owns take that same lock rather than one of their own, because their callbacks touch the host
    tier: ``_transfers`` (copies in flight on side streams), ``_promotions`` (disk/Redis hits read
    into host slots) and ``_pinner`` (the host arena pinned in the background). The lock stays
    private: a caller that must not wait for it (the server's loop thread) uses ``try_probe`` and
    ``try_release``.
    """

    def __init__(
        self,
        layout: PoolLayout,
        config: DepotConfig | None = None,
        *,
        namespace: Namespace | None = None,
        mover: BlockMover | None = None,
        namespace_fields: dict[str, Any] | None = None,
        events: EventSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        streams: StreamKit = CUDA,
    ) -> None:
        self.config = config or load_config()
        if self.config.chunk_size != layout.chunk_size:
            raise ConfigError(f"config chunk_size={self.config.chunk_size} differs from the layout's {layout.chunk_size}")
        self.layout = layout
        # The namespace: config's model id and salt unless the adapter says otherwise (TP rank…).
        fields = {"model_id": self.config.model_id, "cache_salt": self.config.cache_salt, **(namespace_fields or {})}
        self.namespace = namespace or Namespace(
            kv_dtype=layout.dtype_name, geometry=layout.geometry, chunk_size=layout.chunk_size, **fields
        )
        self.hasher = ChunkHasher(self.namespace, self.config.hash_algo)
        capacity = int(self.config.host_capacity_gb * 1e9)
        if capacity < layout.chunk_bytes:
            raise ConfigError(
                f"config key 'host_capacity_gb': value {self.config.host_capacity_gb!r} cannot hold one chunk "
                f"of {layout.chunk_bytes} bytes (chunk_size={layout.chunk_size}); expected >= {layout.chunk_bytes / 1e9:.6f}"
            )
        pin = {"true": True, "false": False, "auto": torch.cuda.is_available()}[self.config.pin_host_memory]
        self.clock = clock
        # KV events (events/): the caller's sink (a server's, shared by its engines), else this
        # engine's own publisher when kv_events_endpoint is set; the tiers report to it.
        self._own_events = _own_publisher(self.config) if events is None else None
        self.events: EventSink = events or self._own_events or NULL_SINK
        self.event_space = EventSpace(self.namespace.model_id, self.namespace.cache_salt, layout.chunk_size,
                                      layout.tokens_per_block)
        try:
            self.host = HostTier(capacity, layout.chunk_bytes, pin_memory=pin, clock=clock, events=self.events)
            self.mover: BlockMover = mover or _pick_mover(self.config, layout)
            self.lower = TierManager.from_config(self.config, self.hasher.seed, self.events) if (
                self.config.disk_path or self.config.remote_url) else None
            if self.lower is not None:  # promoted chunks go down to disk as lazy jobs, read from their slots
                self.lower.copy_from_host(self._provider)
        except BaseException:
            if self._own_events is not None:
                self._own_events.close()
            raise
        self._lock = threading.RLock()
        self._pinner = ArenaPinner(self.host, self._lock)
        self._promotions = Promotions(self.host, self.lower, self._lock, self.config.lease_timeout_s,
                                      room=self._pinner.wait_for_room)
        self._transfers = InflightTransfers(self._lock, self.config.load_layers_ahead, streams,
                                            int(self.config.store_head_mib * (1 << 20)), self.config.load_layer_thread)
        self._pool_loads: list[PoolLoads] = []  # loads into pools other than the attached one
        self._views: PoolViews = PoolViews([])
        self._tokens = itertools.count(1)  # names the pins of loads and write-behind reads
        self._stats = EngineStats()

    # ---- pool registration ------------------------------------------------------------------
    @classmethod
    def for_pool(cls, pool: torch.Tensor, tokens_per_block: int, config: DepotConfig | None = None, **ns: Any) -> CacheEngine:
        """Build an engine whose layout and namespace are read from a TensorRT-LLM pool tensor."""
        config = config or load_config()
        engine = cls(PoolLayout.from_pool(pool, tokens_per_block, config.chunk_size), config, namespace_fields=ns)
        engine.register_pool(pool)
        return engine

    @classmethod
    def for_views(
        cls, views: Sequence[torch.Tensor], layout: PoolLayout, config: DepotConfig | None = None, **ns: Any
    ) -> CacheEngine:
        """Build an engine over block views an adapter made (e.g. vLLM's per-layer caches)."""
        config = config or load_config()
        engine = cls(layout, config, namespace_fields=ns)
        engine.register_views(views, layout)
        return engine

    def register_pool(self, pool: torch.Tensor) -> None:
        """(Re)attach a TensorRT-LLM pool, e.g. after a model reload. Geometry must not change."""
        layout = PoolLayout.from_pool(pool, self.layout.tokens_per_block, self.layout.chunk_size)
        self.register_views([pool.view(torch.uint8).reshape(layout.num_blocks, -1)], layout)

    def register_views(self, views: Sequence[torch.Tensor], layout: PoolLayout) -> None:
        """(Re)attach the pool as block views (``transfer.base``). Geometry must not change."""
        device = self._check_views(views, layout)
        with self._lock:
            self.wait_all()
            self.layout = layout
            self._views = PoolViews(views)  # a new copy plan: the old pool's addresses go with it
            # The arena is pinned from the GPU's CPUs (the pinner thread keeps them), so its pages
            # sit on the GPU's NUMA node: as a server's shard does (``transfer/numa.py``). Once:
            # a shard re-registers its pools often, and the pinner starts only at the first.
            with near_gpu(None if self._pinner.started else device):
                self._pinner.start_locked()
            self._transfers.attach(device)

    # ---- what it is ---------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Always: the tiers are in this process (a store or load still needs a registered pool)."""
        return True

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(layered_loads=self.can_load_by_layer(), async_loads=False)

    def chunk_keys(self, tokens: Sequence[int]) -> list[ChunkKey]:
        """The keys of ``tokens``' full chunks; their tokens are described to the KV events."""
        keys = self.hasher.chunk_keys(tokens)
        self.events.describe(keys, tokens, self.event_space)
        return keys

    def describe(self, keys: Sequence[ChunkKey], tokens: Sequence[int]) -> None:
        """Tell the KV events that ``keys[i]`` holds ``tokens[i*C:(i+1)*C]``: for callers that
        compute keys with a hasher of their own (only a described chunk is announced)."""
        self.events.describe(keys, tokens, self.event_space)

    # ---- lookup -------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[ChunkKey], *, skip_tokens: int = 0, lease: Lease | None = None) -> int:
        """End (in tokens from 0) of the run of cached chunks starting at ``skip_tokens``' chunk."""
        return self.probe(keys, skip_tokens=skip_tokens, lease=lease).tokens

    def probe(self, keys: Sequence[ChunkKey], *, skip_tokens: int = 0, lease: Lease | None = None) -> Hit:
        """Look the prefix up in host memory, then in the lower tiers.

        With ``lease``, the host chunks counted are pinned until ``release(lease)`` or the lease
        timeout, and the lower-tier chunks counted are promoted into host memory in the
        background (pinned under the same lease); ``retrieve`` with that lease waits for them.
        Without a lease nothing is pinned or promoted.
        """
        if skip_tokens < 0:
            raise LayoutError(f"skip_tokens={skip_tokens} must be >= 0")
        size = self.layout.chunk_size
        first = skip_tokens // size
        wanted = keys[first:]
        with self._lock:
            self._poll_locked()
            found = self.host.lookup(wanted, lease, self.config.lease_timeout_s)
            self._stats.lookups += 1
            self._stats.hits += found
        more = self._promotions.find(wanted, found, lease)  # outside the lock: tiers do I/O
        with self._lock:
            self._stats.hits += more
            self._stats.misses += found + more < len(wanted)
        rate = self.lower.read_rate() if more and self.lower is not None else None
        per_token = self.layout.chunk_bytes / size
        return Hit((first + found + more) * size, (first + found) * size, None if rate is None else rate / per_token)

    def try_probe(self, keys: Sequence[ChunkKey], *, skip_tokens: int = 0, lease: Lease | None = None) -> Hit | None:
        """``probe`` if it cannot block — no lower tier (its lookups do I/O) and the engine's lock
        free right now — else None, with nothing done (for a caller that must never wait)."""
        if self.lower is not None or not self._lock.acquire(blocking=False):
            return None
        try:
            return self.probe(keys, skip_tokens=skip_tokens, lease=lease)
        finally:
            self._lock.release()

    # ---- leases and promotions ---------------------------------------------------------------
    def release(self, lease: Lease) -> None:
        """Unpin what ``lease`` holds. A promotion started for it runs on (a prefetch for later
        requests) and drops the pins it adds when it finishes."""
        self._promotions.release(lease)

    def try_release(self, lease: Lease) -> bool:
        """``release`` if the engine's lock is free right now; False, with nothing done, otherwise."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self.release(lease)
            return True
        finally:
            self._lock.release()

    def wait_promotions(self, timeout: float | None = None) -> None:
        """Block until every promotion started so far has finished (tests, benchmarks, shutdown)."""
        self._promotions.wait_all(timeout)

    def promotion_done(self, lease: Lease) -> bool:
        """Whether the lower-tier part of ``lease``'s hit has been read into host memory."""
        return self._promotions.done(lease)

    def wait_promotion(self, lease: Lease) -> None:
        """Block (at most ``lease_timeout_s``) until ``lease``'s lower-tier chunks are read into
        host memory, or their promotion failed (several loads under one lease: a one-copy group)."""
        self._promotions.wait(lease)

    def promoted_chunks(self, lease: Lease) -> int | None:
        """Chunks ``lease``'s finished promotion read into host memory; None while it runs or if none."""
        return self._promotions.promoted(lease)

    # ---- store ------------------------------------------------------------------------------
    def store(self, keys: Sequence[ChunkKey], block_ids: Sequence[int], *, stream: Any = None) -> StoreHandle:
        """Copy every chunk of ``keys`` not cached yet out of ``pool[block_ids]``.

        With a lead (``_check_lead``) only the chunks the lead covers are booked before its
        copies go; the others are booked once the whole block list is checked, while the lead
        copies. Booking evicts, and on a GPU host, caches cold from the last operation's DMA,
        booking 8 chunks took ~17 of the ~74 us before a 256 KiB-block store's first copy
        (``bench bookkeeping``'s batch path with ``--sweep-mib 64``; issue 19)."""
        started = time.perf_counter()
        check = self._check_blocks(len(keys), block_ids, lead=True)
        self._check_lead(block_ids, 0, check)
        bpc = self.layout.blocks_per_chunk
        first = len(keys) if check is None else min(len(keys), -(-self._lead_blocks // bpc))
        booked = self._book(keys, block_ids, 0, first)
        if not booked and first < len(keys):  # the lead's chunks are all cached: no lead to start with
            booked, first = self._book(keys, block_ids, first, len(keys)), len(keys)
        stored = [keys[c] for c, _ in booked]

        def rollback() -> None:
            self.host.commit_many(stored, False)

        copies = [copy for _, copy in booked]
        # The lead's ids were checked as the list's positions ``start..start+lead``: it must not
        # reach past a cached chunk into later positions, whose ids are not checked yet.
        run = next((n for n, (c, _) in enumerate(booked) if c != booked[0][0] + n), len(booked))
        lead, rest = self._split_lead(copies[:run], check)
        rest += copies[run:]
        try:
            if booked and booked[0][0]:  # cached chunks first: the lead starts later
                self._check_lead(block_ids, booked[0][0] * bpc, check)
            if not booked:
                self._finish_check(check)
                return StoreHandle(self._transfers, 0, None)
        except BaseException:
            with self._lock:
                rollback()
            raise
        views, mover = self._views, self.mover
        # The lead goes first; what follows is built while it copies (``open_store``).
        start = self._transfers.open_store(stream, mover.prepare_gather(views, lead) if lead else None, rollback)

        try:
            def commit() -> None:
                self.host.commit_many(stored, True)
                if self.lower is not None:  # never blocks: a full queue drops and counts
                    for key in stored:
                        self.lower.write_behind(key, self._provider(key))

            if first < len(keys):
                whole_list = check

                def check_then_book() -> None:  # while the lead copies; a bad id books nothing more
                    whole_list()  # type: ignore[misc]
                    more = self._book(keys, block_ids, first, len(keys))
                    booked.extend(more)
                    stored.extend(keys[c] for c, _ in more)
                    rest.extend(copy for _, copy in more)

                check = check_then_book
            move = LateMove(lambda: mover.prepare_gather(views, rest))
            lead_bytes = sum(len(c.block_ids) for c in lead) * self.layout.bytes_per_block
        except BaseException:  # an interrupt: the store never reaches the tracker
            self._transfers.abandon(start)
            raise
        token = self._transfers.store(start, move, commit, lead_bytes=lead_bytes, check=check)
        with self._lock:
            self._stats.stored_chunks += len(booked)
            self._stats.bytes_stored += len(booked) * bpc * self.layout.bytes_per_block
            self._stats.store_seconds += time.perf_counter() - started
        return StoreHandle(self._transfers, len(booked), token)

    def _book(self, keys: Sequence[ChunkKey], block_ids: Sequence[int], lo: int, hi: int) -> list[tuple[int, ChunkCopy]]:
        """Book host slots for chunks ``lo..hi-1`` of a store (evicting as needed): (chunk index,
        its copy into its slot) of each one placed; a chunk already cached, or one no slot could
        be found for, is left out."""
        bpc = self.layout.blocks_per_chunk
        with self._lock:
            self._poll_locked()
            slots = self.host.reserve_many(keys[lo:hi])  # drops are counted by the tier (``stats``)
            placed = [(c, slot, self.host.span(keys[c])) for c, slot in enumerate(slots, lo) if slot is not None]
        # The copies are built outside the engine's lock: only the slots and their spans need it.
        return [(c, ChunkCopy(block_ids[c * bpc : (c + 1) * bpc], slot, 0, span)) for c, slot, span in placed]

    def _provider(self, key: ChunkKey) -> Callable[[], Lent | None]:
        """Write-behind lends a committed chunk's host slot in place, pinned until the tiers have
        written it (``Lent``). It used to copy the slot to ``bytes``: a memcpy under the GIL per
        chunk written, which stalled the engine's step loop for its length (``kvdepot bench tiers
        --parts stall``). A committed slot is never written again while pinned."""

        def read() -> Lent | None:
            pin = ("write-behind", next(self._tokens))
            with self._lock:
                if not self.host.contains(key):
                    return None
                self.host.pin(pin, [key])
                slot = self.host.slot(key)
            try:
                return Lent(memoryview(slot.numpy()), lambda: self.release(pin))
            except BaseException:
                self.release(pin)
                raise

        return read

    # ---- waiting --------------------------------------------------------------------------
    def wait_arena(self, timeout: float | None = None) -> None:
        """Block until the host arena is pinned as far ahead as it goes: all of it, or its share
        of a server's budget (benchmarks; nothing else needs to wait)."""
        self._pinner.wait(timeout)

    def poll(self) -> None:
        """Complete transfers whose copies have finished (commit stores, unpin loads)."""
        for transfers in self._all_transfers():
            transfers.poll()

    def wait_all(self) -> None:
        """Block until every transfer enqueued so far has completed."""
        for transfers in self._all_transfers():
            transfers.wait_all()

    # White-box handles for the CUDA tests.
    @property
    def _streams(self) -> tuple[Any, ...] | None:
        return self._transfers.streams

    def _side_stream(self, store: bool, caller: Any) -> Any:
        return self._transfers.side_stream(store, caller)

    # ---- checks and stats ----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Counters and a snapshot of the tiers (a copy: later calls do not change it)."""
        with self._lock:
            self._poll_locked()
            self.host.expire_leases()  # report leases past their timeout as gone, not live
            host = self.host.stats()
            s = self._stats
            s.evictions, s.dropped_stores = host.evictions, host.dropped
            s.live_leases, s.pinned_chunks = self.host.live_leases, self.host.pinned_chunks
            s.inflight_transfers = sum(len(t.inflight) for t in self._all_transfers())
            s.host_chunks, s.host_capacity_chunks = host.chunks, self.host.num_slots
            # Slots still to be pinned ahead (the arena's share); an unpinned (CPU) arena grows on demand.
            s.host_pending_chunks = self._pinner.pending_slots
            s.promoting = self._promotions.running
            s.refused_batches = self.mover.refused
            s.lower = self.lower.stats().tiers if self.lower is not None else []
            return EngineStats(**{**vars(s), "lower": list(s.lower)})

    def close(self) -> None:
        """Finish transfers, then drain write-behind and join the tier threads (outside the lock:
        write-behind providers take it)."""
        self._transfers.close()
        for loads in list(self._pool_loads):
            self.drop_loads(loads)
        self._pinner.close()
        self._promotions.close()
        if self.lower is not None:
            self.lower.close()
        if self._own_events is not None:  # after the tiers: their last reports go out first
            self._own_events.close()


def _own_publisher(config: DepotConfig) -> Any:
    """The engine's own KV-event publisher, or None when events are off (zmq imported only then)."""
    if not config.kv_events_endpoint:
        return None
    from kvdepot.events.publisher import publisher_from_config

    return publisher_from_config(config)


def _pick_mover(config: DepotConfig, layout: PoolLayout) -> BlockMover:
    """``auto``: the batch mover where the driver has its call, else by block size (the H200
    measurements in docs/perf-notes.md, run O)."""
    name = config.transfer_mover
    if name == "auto":
        if cuda_batch.available():
            name = "batch"
        else:
            name = "runs" if layout.bytes_per_block >= STAGED_BELOW_BYTES else "staged"
    if name == "batch":
        return BatchBlockMover(lanes=config.transfer_lanes)
    return MOVERS[name]()
