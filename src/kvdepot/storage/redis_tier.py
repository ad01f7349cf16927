"""The Redis/Valkey tier: one value per chunk, shared by every engine that speaks the same namespace.

* **One value per chunk**: ``codec.encode`` (header + payload) under
  ``<prefix>:<namespace hex>:<key hex>``. Only single-key commands (GET, SET, EXISTS, DEL;
  pipelines without MULTI, one per node in a cluster), so no command ever spans hash slots.
  Namespaces never mix: another model, dtype, geometry or salt has another key prefix, and a
  value is served only if its header names this namespace and key and its checksum holds.
* **Authenticated values** (``secret``, config ``remote_secret``): values carry a keyed BLAKE3
  tag instead of the checksum (``codec.FLAG_KEYED``), bound to the namespace and chunk key, so
  whoever can write to Redis but lacks the secret cannot make a value this tier serves; a value
  that fails is a miss, removed and counted in ``forged``.
* **Redis Cluster** (``cluster``, config ``remote_cluster``): the URL names one seed node; the
  client learns the slot map from it. Outages are per node: a dead master means misses for the
  keys of its slots (and no calls to it for ``retry_after_s``), the other masters keep serving,
  and its keys hit again once it is back. Run the cluster with
  ``cluster-require-full-coverage no``, or the servers themselves refuse every key while one
  master is down.
* **Reads into the caller's memory** (``get_into``, the promotions' path): GET is sent on a
  connection of redis-py's pool for the key's node and its reply read off that connection's
  socket (``redis_reply``): the value's 64-byte header into a small buffer, checked (namespace,
  key, length, tag present) before the payload is read, then the payload with ``recv_into``
  straight into the host slot and verified there. No new memory, no copy. Anything but a whole
  value of this chunk that fits is a miss; a connection whose reply was not read to its end is
  closed, never handed back to the pool.
* **Bounded calls**: every socket operation has ``timeout_s``; redis-py's own retries are off.
* **Outages are values**: a connection error or timeout marks the server (the node) down for
  ``retry_after_s``; meanwhile calls return at once (get -> None, contains -> False,
  put -> False) and are counted in ``unavailable``. The first call after that tries again, so the
  tier recovers by itself. An outage is logged as one warning line naming the server, and its
  end as one line; no traceback (an outage is an operating condition, not a bug).
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
from redis.exceptions import MovedError, ResponseError

from kvdepot.events.base import NULL_SINK, EventSink, Medium
from kvdepot.keys import ChunkKey
from kvdepot.storage import codec
from kvdepot.storage.codec import Payload
from kvdepot.storage.redis_client import (
    OUTAGE,
    WHOLE,
    by_node,
    make_client,
    node_of,
    pool_of,
    redact,
    refresh_slots,
    url_problem,
)
from kvdepot.storage.redis_reply import BulkReply
from kvdepot.storage.tier_stats import ByteTierStats

logger = logging.getLogger("kvdepot")

T = TypeVar("T")
_LONGER = "longer"  # a value whose payload is longer than the caller's buffer: not this engine's chunk


class RedisTier:
    """Chunk objects of one namespace in a Redis-protocol server or cluster."""

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
        cluster: bool = False,
        secret: str | bytes | None = None,
        client: Any = None,
        clock: Callable[[], float] = time.monotonic,
        events: EventSink = NULL_SINK,
    ) -> None:
        """Args:
        url: ``redis://``, ``rediss://`` or ``unix://`` URL, credentials included (with
            ``cluster``: one seed node, ``redis://`` or ``rediss://``).
        namespace: the 16-byte ``Namespace.digest`` whose objects this tier serves.
        timeout_s: connect and per-operation socket timeout.
        retry_after_s: after an outage, answer misses without calling for this long.
        ttl_s: expire values after this long (None: keep until the server evicts them).
        cluster: ``url`` is a seed node of a Redis Cluster (``RedisCluster`` client).
        secret: tag values with a key derived from it, and serve only values tagged so.
        client: a ready client with the ``redis.Redis`` command API instead of ``url``; its
            timeouts and retries are then the caller's.
        events: told of every value set, and of every key the server answered is gone (the
            server evicts and expires silently: a GET, EXISTS or DEL that finds nothing is how
            this tier learns it).
        """
        self.namespace = codec.check_namespace(namespace)
        if client is None:
            if not url:
                raise ValueError("RedisTier needs a url or a client")
            problem = url_problem(url, cluster)
            if problem is not None:
                raise ValueError(f"redis URL {redact(url)!r}: {problem}")
            if not cluster:  # no I/O yet; a cluster client is made on first use (it reads the slot map)
                client = make_client(url, False, timeout_s)
        self.where = redact(url) if url else "(client)"
        self._url, self._timeout_s, self.cluster = url, timeout_s, cluster
        self._client = client
        self._tag_key = None if secret is None else codec.tag_key(secret)
        self._prefix = f"{prefix}:{namespace.hex()}:".encode()
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._down_until: dict[str, float] = {}  # node (WHOLE: the server) -> no calls before then
        self._failing: set[str] = set()  # nodes whose outage was logged and has not ended
        self._lock = threading.Lock()
        self._stats = ByteTierStats(name=self.name)
        self._events = events

    def redis_key(self, key: ChunkKey) -> bytes:
        return self._prefix + key.hex().encode()

    @property
    def available(self) -> bool:
        """False while an outage's retry delay runs (for any node)."""
        now = self._clock()
        with self._lock:
            return all(now >= until for until in self._down_until.values())

    @property
    def unavailable(self) -> int:
        """Calls that met an outage or were skipped during one."""
        with self._lock:
            return self._stats.unavailable

    # ---- calls -----------------------------------------------------------------------------
    def _connected(self) -> Any:
        """The client; a cluster's is made here, on first use (an outage if the seed is down)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    assert self._url is not None
                    self._client = make_client(self._url, True, self._timeout_s)
        return self._client

    def _node(self, name: bytes) -> str:
        """The outage key of ``name``'s node; a cluster client is made first (reading the slot
        map), so that a dead master at start costs its own slots, not the whole cluster."""
        if self._client is None:
            self._call("CLUSTER SLOTS", WHOLE, lambda c: None)
        return node_of(self._client, self.cluster, name) if self._client is not None else WHOLE

    def _call(self, op: str, node: str, fn: Callable[[Any], T]) -> tuple[bool, T | None]:
        """One round trip to ``node`` (``fn(client)``); (False, None) on an outage or an error."""
        now = self._clock()
        with self._lock:
            skip = now < self._down_until.get(node, -float("inf")) or now < self._down_until.get(WHOLE, -float("inf"))
            if skip:
                self._stats.unavailable += 1
        if skip:
            return False, None
        try:
            result = fn(self._connected())
        except OUTAGE as exc:
            self._outage(op, node, exc)
            return False, None
        except redis.RedisError as exc:  # the server answered with an error: this call fails, no outage
            with self._lock:
                self._stats.errors += 1
            logger.warning("redis tier %s: %s failed (%s: %s)", self.where, op, type(exc).__name__, exc)
            return False, None
        if self._failing:
            self._recovered(node)
        return True, result

    def _outage(self, op: str, node: str, exc: Exception) -> None:
        with self._lock:
            self._stats.unavailable += 1
            self._stats.errors += 1
            self._down_until[node] = self._clock() + self.retry_after_s
            first = node not in self._failing
            self._failing.add(node)
        if first:
            what = f"cluster node {node}" if node else ("cluster" if self.cluster else "server")
            logger.warning("redis tier %s: %s unavailable (%s: %s: %s); answering misses%s, retrying every %.1fs",
                           self.where, what, op, type(exc).__name__, exc,
                           " for its keys" if node else "", self.retry_after_s)

    def _recovered(self, node: str) -> None:
        with self._lock:
            back = [n for n in dict.fromkeys((node, WHOLE)) if n in self._failing]
            for n in back:
                self._failing.discard(n)
                self._down_until.pop(n, None)
        for n in back:
            what = f"cluster node {n}" if n else ("cluster" if self.cluster else "server")
            logger.warning("redis tier %s: %s available again", self.where, what)

    # ---- Tier ----------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        name = self.redis_key(key)
        ok, found = self._call("EXISTS", self._node(name), lambda c: c.exists(name))
        return bool(ok and found)

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Presence of every key: one pipeline of single-key EXISTS per node (one round trip each;
        a node that is down answers False for its keys only)."""
        present = [False] * len(keys)
        if not keys:
            return present
        names = [self.redis_key(key) for key in keys]
        if self._client is None:
            self._node(names[0])  # makes the client (and its slot map) first
        groups = by_node(self._client, self.cluster, names) if self._client is not None else {WHOLE: list(range(len(names)))}
        for node, indexes in groups.items():

            def run(client: Any, indexes: list[int] = indexes) -> list[Any]:
                pipe = client.pipeline(transaction=False) if not self.cluster else client.pipeline()
                for i in indexes:
                    pipe.exists(names[i])
                return pipe.execute()

            ok, found = self._call("EXISTS", node, run)
            if ok and found:
                for i, n in zip(indexes, found, strict=True):
                    present[i] = bool(n)
                self._events.removed(Medium.REDIS, [keys[i] for i in indexes if not present[i]])
        return present

    def get(self, key: ChunkKey) -> memoryview | None:
        """The verified payload in new memory (redis-py's reply); the engine's path is ``get_into``."""
        name = self.redis_key(key)
        node = self._node(name)
        ok, value = self._call("GET", node, lambda c: c.get(name))
        payload, fault = (None, None) if not ok or value is None else codec.check(value, self.namespace, key, self._tag_key)
        self._account(key, node, name, ok, None if payload is None else payload.nbytes, fault)
        # NOTE: no copy: a verified view into the reply (a copy of 32 MiB measured ~35 ms here,
        # mostly first-touch page faults).
        return payload

    def get_into(self, key: ChunkKey, out: Payload) -> int | None:
        """The verified payload written straight into ``out`` (a host slot): its length, or None
        on a miss, a corrupt or forged value, an outage or any reply that is not a value (an error,
        ``-MOVED``/``-ASK``, nil); ``out`` then holds nothing usable. ValueError (a miss, the value
        kept) when the payload is longer than ``out``. No new memory, no copy: the reply is read
        off the connection's socket into ``out`` (``redis_reply``: redis-py cannot read a value
        into a caller's buffer), then verified where it landed."""
        target = memoryview(out).cast("B")
        name = self.redis_key(key)
        node = self._node(name)
        ok, read = self._call("GET", node, lambda c: self._read_into(c, name, key, target))
        length, fault = read if ok and read is not None else (None, None)
        if fault == _LONGER:
            self._account(key, node, name, ok, None, None, gone=False)
            raise ValueError(f"chunk {key.hex()}: its Redis value is longer than the {target.nbytes}-byte buffer")
        self._account(key, node, name, ok, length, fault)
        return length

    def _read_into(self, client: Any, name: bytes, key: ChunkKey, target: memoryview) -> tuple[int | None, str | None]:
        """One GET on a connection of redis-py's pool, the value's header checked before its
        payload is read into ``target``: (length, None), (None, None) for nil, (None, why) for a
        value refused or too long. The connection goes back to the pool only when its reply was
        read to the end; otherwise (a failure mid-reply, a value refused by its header) it is
        closed: its stream's position is unknown, or not worth reading 32 MiB to restore."""
        pool = pool_of(client, self.cluster, name)
        conn = pool.get_connection()
        in_step = False
        try:
            conn.send_command("GET", name)
            reply = BulkReply(conn._sock)  # NOTE: redis-py's socket; its parser's buffer is empty between replies
            try:
                first = reply.head(codec.HEADER_BYTES)
            except ResponseError as exc:
                in_step = True  # the whole error line was read
                if isinstance(exc, MovedError):
                    self._refresh_slots(client)
                raise
            in_step = first is None
            if first is None:
                return None, None
            size, head = first
            header, fault = codec.check_head(head, self.namespace, key, self._tag_key, size)
            if header is None:
                return None, fault
            if header.length > target.nbytes:
                return None, _LONGER
            payload = target[: header.length]
            reply.rest_into(payload)
            in_step = True
        finally:
            if not in_step:
                conn.disconnect()
            pool.release(conn)
        if not codec.verify(header, payload):  # in place, after the connection went back
            return None, codec.refusal(self._tag_key)
        return header.length, None

    def _refresh_slots(self, client: Any) -> None:
        """A ``-MOVED`` reply: the slot map is stale; re-read it so the next read asks the right node."""
        if self.cluster:
            try:
                refresh_slots(client)
            except OUTAGE as exc:  # the next call meets (and reports) the outage itself
                logger.debug("redis tier %s: slot map refresh failed (%s)", self.where, exc)

    def _account(self, key: ChunkKey, node: str, name: bytes, ok: bool, length: int | None, fault: str | None,
                 *, gone: bool = True) -> None:
        """Counters of one read; a refused value is deleted (one log line), and a key the server
        answered is not there (nil, refused) is reported gone to the events."""
        with self._lock:
            if length is not None:
                self._stats.hits += 1
                self._stats.bytes_read += length
            else:
                self._stats.misses += 1
                self._stats.corrupt += fault == codec.CORRUPT
                self._stats.forged += fault == codec.FORGED
        if length is not None:
            return
        if fault is not None:
            logger.warning("redis tier %s: value of chunk %s refused (%s); deleted", self.where, key.hex(), fault)
            self._call("DEL", node, lambda c: c.delete(name))
        if ok and gone:
            self._events.removed(Medium.REDIS, (key,))

    def put(self, key: ChunkKey, payload: Payload) -> bool:
        value = codec.encode(self.namespace, key, payload, self._tag_key)
        name = self.redis_key(key)
        ok, _ = self._call("SET", self._node(name), lambda c: c.set(name, value, px=self._ttl_ms))
        with self._lock:
            if ok:
                self._stats.puts += 1
                self._stats.bytes_written += len(value) - codec.HEADER_BYTES
            else:
                self._stats.dropped += 1
        if ok:
            self._events.stored(Medium.REDIS, (key,))
        return ok

    def delete(self, key: ChunkKey) -> bool:
        name = self.redis_key(key)
        ok, removed = self._call("DEL", self._node(name), lambda c: c.delete(name))
        if ok:
            self._events.removed(Medium.REDIS, (key,))
        return bool(ok and removed)

    def stats(self) -> ByteTierStats:
        with self._lock:
            return ByteTierStats(**vars(self._stats))

    def note_write_dropped(self) -> None:
        """The write-behind queue dropped a copy meant for this tier (counted for operators)."""
        with self._lock:
            self._stats.write_behind_dropped += 1

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
