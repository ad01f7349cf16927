"""Per-tier counters for operators: what each byte tier's ``stats()`` reports, figure by figure."""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvdepot.keys import ChunkKey
from kvdepot.storage import codec
from kvdepot.storage.disk import OFFSET, DiskTier
from kvdepot.storage.manager import TierManager
from kvdepot.storage.redis_tier import RedisTier
from kvdepot.storage.tier_stats import ByteTierStats

if TYPE_CHECKING:
    from redis_server import RedisServer

NS = bytes(range(16))
FIELDS = ("hits", "misses", "corrupt", "forged", "bytes_read", "bytes_written", "errors",
          "write_behind_dropped", "dropped", "unavailable", "no_space", "shared_used_bytes")


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def test_the_operator_fields_are_plain_numbers() -> None:
    row = dataclasses.asdict(ByteTierStats(name="disk"))
    assert set(FIELDS) <= set(row) and all(isinstance(row[f], int) for f in FIELDS)


def test_disk_counters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path, 10**8, NS, o_direct=False)
    assert tier.put(key(1), b"a" * 1000) and tier.put(key(2), b"b" * 500)
    assert tier.get(key(1)) == b"a" * 1000 and tier.get(key(9)) is None
    raw = bytearray(Path(tier._path(key(2))).read_bytes())
    raw[OFFSET + 3] ^= 1
    Path(tier._path(key(2))).write_bytes(bytes(raw))
    assert tier.get(key(2)) is None  # corrupt: removed
    real_open = os.open

    def refused(path: str, *args: object, **kwargs: object) -> int:
        if str(path).endswith(".tmp"):
            raise OSError(13, "Permission denied")
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refused)
    assert not tier.put(key(3), b"c" * 10)
    monkeypatch.undo()
    s = tier.stats()
    assert (s.hits, s.misses, s.corrupt, s.bytes_read, s.bytes_written, s.errors, s.dropped) == (1, 2, 1, 1000, 1500, 1, 1)
    assert s.shared_used_bytes == s.used_bytes == OFFSET + 1000
    tier.close()


def test_write_behind_drops_are_counted_per_tier(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 10**8, NS, o_direct=False)
    manager = TierManager(disk, queue_depth=1)
    gate = threading.Event()

    def held() -> bytes:
        gate.wait(5)
        return b"x" * 100

    try:
        assert manager.write_behind(key(1), held)  # taken by the writer, which waits on the gate
        accepted = [manager.write_behind(key(i), lambda: b"y" * 100) for i in range(2, 6)]
        assert accepted.count(False) >= 2  # one fits the queue behind the held job (or two)
        assert disk.stats().write_behind_dropped == accepted.count(False) == manager.stats().dropped
    finally:
        gate.set()
        manager.close()


def test_redis_counters(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, NS, secret="k", timeout_s=0.3, retry_after_s=60)
    assert tier.put(key(1), b"a" * 700)
    assert tier.get(key(1)) == b"a" * 700 and tier.get(key(2)) is None
    redis_server.client().set(tier.redis_key(key(3)), codec.encode(NS, key(3), b"forged"))
    assert tier.get(key(3)) is None
    redis_server.stop()
    assert tier.get(key(1)) is None and tier.get(key(1)) is None and not tier.put(key(4), b"z")
    s = tier.stats()
    assert (s.hits, s.misses, s.forged, s.corrupt, s.bytes_read, s.bytes_written) == (1, 4, 1, 0, 700, 700)
    assert (s.errors, s.unavailable, s.dropped, s.puts) == (1, 3, 1, 1)
    tier.close()
