"""``RedisTier.get_into``: a GET reply read off redis-py's connection straight into the caller's
buffer. Against the real redis-server for values (good, corrupt, forged, of the wrong length) and
against a scripted RESP server for replies a real server gives only in bad moments (killed
mid-value, stalled, an error, a redirection, garbage). In every case: a hit is bit-exact, anything
else is a miss, and a connection is handed back to the pool only when its reply was read whole."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import pytest
import redis
from fake_resp import Reply, bulk, fake_resp

from kvdepot.keys import ChunkKey
from kvdepot.storage import codec
from kvdepot.storage.redis_tier import RedisTier

if TYPE_CHECKING:
    from redis_server import RedisServer

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
SIZE = 3 << 20  # several recv_into calls per value


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def in_use(tier: RedisTier) -> int:
    """Connections of the tier's pool not handed back: must be back to 0 after every call."""
    return len(tier._connected().connection_pool._in_use_connections)


def kept_open(tier: RedisTier) -> list[bool]:
    """Whether each idle connection of the tier's pool is still connected: one whose reply was not
    read to its end must have been closed before it went back (redis-py would reconnect a
    connection with unread data at its next checkout, but that is its safety net, not ours)."""
    return [conn._sock is not None for conn in tier._connected().connection_pool._available_connections]


def accepted(probe: redis.Redis) -> int:
    """Connections the server has accepted so far (one more each time the tier closed one); ask
    through one ``probe`` client throughout, so that asking adds none."""
    return int(probe.info("stats")["total_connections_received"])


def test_values_land_in_the_buffer_bit_exact(redis_server: RedisServer) -> None:
    tier, probe = RedisTier(redis_server.url, NS), redis_server.client()
    before = accepted(probe)
    big, small = os.urandom(SIZE), b"\x01\x02\x03"
    assert tier.put(key(1), big) and tier.put(key(2), small) and tier.put(key(3), b"")
    out = bytearray(SIZE)
    assert tier.get_into(key(1), out) == SIZE and out == big
    assert tier.get_into(key(2), memoryview(out)) == 3 and out[:3] == small and out[3:] == big[3:]  # only its bytes
    assert tier.get_into(key(3), out) == 0
    assert tier.get_into(key(4), out) is None  # nil
    s = tier.stats()
    assert (s.hits, s.misses, s.bytes_read, s.corrupt, s.errors) == (3, 1, SIZE + 3, 0, 0)
    assert in_use(tier) == 0 and accepted(probe) - before == 1  # one connection, reused by every call
    tier.close()


def test_a_value_longer_than_the_buffer_is_refused_and_kept(redis_server: RedisServer) -> None:
    tier, probe = RedisTier(redis_server.url, NS), redis_server.client()
    data = os.urandom(SIZE)
    assert tier.put(key(1), data)
    before = accepted(probe)
    with pytest.raises(ValueError, match="longer than"):
        tier.get_into(key(1), bytearray(SIZE - 1))
    assert in_use(tier) == 0 and kept_open(tier) == [False]
    out = bytearray(SIZE)
    assert tier.get_into(key(1), out) == SIZE and out == data  # the reply was not left half read
    assert accepted(probe) - before == 1  # the refused read's connection was closed, not reused
    assert tier.stats().misses == 1 and redis_server.client().exists(tier.redis_key(key(1)))
    tier.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "foreign", "other key", "garbage", "short"])
def test_a_corrupt_value_is_a_miss_and_deleted(redis_server: RedisServer, damage: str) -> None:
    tier = RedisTier(redis_server.url, NS)
    data = os.urandom(SIZE)
    tier.put(key(1), data)
    client, name = redis_server.client(), tier.redis_key(key(1))
    raw = bytearray(client.get(name))  # type: ignore[arg-type]
    raw = {
        "flip": lambda: raw[:-9] + bytes([raw[-9] ^ 0x40]) + raw[-8:],
        "truncate": lambda: raw[:-1],  # the header's length no longer matches: refused before the payload
        "extend": lambda: raw + b"\0",
        "foreign": lambda: bytearray(codec.encode(OTHER_NS, key(1), data)),
        "other key": lambda: bytearray(codec.encode(NS, key(2), data)),
        "garbage": lambda: bytearray(os.urandom(SIZE)),
        "short": lambda: bytearray(b"KVDC"),
    }[damage]()
    client.set(name, bytes(raw))
    out = bytearray(SIZE)
    assert tier.get_into(key(1), out) is None
    assert client.exists(name) == 0
    s = tier.stats()
    assert (s.corrupt, s.misses, s.hits, s.forged) == (1, 1, 0, 0)
    assert tier.put(key(1), data) and tier.get_into(key(1), out) == SIZE and out == data  # the pool is in step
    assert in_use(tier) == 0
    tier.close()


def test_a_forged_value_is_a_miss_with_a_secret(redis_server: RedisServer) -> None:
    tagged = RedisTier(redis_server.url, NS, secret="s3cret")
    client, name = redis_server.client(), tagged.redis_key(key(1))
    data = os.urandom(SIZE)
    out = bytearray(SIZE)
    client.set(name, codec.encode(NS, key(1), data))  # a valid checksum, no tag: anyone can make it
    assert tagged.get_into(key(1), out) is None and client.exists(name) == 0
    assert tagged.put(key(1), data)
    good = bytearray(client.get(name))  # type: ignore[arg-type]
    good[-1] ^= 1  # the payload changed under a good header: the tag fails after the read
    client.set(name, bytes(good))
    assert tagged.get_into(key(1), out) is None and client.exists(name) == 0
    assert tagged.put(key(1), data) and tagged.get_into(key(1), out) == SIZE and out == data
    s = tagged.stats()
    assert (s.forged, s.corrupt, s.hits, s.misses) == (2, 0, 1, 2)
    tagged.close()


def value(i: int, n: int = 4096) -> tuple[bytes, bytes]:
    payload = bytes((i + j) % 251 for j in range(n))
    return payload, codec.encode(NS, key(i), payload)


def test_a_server_gone_mid_value_is_an_outage_never_partial_data(caplog: pytest.LogCaptureFixture) -> None:
    payload, obj = value(1)
    reply = bulk(obj)
    with fake_resp() as server:
        server.script = [Reply(reply[: len(reply) // 2], "close"), Reply(reply)]
        tier = RedisTier(server.url, NS, timeout_s=1, retry_after_s=0)
        caplog.set_level(logging.INFO, logger="kvdepot")
        out = bytearray(len(payload))
        assert tier.get_into(key(1), out) is None
        assert kept_open(tier) == [False]
        s = tier.stats()
        assert (s.unavailable, s.misses, s.hits) == (1, 1, 0)
        assert tier.get_into(key(1), out) == len(payload) and out == payload  # a new connection
        assert server.accepted == 2 and in_use(tier) == 0
        lines = [r.getMessage() for r in caplog.records if r.name == "kvdepot"]
        assert len(lines) == 2 and "unavailable" in lines[0] and "available again" in lines[1], lines
        tier.close()


def test_a_stalled_reply_times_out_within_the_timeout() -> None:
    payload, obj = value(1)
    with fake_resp() as server:
        server.script = [Reply(bulk(obj)[:100], "stall"), Reply(bulk(obj))]
        tier = RedisTier(server.url, NS, timeout_s=0.3, retry_after_s=0.2)
        out = bytearray(len(payload))
        started = time.monotonic()
        assert tier.get_into(key(1), out) is None
        assert time.monotonic() - started < 1.0 and not tier.available
        assert tier.get_into(key(1), out) is None and server.gets == 1  # the outage window: no call
        time.sleep(0.25)
        assert tier.get_into(key(1), out) == len(payload) and out == payload
        assert server.accepted == 2 and in_use(tier) == 0
        tier.close()


@pytest.mark.parametrize(("reply", "reused"), [
    (b"-ERR something odd\r\n", True),  # a whole error line: the stream is in step
    (b"-MOVED 3999 127.0.0.1:6381\r\n", True),
    (b"-ASK 3999 127.0.0.1:6381\r\n", True),
    (b"$-1\r\n", True),  # nil
    (b"_\r\n", True),  # RESP3's nil
    (b"+OK\r\n", False),  # not a bulk string
    (b":42\r\n", False),
    (b"$notanumber\r\n", False),
    (b"$-7\r\n", False),
    (b"x" * 600, False),  # no line at all
])
def test_replies_other_than_a_value_are_misses(reply: bytes, reused: bool) -> None:
    payload, obj = value(1)
    with fake_resp() as server:
        server.script = [Reply(reply), Reply(bulk(obj))]
        tier = RedisTier(server.url, NS, timeout_s=1, retry_after_s=0)
        out = bytearray(len(payload))
        assert tier.get_into(key(1), out) is None
        assert kept_open(tier) == [reused]
        assert tier.get_into(key(1), out) == len(payload) and out == payload
        assert server.accepted == (1 if reused else 2) and kept_open(tier) == [True]
        assert in_use(tier) == 0 and tier.stats().unavailable == 0
        tier.close()


def test_a_value_with_a_bad_ending_is_refused() -> None:
    payload, obj = value(1)
    with fake_resp() as server:
        server.script = [Reply(bulk(obj)[:-2] + b"!!"), Reply(bulk(obj))]
        tier = RedisTier(server.url, NS, timeout_s=1, retry_after_s=0)
        out = bytearray(len(payload))
        assert tier.get_into(key(1), out) is None  # not CRLF after the value
        assert kept_open(tier) == [False]
        assert tier.get_into(key(1), out) == len(payload) and out == payload
        assert server.accepted == 2 and in_use(tier) == 0
        tier.close()
