"""``KVEventPublisher``: an ``EventSink`` that publishes vLLM-format KV events over ZMQ.

    PUB socket at ``endpoint``: bound when the address is a wildcard (``*``, ``::``) or
        ``ipc://``/``inproc://``, connected otherwise (vLLM's rule: either side may bind).
        Messages are (topic, 8-byte big-endian sequence number, msgpack ``KVEventBatch``);
        sequence numbers count batches from 0 with no gaps.
    ROUTER socket at ``replay_endpoint`` (always bound), vLLM's replay protocol: a request is
        (identity, b"", 8-byte big-endian start); the reply is every buffered batch from
        ``start`` on as (identity, b"", topic, seq, payload), then (identity, b"", b"", -1 as 8
        signed bytes, b""). A malformed request gets only that end marker. The last
        ``buffer_batches`` batches are kept, including those sent before anyone subscribed
        (a PUB socket drops those: replay is how a late subscriber gets them).

Sink calls only enqueue (they run under the tiers' locks); one thread owns both sockets and
the ``Catalog``, turns what it drained into one batch, and serves replay between batches. A
full queue drops the call and counts it: a router then sees a stale hint, never a stall.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import zmq

from kvdepot.config import DepotConfig
from kvdepot.errors import ConfigError
from kvdepot.events.base import EventSink, EventSpace, Medium
from kvdepot.events.catalog import Catalog
from kvdepot.events.wire import END_SEQ, KVEvent, KVEventBatch, seq_bytes
from kvdepot.keys import ChunkKey, token_bytes

logger = logging.getLogger("kvdepot")

_STOP = object()
_IDLE_POLL_MS = 20  # how long the idle thread waits on the replay socket between queue checks
_MAX_OPS = 4096  # sink calls folded into one batch at most


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc addresses, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass
class PublisherStats:
    batches: int = 0  # batches published (= the next sequence number)
    events: int = 0  # events in them
    dropped_calls: int = 0  # sink calls refused by a full queue
    replays: int = 0  # replay requests answered
    bad_replays: int = 0  # malformed replay requests (answered with the end marker only)
    unknown: int = 0  # stores of chunks never described (not announced)


class KVEventPublisher:
    """Publishes what kvdepot's tiers hold; one per process (in-process) or per server."""

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        replay_endpoint: str | None = None,
        buffer_batches: int = 10_000,
        max_pending: int = 100_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
    ) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(hwm)
            self.endpoint = _attach(self._pub, endpoint, bind=is_bind_endpoint(endpoint))
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint: str | None = _attach(self._replay, replay_endpoint, bind=True)
            else:
                self.replay_endpoint = None
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        # NOTE: a deque, not a queue.Queue: append/popleft are atomic without a lock, so a tier's
        # call costs ~0.1 us instead of a lock and a condition variable contended by this thread.
        self._pending: deque[object] = deque()
        self._max_pending = max_pending
        self._catalog = Catalog()
        self._stats = PublisherStats()
        self._stats_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvdepot-kv-events", daemon=True)
        self._thread.start()

    # ---- EventSink (as the holder "") -------------------------------------------------------
    def describe(self, keys: Sequence[ChunkKey], tokens: Sequence[int], space: EventSpace) -> None:
        count = min(len(keys), len(tokens) // space.chunk_size)
        if count:  # NOTE: copied now (a slice): the caller's token list may grow or change later
            part = tokens[: count * space.chunk_size]
            self._put(("describe", list(keys[:count]), part.copy() if isinstance(part, np.ndarray) else list(part), space))

    def stored(self, medium: Medium, keys: Sequence[ChunkKey], holder: Hashable = "") -> None:
        if keys:
            self._put(("stored", holder, medium, list(keys)))

    def removed(self, medium: Medium, keys: Sequence[ChunkKey], holder: Hashable = "") -> None:
        if keys:
            self._put(("removed", holder, medium, list(keys)))

    def cleared(self) -> None:
        """``AllBlocksCleared``: every holding of every holder is forgotten."""
        self._put(("cleared",))

    def sink(self, holder: Hashable) -> EventSink:
        """The sink one engine of several reports through (a server's shards): a prefix stays
        announced in a medium while any holder holds it."""
        return _HolderSink(self, holder)

    # ---- lifecycle ---------------------------------------------------------------------------
    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every call made so far is published; False on timeout or when closed."""
        marker = threading.Event()
        return self._put(marker) and marker.wait(timeout)

    def stats(self) -> PublisherStats:
        with self._stats_lock:
            return PublisherStats(**vars(self._stats))

    def close(self, timeout: float = 5.0) -> None:
        """Publish ``AllBlocksCleared`` (what this publisher announced is no longer vouched for),
        stop the thread and close the sockets. Idempotent."""
        if self._closed:
            return
        self.cleared()
        self._closed = True
        self._pending.append(_STOP)  # never dropped, whatever the bound
        self._thread.join(timeout)
        if self._thread.is_alive():  # pragma: no cover - the thread only blocks on bounded polls
            logger.warning("kvdepot: KV-event thread did not stop within %.1fs", timeout)
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=200)  # long enough for the last batch to leave, bounded
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _put(self, op: object) -> bool:
        if self._closed:
            return False
        if len(self._pending) >= self._max_pending:
            with self._stats_lock:
                self._stats.dropped_calls += 1
            return False
        self._pending.append(op)
        return True

    # ---- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        stop = False
        while not stop:
            ops = self._drain()
            events: list[KVEvent] = []
            markers = []
            for op in ops:
                if op is _STOP:
                    stop = True
                elif isinstance(op, threading.Event):
                    markers.append(op)
                else:
                    events.extend(self._apply(op))  # type: ignore[arg-type]
            if events:
                self._send(encoder, events)
            for marker in markers:
                marker.set()
            if not ops and self._replay is not None:
                if self._replay.poll(_IDLE_POLL_MS):
                    self._serve_replay()
            elif not ops:
                time.sleep(_IDLE_POLL_MS / 1000)
            elif self._replay is not None and self._replay.poll(0):
                self._serve_replay()

    def _drain(self) -> list[object]:
        ops: list[object] = []
        try:
            while len(ops) < _MAX_OPS:
                ops.append(self._pending.popleft())
        except IndexError:
            pass
        return ops

    def _apply(self, op: tuple) -> list[KVEvent]:
        try:
            kind = op[0]
            if kind == "describe":
                self._catalog.describe(op[1], token_bytes(op[2]), op[3])
                return []
            if kind == "stored":
                return self._catalog.stored(op[1], op[2], op[3])
            if kind == "removed":
                return self._catalog.removed(op[1], op[2], op[3])
            return self._catalog.cleared()
        except Exception:  # the thread's boundary: one bad call must not end the events
            logger.warning("kvdepot: KV-event call %s failed", op[0], exc_info=True)
            return []

    def _send(self, encoder: msgspec.msgpack.Encoder, events: list[KVEvent]) -> None:
        with self._stats_lock:
            seq = self._stats.batches
        payload = encoder.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank))
        try:
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
        except zmq.ZMQError:  # PUB does not block; an error here is logged, the batch stays replayable
            logger.warning("kvdepot: KV-event batch %d not sent", seq, exc_info=True)
        self._buffer.append((seq, payload))
        with self._stats_lock:
            self._stats.batches += 1
            self._stats.events += len(events)
            self._stats.unknown = self._catalog.stats.unknown

    def _serve_replay(self) -> None:
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            ok = len(frames) == 3 and frames[1] == b"" and len(frames[2]) == 8
            if ok:
                start = int.from_bytes(frames[2], "big")
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        self._replay.send_multipart((frames[0], b"", self._topic, seq_bytes(seq), payload))
            else:
                logger.warning("kvdepot: malformed KV-event replay request (%d frames)", len(frames))
            with self._stats_lock:  # counted before the end marker: a client may read stats after it
                self._stats.replays += ok
                self._stats.bad_replays += not ok
            self._replay.send_multipart((frames[0], b"", b"", END_SEQ, b""))


class _HolderSink:
    """``KVEventPublisher.sink(holder)``: the publisher's calls, tagged with one holder.
    ``cleared`` is the publisher's: there is no per-holder clear on the wire."""

    def __init__(self, publisher: KVEventPublisher, holder: Hashable) -> None:
        self._publisher, self._holder = publisher, holder

    def describe(self, keys: Sequence[ChunkKey], tokens: Sequence[int], space: EventSpace) -> None:
        self._publisher.describe(keys, tokens, space)

    def stored(self, medium: Medium, keys: Sequence[ChunkKey]) -> None:
        self._publisher.stored(medium, keys, self._holder)

    def removed(self, medium: Medium, keys: Sequence[ChunkKey]) -> None:
        self._publisher.removed(medium, keys, self._holder)

    def cleared(self) -> None:
        self._publisher.cleared()


def _attach(sock: zmq.Socket, endpoint: str, *, bind: bool) -> str:
    """Bind or connect; a bound address is returned as the socket resolved it (a port 0 filled in)."""
    if not bind:
        sock.connect(endpoint)
        return endpoint
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def publisher_from_config(config: DepotConfig) -> KVEventPublisher | None:
    """The publisher ``kv_events_*`` ask for, or None when ``kv_events_endpoint`` is unset.
    A ZMQ error (address in use, unknown interface) is a ``ConfigError`` naming the key."""
    if not config.kv_events_endpoint:
        return None
    try:
        return KVEventPublisher(config.kv_events_endpoint, topic=config.kv_events_topic,
                                replay_endpoint=config.kv_events_replay_endpoint)
    except zmq.ZMQError as exc:
        raise ConfigError(
            f"config keys 'kv_events_endpoint'={config.kv_events_endpoint!r} / 'kv_events_replay_endpoint'="
            f"{config.kv_events_replay_endpoint!r}: cannot open the socket ({exc})"
        ) from None
