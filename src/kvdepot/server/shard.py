"""What the server caches: model groups, and per TP rank a shard (one ``CacheEngine``).

    Group    one model (model id + cache salt): its geometry, TP size and key namespace; a worker
             whose geometry differs is refused. ``lookup`` hits only where *every* rank holds the
             chunk, so a TP engine never loads a prefix that some rank lacks. Every shard's host
             arena draws on the server's one ``Budget`` (``storage/budget.py``), a fair
             share each.
    Shard    one rank of a group: a ``CacheEngine`` whose host tier outlives clients. Workers of
             several engine instances may register the same rank; their pools differ, so each copy
             attaches the caller's pool to the engine first (``register_pool``), serialized by
             the shard's lock. Attaching only happens when the pool changes.

One copy (``Register.one_copy``: KV the same on every rank, MLA's latent): the group has a single
shard that every rank's registration uses, so a chunk is stored once (a second rank's store of it
is a duplicate, skipped) and loaded into each rank's pool through a ``PoolLoads`` of that pool
(``CacheEngine.loads_into``), under a lock per pool: the ranks' loads run at once (attaching
each rank's pool in turn serialized them). Each load pins its own slots; the lookup's lease is
released by the last rank's load to have pinned them, so every rank finds the copy. The group is
complete once every rank has registered; its shard keeps the whole host share.

Keys are rank-free (``namespace.mp_namespace``); the shard a chunk lives in supplies the rank, so
the server's object identity is (key, rank) — in host memory by engine, on disk and in Redis by
the engine's rank-specific namespace digest (``ONE_COPY_RANK`` for a one-copy group's shard, so
its objects never mix with one rank's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

from kvdepot.config import DepotConfig
from kvdepot.engine import CacheEngine, StoreHandle
from kvdepot.engine_loads import LoadPath, PoolLoads
from kvdepot.events.base import NULL_SINK
from kvdepot.events.publisher import KVEventPublisher
from kvdepot.keys import ChunkHasher, ChunkKey
from kvdepot.layout import PoolLayout
from kvdepot.server.copy_fence import OPEN, Admission
from kvdepot.server.layer_progress import LayerIssuer
from kvdepot.server.namespace import mp_namespace
from kvdepot.server.protocol import ErrorCode, ProtocolError, Register
from kvdepot.storage.budget import Budget
from kvdepot.transfer.layered import LayerWaits
from kvdepot.transfer.numa import near_gpu

logger = logging.getLogger("kvdepot")

ONE_COPY_RANK = -1  # the namespace rank of a one-copy group's shard: "every rank"


class Shard:
    """One TP rank of one model: a ``CacheEngine`` plus the lock that serializes pool swaps."""

    def __init__(self, layout: PoolLayout, config: DepotConfig, group: Group, rank: int,
                 device: int | None = None) -> None:
        self.group, self.rank = group, rank
        # Keys on the wire are rank-free; the engine's own namespace names the rank, so its disk
        # and Redis objects (stored under the namespace digest) never mix two ranks' bytes.
        namespace = dataclasses.replace(group.hasher.namespace, tp_rank=ONE_COPY_RANK if group.one_copy else rank)
        # Every shard reports to the server's one publisher, as its own holder (events/catalog.py).
        events = group.events.sink((group.name, rank)) if group.events is not None else NULL_SINK
        self.engine = CacheEngine(layout, config, namespace=namespace, events=events)
        self.engine.host.share_budget(group.budget)  # the server's one host budget, for every group
        self.lock = threading.Lock()
        self._loads: dict[Hashable, int] = {}  # one-copy group: loads so far under each lease
        self._loads_lock = threading.Lock()  # dict operations only: forget() never waits on a copy
        self._pools: dict[torch.Tensor, tuple[PoolLoads, threading.Lock]] = {}  # one-copy group: by rank pool
        self.issuer = LayerIssuer(f"kvdepot-layers-{rank}")  # loads answered early: the rest of their layers
        self._attached: torch.Tensor | None = None
        self._placeholder = torch.empty(
            (1, layout.num_layers, layout.kv_factor, layout.block_elems), dtype=layout.dtype, device="meta"
        )
        # Attaching starts the engine's arena pinning (CUDA hosts): from registration on rather
        # than from the first store, so fewer copies run next to cudaHostAlloc; and on the GPU's
        # NUMA node, since the pinning thread allocates (and inherits this thread's CPUs).
        with near_gpu(device):
            self._detach_locked()

    def _attach(self, pool: torch.Tensor) -> None:
        if self._attached is not pool:
            self.engine.register_pool(pool)
            self._attached = pool

    def _detach_locked(self) -> None:
        self.engine.register_pool(self._placeholder)  # waits for in-flight copies first
        self._attached = None

    def detach(self, pool: torch.Tensor) -> None:
        """Drop the engine's references to ``pool`` (its mapping is about to close)."""
        with self.lock:
            loads = self._pools.pop(pool, None)
            if self._attached is pool:
                self._detach_locked()
            else:
                self.engine.wait_all()
        if loads is not None:
            with loads[1]:  # after the load into it that may be running
                self.engine.drop_loads(loads[0])

    def close(self) -> None:
        """Finish the engine's work and give its host memory back to the server's budget."""
        self.issuer.close()
        self._pools.clear()
        self.engine.close()
        self.engine.host.close()

    def store(
        self, pool: torch.Tensor, keys: Sequence[ChunkKey], block_ids: Sequence[int], stream: object = None,
        *, transient: bool = False, admission: Admission = OPEN,
    ) -> StoreHandle:
        """Store from ``pool``; a ``transient`` pool (a bytes payload) is detached at once.
        ``admission`` is entered right before the copy; the caller leaves it once the copy is over."""
        with self.lock:
            self._attach(pool)
            admission.enter()
            handle = self.engine.store(keys, block_ids, stream=stream)
            if transient:
                self._detach_locked()
            return handle

    def retrieve(
        self, pool: torch.Tensor, keys: Sequence[ChunkKey], block_ids: Sequence[int], skip_blocks: int,
        num_blocks: int | None, lease: Hashable | None, stream: object = None,
        after: Callable[[LayerWaits | None], None] | None = None,
        *, on_layer: Callable[[int, Any], None] | None = None, transient: bool = False, admission: Admission = OPEN,
    ) -> int:
        """Load; ``after(load)`` runs under the lock once the copy is enqueued (record events):
        ``load`` is the layered load where one was asked for and the engine made one (``stream``
        was then not made to wait), else None. A load by layer is asked for by its signal of each
        layer, ``on_layer(layer, copy stream)``, made right after that layer's copies: a client
        waits on nothing else (``layer_progress``). A one-copy group loads a rank's pool under
        that pool's own lock, beside the other ranks' loads. ``admission`` is entered right
        before the copy (after any wait for a promotion); the caller leaves it."""
        shared = self.group.one_copy and lease is not None  # the lookup's lease: _loaded() releases it
        args = dict(skip_blocks=skip_blocks, num_blocks=num_blocks, lease=None if shared else lease, stream=stream)
        if self.engine.config.load_by_layer != "auto":
            on_layer = None
        try:
            if self.group.one_copy and not transient:
                with self._pool_lock(pool) as loads:
                    if shared:
                        self.engine.wait_promotion(lease)  # its lower-tier chunks, read into host memory
                    admission.enter()
                    return _load(loads, keys, block_ids, args, after, on_layer)
            with self.lock:
                self._attach(pool)
                if shared:
                    self.engine.wait_promotion(lease)  # its lower-tier chunks, read into host memory
                admission.enter()
                end = _load(self.engine, keys, block_ids, args, after, on_layer)
                if transient:
                    self._detach_locked()
                return end
        finally:
            if shared:
                self._loaded(lease)

    @contextlib.contextmanager
    def _pool_lock(self, pool: torch.Tensor) -> Iterator[PoolLoads]:
        """Hold ``pool``'s own lock (one-copy group), with its ``PoolLoads``, made at its first load."""
        with self.lock:
            entry = self._pools.get(pool)
            if entry is None:
                entry = self._pools[pool] = (self.engine.loads_into(pool), threading.Lock())
        with entry[1]:
            yield entry[0]

    def _loaded(self, lease: Hashable) -> None:
        """One more rank's load under ``lease`` has pinned its slots (or failed): at the last
        one, the lookup's pins are no longer needed."""
        with self._loads_lock:
            count = self._loads.get(lease, 0) + 1
            last = count >= self.group.tp_size
            if last:
                self._loads.pop(lease, None)
            else:
                self._loads[lease] = count
        if last:
            self.engine.release(lease)

    def forget(self, lease: Hashable) -> None:
        """The lease was released: no more loads count under it."""
        with self._loads_lock:
            self._loads.pop(lease, None)


class Group:
    """One model's shards; the first registration fixes its geometry and TP size."""

    def __init__(self, msg: Register, layout: PoolLayout, config: DepotConfig, budget: Budget | None = None,
                 events: KVEventPublisher | None = None) -> None:
        self.budget = budget
        self.model_id, self.cache_salt = msg.model_id, msg.cache_salt
        self.events = events
        self.name = msg.model_id + (f"#{msg.cache_salt}" if msg.cache_salt else "")
        self.geometry, self.dtype, self.tp_size = layout.geometry, layout.dtype, msg.tp_size
        self.one_copy = _one_copy(msg, config)
        self.ranks: set[int] = set()  # registered so far (a one-copy group has one shard for all)
        namespace = mp_namespace(msg.model_id, layout.dtype_name, layout.geometry, layout.chunk_size, msg.tp_size, msg.cache_salt)
        self.hasher = ChunkHasher(namespace, config.hash_algo)
        # The shards' capacities split the server's host budget: as the budget's weights, they give
        # every group an equal share, split equally among its ranks (one chunk per rank at least).
        # The disk budget needs no split: every tier under one disk_path shares it (storage/disk_budget.py).
        copies = 1 if self.one_copy else msg.tp_size
        per_rank = max(config.host_capacity_gb / copies, (layout.chunk_bytes + 64) / 1e9)
        self.config = dataclasses.replace(
            config, host_capacity_gb=per_rank,
            model_id=msg.model_id, cache_salt=msg.cache_salt,
        )
        self.shards: dict[int, Shard] = {}
        self._lock = threading.Lock()

    def check(self, msg: Register, layout: PoolLayout) -> None:
        one_copy = _one_copy(msg, self.config)
        if (layout.geometry, layout.dtype, msg.tp_size, one_copy) != (self.geometry, self.dtype, self.tp_size, self.one_copy):
            raise ProtocolError(
                ErrorCode.GEOMETRY_MISMATCH,
                f"model {self.name!r} is registered with geometry (layers, kv_factor, block_elems, "
                f"element_size, tokens_per_block)={self.geometry}, dtype {self.dtype}, tp_size {self.tp_size}, "
                f"one_copy {self.one_copy}; this worker has {layout.geometry}, {layout.dtype}, tp_size "
                f"{msg.tp_size}, one_copy {one_copy} (tp_kv_copies). Workers of one "
                "model must agree: give a different model a different model_id (or cache_salt)",
            )

    def shard(self, rank: int, layout: PoolLayout, device: int | None = None) -> Shard:
        """Rank ``rank``'s shard, made by its first registration (``device``: its pool's GPU); in a
        one-copy group every rank's is the one shard (kept under 0)."""
        slot = 0 if self.one_copy else rank
        with self._lock:
            shard = self.shards.get(slot)
            if shard is None:
                shard = self.shards[slot] = Shard(layout, self.config, self, slot, device)
            self.ranks.add(rank)
            return shard

    def close(self) -> None:
        """Close every shard (no session uses the group any more)."""
        for shard in list(self.shards.values()):
            shard.close()

    @property
    def complete(self) -> bool:
        return len(self.ranks) == self.tp_size

    def probe(self, keys: Sequence[ChunkKey], skip_tokens: int, lease: Hashable) -> tuple[int, int]:
        """(end of the run every rank holds, end of the part every rank has in host memory now).

        Both are 0 until every rank has registered. Lower-tier chunks counted are promoted into
        host memory in the background under ``lease`` (see ``CacheEngine.probe``).
        """
        if not self.complete:
            return 0, 0
        hits = [s.engine.probe(keys, skip_tokens=skip_tokens, lease=lease) for s in list(self.shards.values())]
        return min(h.tokens for h in hits), min(h.host_tokens for h in hits)

    def try_probe(self, keys: Sequence[ChunkKey], skip_tokens: int, lease: Hashable) -> tuple[int, int] | None:
        """``probe`` if it cannot block — every rank's engine answers ``try_probe`` (no lower tier,
        lock free right now) — else None. A rank probed before a busy one keeps its pins under
        ``lease`` until the blocking ``probe`` that follows replaces them."""
        if not self.complete:
            return 0, 0
        hits = []
        for shard in list(self.shards.values()):
            hit = shard.engine.try_probe(keys, skip_tokens=skip_tokens, lease=lease)
            if hit is None:
                return None
            hits.append(hit)
        return min(h.tokens for h in hits), min(h.host_tokens for h in hits)

    def try_release(self, lease: Hashable) -> bool:
        """``release`` on every rank whose engine is free right now; False where one was busy
        (the caller then releases, idempotently, where it may wait)."""
        released = all(shard.engine.try_release(lease) for shard in list(self.shards.values()))
        if released and self.one_copy:
            for shard in list(self.shards.values()):
                shard.forget(lease)
        return released

    def promotions_done(self, lease: Hashable) -> bool:
        return all(s.engine.promotion_done(lease) for s in list(self.shards.values()))

    def promoted_chunks(self, lease: Hashable) -> int | None:
        """Chunks promoted for ``lease`` on every rank (the fewest); None if a rank has no result."""
        counts = [s.engine.promoted_chunks(lease) for s in list(self.shards.values())]
        return None if not counts or any(c is None for c in counts) else min(counts)  # type: ignore[type-var]

    def release(self, lease: Hashable) -> None:
        for shard in list(self.shards.values()):
            shard.engine.release(lease)
            if self.one_copy:
                shard.forget(lease)


def _load(loads: LoadPath, keys: Sequence[ChunkKey], block_ids: Sequence[int], args: dict[str, Any],
          after: Callable[[LayerWaits | None], None] | None, on_layer: Callable[[int, Any], None] | None) -> int:
    """One load (by layer, each layer signalled, where ``on_layer`` asks), then ``after(layered
    load or None)``; its end in tokens."""
    load = None
    if on_layer is not None:
        end, load = loads.retrieve_signalled(keys, block_ids, on_layer, **args)
    else:
        end = loads.retrieve(keys, block_ids, **args)
    if after is not None:
        after(load)
    return end


def _one_copy(msg: Register, config: DepotConfig) -> bool:
    """One copy for every rank: what the worker declared (its ``tp_kv_copies``), unless this
    server's ``tp_kv_copies`` is per-rank (always safe: each rank's bytes kept apart)."""
    return msg.one_copy and msg.tp_size > 1 and config.tp_kv_copies != "per-rank"


