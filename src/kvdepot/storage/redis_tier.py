"""The Redis/Valkey tier: one value per chunk, shared by every engine that speaks the same namespace.

* **One value per chunk**: ``codec.encode`` (header + payload) under
  ``<prefix>:<namespace hex>:<key hex>``. Only single-key commands (GET, SET, EXISTS, DEL;
  pipelines without MULTI), so Redis Cluster and Valkey can stand behind the same keys.
  Namespaces never mix: another model, dtype, geometry or salt has another key prefix, and a
  value is served only if its header names this namespace and key and its checksum holds.
* **Bounded calls**: every socket operation has ``timeout_s``; redis-py's own retries are off.
* **Outages are values**: a connection error or timeout marks the tier down for
  ``retry_after_s``; meanwhile calls return at once (get -> None, contains -> False,
  put -> False) and are counted in ``unavailable``. The first call after that tries the server
  again (redis-py reconnects), so the tier recovers by itself when the server is back.
* **Capacity** is the server's business: give it ``maxmemory`` and an ``allkeys-lru`` policy
  (or set ``ttl_s``); this tier does not track sizes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvdepot.events.base import NULL_SINK, EventSink, Medium
from kvdepot.keys import ChunkKey
from kvdepot.storage import codec
from kvdepot.storage.base import TierStats
from kvdepot.storage.codec import Payload

logger = logging.getLogger("kvdepot")

T = TypeVar("T")
_OUTAGE = (redis.ConnectionError, redis.TimeoutError)


class RedisTier:
    """Chunk objects of one namespace in a Redis-protocol server."""

    name = "redis"

    def __init__(
        self,
        url: str | None,
        namespace: bytes,
        *,
        timeout_s: float = 0.5,
        retry_after_s: float = 1.0,
        ttl_s: float | None = None,
        prefix: str = "kvdepot",
        client: Any = None,
        clock: Callable[[], float] = time.monotonic,
        events: EventSink = NULL_SINK,
    ) -> None:
        """Args:
        url: ``redis://``, ``rediss://`` or ``unix://`` URL, credentials included.
        namespace: the 16-byte ``Namespace.digest`` whose objects this tier serves.
        timeout_s: connect and per-operation socket timeout.
        retry_after_s: after an outage, answer misses without calling for this long.
        ttl_s: expire values after this long (None: keep until the server evicts them).
        client: a ready client with the ``redis.Redis`` command API (e.g. ``RedisCluster``)
            instead of ``url``; its timeouts and retries are then the caller's.
        events: told of every value set, and of every key the server answered is gone (the
            server evicts and expires silently: a GET, EXISTS or DEL that finds nothing is how
            this tier learns it).
        """
        self.namespace = codec.check_namespace(namespace)
        if client is None:
            if not url:
                raise ValueError("RedisTier needs a url or a client")
            client = redis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
        self._client = client
        self._prefix = f"{prefix}:{namespace.hex()}:".encode()
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._down_until = -float("inf")
        self._down = False
        self._lock = threading.Lock()
        self._stats = TierStats(name=self.name)
        self._events = events
        self.unavailable = 0  # calls that met an outage or were skipped during one

    def redis_key(self, key: ChunkKey) -> bytes:
        return self._prefix + key.hex().encode()

    @property
    def available(self) -> bool:
        """False while an outage's retry delay runs."""
        return self._clock() >= self._down_until

    def _call(self, op: str, fn: Callable[[], T]) -> tuple[bool, T | None]:
        """Run one server round trip; (False, None) on an outage or an error."""
        if not self.available:
            with self._lock:
                self.unavailable += 1
            return False, None
        try:
            result = fn()
        except _OUTAGE:
            with self._lock:
                self.unavailable += 1
                self._down_until = self._clock() + self.retry_after_s
                first, self._down = not self._down, True
            if first:
                logger.warning(
                    "redis tier unavailable (%s failed); answering misses, retrying every %.1fs",
                    op, self.retry_after_s, exc_info=True,
                )
            return False, None
        except redis.RedisError:  # the server answered with an error: this call fails, no outage
            logger.warning("redis tier: %s failed", op, exc_info=True)
            return False, None
        if self._down:
            with self._lock:
                recovered, self._down = self._down, False
            if recovered:
                logger.warning("redis tier available again")
        return True, result

    # ---- Tier ----------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        ok, found = self._call("EXISTS", lambda: self._client.exists(self.redis_key(key)))
        return bool(ok and found)

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Presence of every key in one round trip (a pipeline of single-key EXISTS)."""
        if not keys:
            return []

        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.redis_key(key))
            return pipe.execute()

        ok, found = self._call("EXISTS", run)
        if not (ok and found):
            return [False] * len(keys)
        present = [bool(n) for n in found]
        self._events.removed(Medium.REDIS, [k for k, hit in zip(keys, present, strict=True) if not hit])
        return present

    def get(self, key: ChunkKey) -> memoryview | None:
        name = self.redis_key(key)
        ok, value = self._call("GET", lambda: self._client.get(name))
        payload = codec.decode(value, self.namespace, key) if ok and value is not None else None
        with self._lock:
            if payload is not None:
                self._stats.hits += 1
            else:
                self._stats.misses += 1
                self._stats.corrupt += value is not None
        if payload is None:
            if value is not None:
                self._call("DEL", lambda: self._client.delete(name))
            if ok:
                self._events.removed(Medium.REDIS, (key,))
            return None
        # NOTE: no copy: a verified view into the reply (a copy of 32 MiB measured ~35 ms here,
        # mostly first-touch page faults); the caller copies it once, into its host slot.
        return payload

    def put(self, key: ChunkKey, payload: Payload) -> bool:
        value = codec.encode(self.namespace, key, payload)
        ok, _ = self._call("SET", lambda: self._client.set(self.redis_key(key), value, px=self._ttl_ms))
        with self._lock:
            if ok:
                self._stats.puts += 1
            else:
                self._stats.dropped += 1
        if ok:
            self._events.stored(Medium.REDIS, (key,))
        return ok

    def delete(self, key: ChunkKey) -> bool:
        ok, removed = self._call("DEL", lambda: self._client.delete(self.redis_key(key)))
        if ok:
            self._events.removed(Medium.REDIS, (key,))
        return bool(ok and removed)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(**vars(self._stats))

    def close(self) -> None:
        self._client.close()
