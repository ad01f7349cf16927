"""RedisTier against a real redis-server: round trips, namespaces, corruption, outages, recovery."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvdepot.config import load_config
from kvdepot.errors import ConfigError
from kvdepot.keys import ChunkKey
from kvdepot.storage import codec
from kvdepot.storage.redis_tier import RedisTier

if TYPE_CHECKING:
    from conftest import RedisServer  # tests/conftest.py

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
CALL_LIMIT_S = 1.0


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def payload(i: int, n: int = 3000) -> bytes:
    return bytes((i * 13 + j) % 251 for j in range(n))


def timed(fn: Callable[[], object]) -> object:
    started = time.monotonic()
    result = fn()
    assert time.monotonic() - started < CALL_LIMIT_S
    return result


def eventually(fn: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not fn():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_round_trip(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, NS)
    assert tier.put(key(1), payload(1)) and tier.put(key(2), memoryview(payload(2, 0)))
    assert tier.get(key(1)) == payload(1) and tier.get(key(2)) == b""
    assert tier.contains(key(1)) and not tier.contains(key(3))
    assert tier.contains_many([key(1), key(3), key(2)]) == [True, False, True]
    assert tier.contains_many([]) == []
    assert tier.get(key(3)) is None
    raw = redis_server.client().get(tier.redis_key(key(1)))
    assert raw is not None and raw[:4] == codec.MAGIC and len(raw) == codec.HEADER_BYTES + 3000  # one value
    assert tier.redis_key(key(1)) == b"kvdepot:" + NS.hex().encode() + b":" + key(1).hex().encode()
    assert tier.delete(key(1)) and not tier.delete(key(1)) and not tier.contains(key(1))
    s = tier.stats()
    assert (s.puts, s.hits, s.misses, s.corrupt, s.dropped) == (2, 2, 1, 0, 0)
    tier.close()


def test_unix_socket_and_password_urls(redis_factory: Callable[..., RedisServer]) -> None:
    short = Path(tempfile.mkdtemp(prefix="kvr"))  # unix socket paths are limited to ~107 bytes
    sock = short / "r.sock"
    try:
        server = redis_factory("--requirepass", "s3cret", "--unixsocket", str(sock), "--unixsocketperm", "700")
        eventually(sock.exists)
        _check_urls(server, sock)
    finally:
        shutil.rmtree(short, ignore_errors=True)


def _check_urls(server: RedisServer, sock: Path) -> None:
    for url in (f"redis://:s3cret@127.0.0.1:{server.port}/0", f"unix://:s3cret@{sock}?db=0"):
        tier = RedisTier(url, NS)
        assert tier.put(key(1), payload(1)) and tier.get(key(1)) == payload(1)
        tier.close()
    wrong = RedisTier(f"redis://:nope@127.0.0.1:{server.port}/0", NS)
    assert timed(lambda: wrong.get(key(1))) is None and wrong.unavailable == 1
    wrong.close()


def test_namespaces_never_see_each_other(redis_server: RedisServer) -> None:
    a, b = RedisTier(redis_server.url, NS), RedisTier(redis_server.url, OTHER_NS)
    assert a.put(key(1), payload(1))
    assert not b.contains(key(1)) and b.get(key(1)) is None
    assert b.put(key(1), payload(2))
    assert a.get(key(1)) == payload(1) and b.get(key(1)) == payload(2)
    assert a.stats().corrupt == b.stats().corrupt == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "garbage"])
def test_corrupt_value_is_a_miss_and_deleted(redis_server: RedisServer, damage: str) -> None:
    tier = RedisTier(redis_server.url, NS)
    tier.put(key(1), payload(1))
    client, name = redis_server.client(), tier.redis_key(key(1))
    stored = client.get(name)
    assert isinstance(stored, bytes)
    raw = bytearray(stored)
    if damage == "flip":
        raw[codec.HEADER_BYTES + 5] ^= 0x10
    elif damage == "truncate":
        raw = raw[:-1]
    elif damage == "foreign":  # another namespace's object under our name
        raw = bytearray(codec.encode(OTHER_NS, key(1), payload(1)))
    else:
        raw = bytearray(b"not a chunk")
    client.set(name, bytes(raw))
    assert tier.get(key(1)) is None
    assert client.exists(name) == 0
    s = tier.stats()
    assert (s.corrupt, s.misses, s.hits) == (1, 1, 0)


def test_ttl_is_applied(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, NS, ttl_s=60)
    tier.put(key(1), payload(1))
    assert 0 < redis_server.client().pttl(tier.redis_key(key(1))) <= 60_000


def _assert_down(tier: RedisTier) -> None:
    assert timed(lambda: tier.get(key(1))) is None
    assert timed(lambda: tier.contains(key(1))) is False
    assert timed(lambda: tier.contains_many([key(1), key(2)])) == [False, False]
    assert timed(lambda: tier.put(key(3), payload(3))) is False
    assert timed(lambda: tier.delete(key(1))) is False


def test_server_stopped_then_restarted(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, NS, timeout_s=0.3, retry_after_s=0.2)
    assert tier.put(key(1), payload(1)) and tier.get(key(1)) == payload(1)
    redis_server.stop()
    _assert_down(tier)
    assert not tier.available and tier.unavailable >= 5
    assert tier.stats().dropped == 1
    time.sleep(0.25)
    _assert_down(tier)  # retried after the delay: still down, still bounded
    redis_server.start()  # same port, empty (no persistence)
    eventually(lambda: tier.put(key(1), payload(1)))
    assert tier.available and tier.get(key(1)) == payload(1) and tier.contains(key(1))


def test_paused_server_times_out_then_recovers(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, NS, timeout_s=0.2, retry_after_s=0.2)
    assert tier.put(key(1), payload(1))
    redis_server.pause()
    try:
        assert timed(lambda: tier.get(key(1))) is None  # a real timeout, then the outage window
        _assert_down(tier)
    finally:
        redis_server.resume()
    eventually(lambda: tier.get(key(1)) == payload(1))
    assert tier.contains_many([key(1)]) == [True]


def test_needs_url_or_client() -> None:
    with pytest.raises(ValueError, match="url or a client"):
        RedisTier(None, NS)


def test_an_outage_is_one_line_and_its_end_one_line(
    redis_factory: Callable[..., RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_factory("--requirepass", "pw")
    url = f"redis://:pw@127.0.0.1:{server.port}/0"
    tier = RedisTier(url, NS, timeout_s=0.3, retry_after_s=0.1)
    assert tier.put(key(1), payload(1))
    caplog.set_level(logging.INFO, logger="kvdepot")
    server.stop()
    for _ in range(4):  # several retry windows of the same outage
        _assert_down(tier)
        time.sleep(0.12)
    server.start()
    eventually(lambda: tier.put(key(1), payload(1)))
    assert tier.get(key(1)) == payload(1)
    lines = [r for r in caplog.records if r.name == "kvdepot"]
    assert len(lines) == 2, [r.getMessage() for r in lines]
    down, up = (r.getMessage() for r in lines)
    where = f"redis://:***@127.0.0.1:{server.port}/0"  # the URL, its password hidden
    assert where in down and "unavailable" in down and "pw@" not in down
    assert where in up and "available again" in up
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in lines)  # no traceback
    assert tier.stats().unavailable >= 20 and tier.stats().errors >= 4
    tier.close()


@pytest.mark.parametrize("url", ["localhost:6379", "http://h:6379", "redis://", "unix://", "redis://h:notaport"])
def test_a_malformed_url_is_refused_at_config_load(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"config key 'remote_url'.*(redis://|needs|port)"):
        load_config(remote_url=url)
    monkeypatch.setenv("KVDEPOT_REMOTE_URL", url)
    with pytest.raises(ConfigError, match="remote_url"):
        load_config()
    with pytest.raises(ValueError, match="redis URL"):
        RedisTier(url, NS)


def test_a_cluster_seed_must_be_tcp() -> None:
    with pytest.raises(ConfigError, match="remote_url.*cluster"):
        load_config(remote_url="unix:///tmp/r.sock", remote_cluster=True)
    assert load_config(remote_url="redis://10.0.0.1:7000", remote_cluster=True).remote_cluster
    assert load_config(remote_url="unix:///tmp/r.sock").remote_url == "unix:///tmp/r.sock"


def test_the_secret_is_not_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDEPOT_REMOTE_SECRET", "hunter2")
    config = load_config()
    assert config.remote_secret == "hunter2" and "hunter2" not in repr(config)
    with pytest.raises(ConfigError, match="remote_secret"):
        load_config(remote_secret="")
