"""The tier manager: the byte tiers below host memory (disk, then Redis), composed.

Primitives (keys are ``ChunkKey``s; payloads are a chunk's exact bytes):
    find(keys) -> int                  consecutive chunks from keys[0] held by some lower tier
    promote(keys, reserve) -> Future[int]  background: for each chunk ``reserve(key)`` offers a
                                       target (see ``Reserve``); the chunk is read from the highest
                                       tier holding it straight into the target (a copy that fails
                                       its checksum: from the next tier), then ``done(ok)``; stops
                                       at the first miss or refusal; the result is the count placed
                                       (or already there). The disk's objects are opened in the
                                       call (``DiskTier.hold``): one evicted before its read is
                                       still read
    copy_from_host(provider_of)        how to read a chunk back from host memory (promoted
                                       chunks' copies to disk are then lazy jobs)
    write_behind(key, provider) -> bool  enqueue copies of a chunk committed to host memory;
                                       False when dropped (queue full, closed); never blocks.
                                       ``provider()``: the payload, a ``Lent`` one, or None
    note_hits(keys)                    chunks reused from host memory: sightings for admission
    read_rate() -> float | None        bytes/s of finished promotions (None until measured)
    flush(); close()                   wait for queued writes; drain and join every thread

Promotion reads into the caller's memory: every tier's ``get_into`` reads and verifies the payload
in place (the disk from its held descriptor, Redis off the socket), so no fresh memory is faulted
in per chunk. Up to ``streams`` chunks of a promotion are read at once (``promote_reads.py``),
their targets finished in order. A target is always finished with ``done(ok)``, exactly once:
``ok`` only when a verified payload of exactly the target's length is in it, so a missing,
corrupt or wrong-sized chunk frees the target and ends the promotion (reads already under way
finish into their targets and are not counted).

Writes are lazy: ``provider()`` runs on the writer thread and returns the payload, or None when
the chunk is gone from host memory by then (counted as ``gone``). The engine's provider lends its
host slot in place (``Lent``: pinned until every tier has written it), so no copy of the chunk is
made under the GIL on the way down. The disk admits a chunk according to ``admission``
(``ADMISSION``): "always", or "second_hit" = only once the chunk was seen twice (stored or hit),
so one-off prompts do not cost disk bandwidth; a refused chunk's provider is remembered
(bounded) and written when its second sighting comes. Redis, shared across nodes, takes every
chunk. A chunk promoted from Redis is also copied to disk (``promote_to_disk``): a lazy job too,
read back from its host slot when written, once the owner said how (``copy_from_host``); without
that, a copy holding its payload, with its own small bound (``held_depth``). A plain job is a
key and a provider, so the queue can be deep (a depth of 32 dropped all but the first 32 chunks
of a long prompt: other nodes never saw the rest). Bounded time: ``find`` costs one in-memory
disk check and one Redis pipeline, each Redis call has the tier's timeout, and an unavailable
tier answers at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from kvdepot.config import DepotConfig
from kvdepot.errors import ConfigError
from kvdepot.events.base import NULL_SINK, EventSink
from kvdepot.keys import ChunkKey
from kvdepot.storage.admission import ADMISSION
from kvdepot.storage.base import Tier, TierStats
from kvdepot.storage.codec import Payload
from kvdepot.storage.disk import DiskTier
from kvdepot.storage.promote_reads import PromoteReads, Reserve
from kvdepot.storage.promote_reads import Target as Target
from kvdepot.storage.rate import Rate
from kvdepot.storage.redis_tier import RedisTier

logger = logging.getLogger("kvdepot")


@dataclass(frozen=True)
class Lent:
    """A payload its owner lends in place until ``release``: a committed host slot, pinned, that
    the writer sends to each tier and then gives back. Why not a copy: ``bytes`` of a 32 MiB chunk
    is a memcpy under the GIL (~5 ms on a GPU host, ~17 ms on the dev VM), and the engine's step
    loop cannot run Python meanwhile (``kvdepot bench tiers --parts stall``)."""

    payload: Payload
    release: Callable[[], None]


Provider = Callable[[], Payload | Lent | None]


class LowerTier(Tier, Protocol):
    """A byte tier that takes any bytes-like payload, batches presence checks and closes."""

    def put(self, key: ChunkKey, payload: Payload) -> bool: ...

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    def note_write_dropped(self) -> None: ...  # a write-behind copy meant for it was dropped

    def close(self) -> None: ...


class HoldingTier(LowerTier, Protocol):
    """A lower tier whose objects can be opened ahead of their read (the disk: ``DiskTier``)."""

    def hold(self, keys: Sequence[ChunkKey]) -> list[int | None]: ...

    def let_go(self, held: Sequence[int | None]) -> None: ...

    def get_into(self, key: ChunkKey, out: Payload, *, held: int | None = None) -> int | None: ...


# ---- manager --------------------------------------------------------------------------------
@dataclass
class ManagerStats:
    queued: int = 0  # write jobs accepted
    dropped: int = 0  # write jobs refused: queue full or manager closed
    deferred: int = 0  # disk writes held back by admission
    written: int = 0  # chunk copies placed in a lower tier
    write_failures: int = 0  # puts a tier refused (full, down, I/O error)
    gone: int = 0  # providers that found the chunk gone from host memory
    promoted: int = 0  # chunks placed in promotion targets (or found there already)
    tiers: list[TierStats] = field(default_factory=list)


_DEFER_MAX = 4096


class TierManager:
    """Disk and/or Redis below the host tier, with a promote pool and a write-behind queue."""

    def __init__(
        self,
        disk: HoldingTier | None = None,
        remote: LowerTier | None = None,
        *,
        admission: str = "always",
        queue_depth: int = 4096,
        held_depth: int = 32,
        writers: int = 1,
        promoters: int = 2,
        streams: int = 4,
        promote_to_disk: bool = True,
    ) -> None:
        if admission not in ADMISSION:
            raise ConfigError(f"admission {admission!r} is not one of {sorted(ADMISSION)}")
        if min(queue_depth, held_depth, writers, promoters, streams) < 1:
            raise ConfigError("queue_depth, held_depth, writers, promoters, streams must be >= 1: "
                              f"{queue_depth, held_depth, writers, promoters, streams}")
        self._from_host: Callable[[ChunkKey], Provider] | None = None  # copy_from_host
        self._held_depth, self._held = held_depth, 0  # queued copies that hold their payload
        self.disk, self.remote = disk, remote
        self.tiers: list[LowerTier] = [t for t in (disk, remote) if t is not None]
        self.promote_to_disk = promote_to_disk
        self._admission = ADMISSION[admission]()
        self._deferred: OrderedDict[ChunkKey, Provider] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = ManagerStats()
        self._closing = False  # refuse new work from callers
        self._stopped = False  # refuse internal work too (promote copies)
        self._queue: queue.Queue[tuple[ChunkKey, Provider, tuple[LowerTier, ...], bool] | None] = queue.Queue(queue_depth)
        self._pool = ThreadPoolExecutor(promoters, thread_name_prefix="kvdepot-promote")
        self._reads = PromoteReads(self.tiers, disk, streams)  # reader threads, shared by every promotion
        self._read_rate = Rate()
        self._writers = [
            threading.Thread(target=self._write_loop, name=f"kvdepot-writer-{i}", daemon=True)
            for i in range(writers if self.tiers else 0)  # no lower tier: no threads
        ]
        for thread in self._writers:
            thread.start()

    @classmethod
    def from_config(cls, config: DepotConfig, namespace: bytes, events: EventSink = NULL_SINK) -> TierManager:
        """Disk if ``disk_path`` is set, Redis if ``remote_url`` is; the tiers are the manager's
        (and report what they hold to ``events``)."""
        disk = remote = None
        if config.disk_path:
            try:
                disk = DiskTier(
                    config.disk_path, int(config.disk_capacity_gb * 1e9), namespace,
                    o_direct={"auto": None, "true": True, "false": False}[config.disk_o_direct],
                    fsync=config.disk_fsync, events=events,
                )
            except OSError as exc:
                raise ConfigError(f"config key 'disk_path': {config.disk_path!r} is not a usable directory ({exc})") from None
        if config.remote_url:
            remote = RedisTier(
                config.remote_url, namespace, timeout_s=config.remote_timeout_s,
                retry_after_s=config.remote_retry_s, ttl_s=config.remote_ttl_s,
                cluster=config.remote_cluster, secret=config.remote_secret, events=events,
            )
        return cls(
            disk, remote, admission=config.disk_admission, queue_depth=config.write_queue_depth,
            streams=config.promote_streams, promote_to_disk=config.promote_to_disk,
        )

    def copy_from_host(self, provider_of: Callable[[ChunkKey], Provider]) -> None:
        """How to read a chunk back from host memory (the owner's write-behind provider): copies
        of promoted chunks into higher tiers (Redis -> disk) are then lazy jobs like any other,
        read from the host slot when written (gone if evicted by then), not bytes held in the
        queue. Set once, before promotions start."""
        self._from_host = provider_of

    # ---- lookups and promotion -------------------------------------------------------------
    def find(self, keys: Sequence[ChunkKey]) -> int:
        """How many consecutive chunks from ``keys[0]`` some lower tier holds."""
        present = [False] * len(keys)
        for tier in self.tiers:
            todo = [i for i, hit in enumerate(present) if not hit]
            if not todo:
                break
            for i, hit in zip(todo, tier.contains_many([keys[i] for i in todo]), strict=True):
                present[i] = hit
        count = 0
        while count < len(keys) and present[count]:
            count += 1
        return count

    def promote(self, keys: Sequence[ChunkKey], reserve: Reserve) -> Future[int]:
        """Read ``keys``' payloads into the targets ``reserve`` offers, in order, in the background;
        the count placed."""
        keys = list(keys)
        held = self.disk.hold(keys) if self.disk is not None else [None] * len(keys)
        with self._lock:
            if not self._closing:
                return self._pool.submit(self._promote, keys, reserve, held, time.monotonic())
        if self.disk is not None:
            self.disk.let_go(held)
        done: Future[int] = Future()
        done.set_result(0)
        return done

    def _promote(self, keys: list[ChunkKey], reserve: Reserve, held: list[int | None], asked: float | None = None) -> int:
        placed = self._copy_down if self.promote_to_disk else _nowhere
        count, read_bytes = self._reads.run(keys, reserve, held, placed)
        if asked is not None:  # from the call: a promotion's wait behind others is part of its cost
            self._read_rate.add(read_bytes, time.monotonic() - asked)
        with self._lock:
            self._stats.promoted += count
        return count

    def read_rate(self) -> float | None:
        """Bytes per second of the promotions finished so far, from ``promote``'s call to the last
        chunk placed (a recent-weighted ratio: ``rate.Rate``); None before one read anything."""
        return self._read_rate.per_second

    def _copy_down(self, key: ChunkKey, level: int, view: memoryview) -> None:
        """Queue a copy of a chunk read from a lower tier into the tiers above it (Redis -> disk):
        read back from host memory when the writer gets to it (``copy_from_host``), so nothing
        is copied on the promotion's path; without that hook, a copy of its bytes held in the queue."""
        provider = self._from_host(key) if self._from_host is not None else _held(bytes(view))
        self._enqueue(key, provider, tuple(self.tiers[:level]), internal=True, holds=self._from_host is None)

    # ---- write-behind ----------------------------------------------------------------------
    def write_behind(self, key: ChunkKey, provider: Provider) -> bool:
        """Queue copies of a chunk just committed to host memory; False if dropped."""
        targets: list[LowerTier] = []
        with self._lock:
            if self._closing:
                self._stats.dropped += 1
                return False
            if self.disk is not None and not self.disk.contains(key):
                if self._admission.admit(key):
                    targets.append(self.disk)
                else:
                    self._defer_locked(key, provider)
            if self.remote is not None:
                targets.append(self.remote)
        return not targets or self._enqueue(key, provider, tuple(targets))

    def note_hits(self, keys: Sequence[ChunkKey]) -> None:
        """Chunks reused from host memory count as sightings; admitted deferred chunks are queued."""
        if self.disk is None:
            return
        ready = []
        with self._lock:
            for key in keys:
                if self._admission.admit(key) and key in self._deferred:
                    ready.append((key, self._deferred.pop(key)))
        for key, provider in ready:
            if not self.disk.contains(key):
                self._enqueue(key, provider, (self.disk,))

    def _defer_locked(self, key: ChunkKey, provider: Provider) -> None:
        self._stats.deferred += 1
        self._deferred[key] = provider
        self._deferred.move_to_end(key)
        if len(self._deferred) > _DEFER_MAX:
            self._deferred.popitem(last=False)

    def _enqueue(self, key: ChunkKey, provider: Provider, targets: tuple[LowerTier, ...], *, internal: bool = False,
                 holds: bool = False) -> bool:
        """``internal``: the manager's own copy (accepted while closing); ``holds``: it holds its
        payload (bounded by ``held_depth``)."""
        with self._lock:
            try:
                if self._stopped or (self._closing and not internal) or (holds and self._held >= self._held_depth):
                    raise queue.Full
                self._queue.put_nowait((key, provider, targets, holds))
                self._held += holds
            except queue.Full:
                self._stats.dropped += 1
                for tier in targets:
                    tier.note_write_dropped()
                return False
            self._stats.queued += 1
            return True

    def _write_loop(self) -> None:
        while (job := self._queue.get()) is not None:
            key, provider, targets, held = job
            try:
                self._write(key, provider, targets)
            except Exception:  # the worker boundary: a bad provider must not kill the writer
                logger.warning("write-behind of chunk %s failed", key.hex(), exc_info=True)
                with self._lock:
                    self._stats.write_failures += 1
            finally:
                if held:
                    with self._lock:
                        self._held -= 1
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, key: ChunkKey, provider: Provider, targets: tuple[LowerTier, ...]) -> None:
        missing = [tier for tier in targets if not tier.contains(key)]
        if not missing:
            return
        got = provider()  # only now: reading out of host memory is the provider's cost
        if got is None:
            with self._lock:
                self._stats.gone += 1
            return
        payload, release = (got.payload, got.release) if isinstance(got, Lent) else (got, None)
        try:
            for tier in missing:
                ok = tier.put(key, payload)
                with self._lock:
                    if ok:
                        self._stats.written += 1
                    else:
                        self._stats.write_failures += 1
        finally:
            if release is not None:
                release()

    # ---- lifecycle -------------------------------------------------------------------------
    def flush(self) -> None:
        """Block until every write queued so far is done (tests, shutdown)."""
        self._queue.join()

    def stats(self) -> ManagerStats:
        with self._lock:
            snapshot = ManagerStats(**{k: v for k, v in vars(self._stats).items() if k != "tiers"})
        snapshot.tiers = [tier.stats() for tier in self.tiers]
        return snapshot

    def close(self, drain: bool = True) -> None:
        """Stop accepting work, finish promotions, then drain (or drop) queued writes and join
        every thread; the tiers are closed too. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._pool.shutdown(wait=True, cancel_futures=not drain)
        self._reads.close()  # idle now: every promotion waited for its reads
        with self._lock:
            self._stopped = True
        if not drain:
            self._discard_queued()
        for _ in self._writers:
            self._queue.put(None)
        for thread in self._writers:
            thread.join()
        for tier in self.tiers:
            tier.close()

    def _discard_queued(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
            self._queue.task_done()
            with self._lock:
                self._stats.dropped += 1


def _held(payload: bytes) -> Provider:
    return lambda: payload


def _nowhere(key: ChunkKey, level: int, view: memoryview) -> None:
    pass
