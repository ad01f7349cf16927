"""``kvdepot bench tiers --parts redis``: the Redis tier against the best raw read of the same bytes.

Rows (each against a ceiling measured in the same run, calls alternated so a noisy neighbour's
burst lands on both):

* ``put / SET``, ``get / GET``: the tier's put and its redis-py ``get`` (new memory per value)
  against redis-py SET/GET of the same sizes.
* ``get_into / recv_into``: the tier's read into a reused buffer (``RedisTier.get_into``: the
  header checked, the payload read off the socket into the buffer, verified there) against the
  raw floor of the same bytes: one RESP ``GET`` of the tier's own value on a plain socket,
  ``recv_into`` into the same touched buffer, nothing checked. One stream, per chunk.
* ``get_into xS / recv_into xS``: the same with ``S`` streams (threads; the tier's connections
  from its pool, the raw side one socket per thread), all chunks as one batch: aggregate GB/s.
* ``promote / recv_into xS``: ``TierManager.promote`` of all chunks with ``streams=S`` (the
  first-request hit's path, without the host tier's bookkeeping) against the raw batch of ``S``.

Buffers are allocated and touched once, shared by tier and raw calls (as host slots are), so
neither side pays first-touch page faults.
"""

from __future__ import annotations

import argparse
import itertools
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvdepot.bench.report import Report
from kvdepot.bench.tiers import NS, Op, _check, _compare, _key
from kvdepot.keys import ChunkKey
from kvdepot.storage import codec
from kvdepot.storage.manager import TierManager
from kvdepot.storage.redis_tier import RedisTier


def redis_rows(args: argparse.Namespace, url: str, payload: bytes, cost: dict[str, float], report: Report) -> list[dict]:
    n, size, reps, tag = args.chunks, len(payload), range(args.reps + 1), uuid.uuid4().hex[:8]
    tier = RedisTier(url, NS, timeout_s=args.redis_timeout, prefix=f"kvdepot-bench-{tag}")
    raw = redis.Redis.from_url(url, socket_timeout=args.redis_timeout, socket_connect_timeout=args.redis_timeout,
                               retry=Retry(NoBackoff(), 0))  # the tier's client settings
    keys = {rep: [_key() for _ in range(n)] for rep in reps}
    names = {rep: [f"kvdepot-bench-raw-{tag}:{rep}:{i}" for i in range(n)] for rep in reps}
    stored = [_key() for _ in range(n)]  # what the reads read, written once
    hint = "(see the kvdepot log: maxmemory? proto-max-bulk-len?)"
    ops: list[tuple[str, Op, Op, float]] = [  # the tier's extra: a checksum and a copy into fresh memory
        ("put / SET", lambda r, i: _check(tier.put(keys[r][i], payload), f"redis put refused {hint}"),
         lambda r, i: _check(raw.set(names[r][i], payload), "SET failed"), cost["xxh3"] + cost["fresh"]),
        ("get / GET", lambda r, i: _check(tier.get(keys[r][i]) is not None, f"redis get missed {hint}"),
         lambda r, i: _check(len(raw.get(names[r][i]) or b"") == size, "GET missed"), cost["xxh3"] + cost["fresh"]),
    ]
    streams = sorted({int(s) for s in args.streams.split(",")})
    floor = RawReader(url, args.redis_timeout, max(streams))
    try:
        rows = _compare(args, size, ops, lambda rep: None, lambda rep: raw.delete(*names[rep], *map(tier.redis_key, keys[rep])),
                        report, O_DIRECT=None, fsync=None, reads="redis-server memory", streams=1)
        for key in stored:
            _check(tier.put(key, payload), f"redis put refused {hint}")
        bufs = [bytearray(size + codec.HEADER_BYTES) for _ in range(n)]  # touched: bytearray zero-fills
        views = [memoryview(b) for b in bufs]
        value = [tier.redis_key(k) for k in stored]

        def get_into(r: int, i: int) -> None:
            _check(tier.get_into(stored[i], views[i][:size]) == size, f"redis get_into missed {hint}")

        def recv_into(r: int, i: int) -> None:
            _check(floor.get_into(0, value[i], views[i]) == size + codec.HEADER_BYTES, "raw GET missed")

        rows += _compare(args, size, [("get_into / recv_into", get_into, recv_into, cost["xxh3"])], lambda rep: None,
                         lambda rep: None, report, O_DIRECT=None, fsync=None, reads="redis-server memory", streams=1)
        for s in streams:
            rows.append(_batch(args, size, f"get_into x{s} / recv_into x{s}", s, report,
                               lambda i, _w: get_into(0, i), lambda i, w: floor.get_into(w, value[i], views[i])))
        manager = TierManager(None, RedisTier(url, NS, timeout_s=args.redis_timeout, prefix=f"kvdepot-bench-{tag}"),
                              streams=streams[-1], promote_to_disk=False)
        try:
            rows.append(_batch(args, size, f"promote / recv_into x{streams[-1]}", streams[-1], report,
                               None, lambda i, w: floor.get_into(w, value[i], views[i]),
                               whole=lambda: _promote_all(manager, stored, views, size)))
        finally:
            manager.close()
    finally:  # a failed run leaves nothing in the user's Redis either
        raw.delete(*(n for rep in reps for n in names[rep]), *(tier.redis_key(k) for rep in reps for k in keys[rep]),
                   *map(tier.redis_key, stored))
        floor.close()
        tier.close()
        raw.close()
    return [report.add({"tier": "redis", **row}) for row in rows]


def _promote_all(manager: TierManager, keys: list[ChunkKey], views: list[memoryview], size: int) -> None:
    targets = {key: views[i][:size] for i, key in enumerate(keys)}
    failed: list[ChunkKey] = []
    placed = manager.promote(keys, lambda key: (targets[key], lambda ok, k=key: ok or failed.append(k))).result()
    _check(placed == len(keys) and not failed, f"promote placed {placed} of {len(keys)} chunks")


def _batch(args: argparse.Namespace, size: int, name: str, streams: int, report: Report,
           tier_one: Callable[[int, int], object] | None, raw_one: Callable[[int, int], object],
           whole: Callable[[], object] | None = None) -> dict:
    """One row: every chunk read by ``streams`` threads (``tier_one(i, worker)``, or ``whole()``
    for the tier side), against the raw batch; tier and raw batches alternate, repetition 0 is a
    warm-up; GB/s from the median batch time."""
    n, times = args.chunks, ([], [])

    def tier_batch() -> None:
        if whole is not None:
            whole()
        else:
            assert tier_one is not None
            _parallel(streams, n, tier_one)

    for rep in range(args.reps + 1):
        with report.step(f"{name}: {'warm-up' if rep == 0 else f'repetition {rep}'}"):
            for slot, fn in [(0, tier_batch), (1, lambda: _parallel(streams, n, raw_one))][:: 1 if rep % 2 else -1]:
                start = time.perf_counter()
                fn()
                if rep:
                    times[slot].append(time.perf_counter() - start)
    tier_s, raw_s = (statistics.median(t) for t in times)
    return {"op": name, "tier GB/s": n * size / tier_s / 1e9, "raw GB/s": n * size / raw_s / 1e9, "ratio": raw_s / tier_s,
            "tier ms/chunk": tier_s * 1e3 / n, "raw ms/chunk": raw_s * 1e3 / n, "gap ms": (tier_s - raw_s) * 1e3 / n,
            "extra CPU ms": None, "O_DIRECT": None, "fsync": None, "reads": "redis-server memory", "streams": streams}


def _parallel(streams: int, n: int, one: Callable[[int, int], object]) -> None:
    """``one(i, worker)`` for every chunk ``i``, taken in order by ``streams`` threads."""
    todo, errors = itertools.count(), []

    def work(worker: int) -> None:
        try:
            while (i := next(todo)) < n:
                one(i, worker)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


class RawReader:
    """The floor: RESP GET on plain sockets (one per stream), the reply's value read with
    ``recv_into`` straight into the caller's buffer, nothing parsed beyond its length, nothing
    checked. TCP only (``redis://host:port``; no password, TLS or database: the bench's own server)."""

    def __init__(self, url: str, timeout_s: float, streams: int) -> None:
        parts = urlsplit(url)
        _check(parts.scheme == "redis" and not parts.password and parts.path in ("", "/", "/0"),
               f"the raw floor needs a plain redis://host:port URL, not {parts.scheme}://…")
        self._socks = []
        for _ in range(streams):
            sock = socket.create_connection((parts.hostname, parts.port or 6379), timeout=timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks.append(sock)

    def get_into(self, stream: int, name: bytes, out: memoryview) -> int:
        sock = self._socks[stream]
        sock.sendall(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(name), name))
        head, got = bytearray(32), 0  # "$<length>\r\n" fits
        while b"\r\n" not in head[:got]:
            _check(got < 32, "raw GET: no length line")
            more = sock.recv_into(memoryview(head)[got:], 32 - got)
            _check(more, "raw GET: connection closed")
            got += more
        end = head.index(b"\r\n")
        _check(head[:1] == b"$", f"raw GET: {bytes(head[:got])!r}")
        length = int(head[1:end])
        _check(0 <= length <= out.nbytes, f"raw GET: a value of {length} bytes")
        early = min(got - end - 2, length)
        out[:early] = head[end + 2 : end + 2 + early]
        done, tail = early, got - end - 2 - early
        while done < length:
            done += sock.recv_into(out[done:length])
        crlf = bytearray(2)
        while tail < 2:
            tail += sock.recv_into(memoryview(crlf)[tail:])
        return length

    def close(self) -> None:
        for sock in self._socks:
            sock.close()
