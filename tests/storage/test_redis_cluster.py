"""RedisTier with ``cluster=True`` against a real 3-master Redis Cluster on loopback: values spread
over every master, no command spans slots, a dead master costs misses for its slots only (never an
error), and its keys hit again once it is back."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvdepot.config import load_config
from kvdepot.keys import ChunkKey
from kvdepot.storage import codec
from kvdepot.storage.manager import TierManager
from kvdepot.storage.redis_tier import RedisTier
from redis_server import REDIS_CLI, REDIS_SERVER, RedisClusterServers

NS = bytes(range(16))
N = 48  # chunks: every master gets some
# A call to a dead master is refused at once; the live masters get a generous socket timeout, as
# a loaded 2-core CI box can stall a loopback reply past a second (then a live node would count as
# down, which is the tier's right answer but not this test's subject). Latency bounds under
# timeouts are test_redis_tier.py's.
TIMEOUT_S = 2.0
CALL_LIMIT_S = 2 * TIMEOUT_S + 1  # at most: the call, then redis-py re-reading the slot map


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def payload(i: int, n: int = 5000) -> bytes:
    return bytes((i * 31 + j) % 251 for j in range(n))


def eventually(fn: Callable[[], bool], within_s: float = 15.0) -> float:
    started = time.monotonic()
    while not fn():
        assert time.monotonic() - started < within_s, "condition not reached in time"
        time.sleep(0.05)
    return time.monotonic() - started


def timed(fn: Callable[[], object]) -> object:
    started = time.monotonic()
    result = fn()
    assert time.monotonic() - started < CALL_LIMIT_S
    return result


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server/redis-cli not found: apt-get install redis-server (brings redis-tools)")
    servers = RedisClusterServers(Path(tmp_path_factory.mktemp("cluster")))
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()


def test_values_spread_over_every_master(cluster: RedisClusterServers) -> None:
    tier = RedisTier(cluster.url, NS, cluster=True, timeout_s=TIMEOUT_S)
    assert all(tier.put(key(i), payload(i)) for i in range(N))
    assert all(tier.get(key(i)) == payload(i) for i in range(N))
    assert tier.contains_many([key(i) for i in range(N)] + [key(N)]) == [True] * N + [False]
    holders = {cluster.node_of(tier.redis_key(key(i))).port for i in range(N)}
    assert len(holders) == 3  # the keys span all slots' masters: a multi-key command would CROSSSLOT
    for node in cluster.nodes:  # what each master was asked: single-key commands only
        stats = node.client().info("commandstats")
        assert not {"cmdstat_mget", "cmdstat_mset", "cmdstat_multi"} & set(stats)
    assert tier.stats().errors == 0
    tier.close()


def test_a_dead_master_costs_its_slots_only_and_hits_resume(
    cluster: RedisClusterServers, caplog: pytest.LogCaptureFixture
) -> None:
    tier = RedisTier(cluster.url, NS, cluster=True, timeout_s=TIMEOUT_S, retry_after_s=0.2)
    keys = [key(100 + i) for i in range(N)]
    assert all(tier.put(k, payload(i)) for i, k in enumerate(keys)), tier.stats()
    victim = cluster.nodes[1]  # not the seed
    lost = [cluster.node_of(tier.redis_key(k)) is victim for k in keys]
    assert 0 < sum(lost) < N
    caplog.set_level(logging.INFO, logger="kvdepot")
    victim.stop()
    for _ in range(3):  # several retry windows
        got = [timed(lambda k=k: tier.get(k)) for k in keys]
        logged = [r.getMessage() for r in caplog.records]
        assert [g is None for g in got] == lost, logged  # misses exactly for the dead master's slots
        assert all(g == payload(i) for i, g in enumerate(got) if not lost[i])  # hits, bit-exact, elsewhere
        into = [bytearray(len(payload(0))) for _ in keys]  # the promotions' path: the same answers
        found = [timed(lambda k=k, out=out: tier.get_into(k, out)) for k, out in zip(keys, into, strict=True)]
        assert [n is None for n in found] == lost
        assert all(out == payload(i) for i, out in enumerate(into) if not lost[i])
        assert timed(lambda: tier.contains_many(keys)) == [not x for x in lost]
        assert tier.put(key(999), payload(999)) is (cluster.node_of(tier.redis_key(key(999))) is not victim)
        time.sleep(0.25)
    victim.start()  # same port, its slots (nodes.conf) and data (append-only file) with it
    back_s = eventually(lambda: all(tier.get(k) == payload(i) for i, k in enumerate(keys)))
    assert tier.contains_many(keys) == [True] * N
    lines = [r.getMessage() for r in caplog.records if r.name == "kvdepot"]
    assert len(lines) == 2 and f"127.0.0.1:{victim.port}" in lines[0] and "available again" in lines[1], lines
    print(f"hits for every key {back_s:.2f}s after the master restarted; {tier.stats().unavailable} calls skipped")
    tier.close()


def test_a_dead_seed_at_start_is_an_outage_not_an_error(cluster: RedisClusterServers) -> None:
    seed = cluster.nodes[0]
    seed.stop()
    try:
        tier = RedisTier(cluster.url, NS, cluster=True, timeout_s=TIMEOUT_S, retry_after_s=0.1)  # no I/O yet
        assert timed(lambda: tier.get(key(1))) is None and not tier.put(key(1), payload(1))
        assert tier.contains_many([key(1), key(2)]) == [False, False] and tier.unavailable >= 3
    finally:
        seed.start()
        cluster.wait_ok()
    eventually(lambda: tier.put(key(1), payload(1)))
    assert tier.get(key(1)) == payload(1)
    tier.close()


def test_config_builds_a_cluster_tier_with_tags(cluster: RedisClusterServers) -> None:
    config = load_config(remote_url=cluster.url, remote_cluster=True, remote_secret="s3cret", remote_timeout_s=TIMEOUT_S)
    manager = TierManager.from_config(config, NS)
    try:
        remote = manager.remote
        assert isinstance(remote, RedisTier) and remote.cluster
        assert manager.write_behind(key(500), lambda: payload(500))
        manager.flush()
        assert manager.find([key(500), key(501)]) == 1
        raw = cluster.node_of(remote.redis_key(key(500))).client().get(remote.redis_key(key(500)))
        assert isinstance(raw, bytes) and raw[6] & codec.FLAG_KEYED
        assert remote.get(key(500)) == payload(500)
    finally:
        manager.close()


def test_get_into_after_slots_moved_is_a_miss_then_hits(cluster: RedisClusterServers) -> None:
    """A stale slot map sends the GET to a node that answers -MOVED: a miss (read outside
    redis-py, which would have followed it), the slot map re-read, and the next read hits."""
    tier = RedisTier(cluster.url, NS, cluster=True, timeout_s=TIMEOUT_S)
    assert tier.put(key(700), payload(700))
    client = tier._connected()
    name = tier.redis_key(key(700))
    slot, owner = client.keyslot(name), client.get_node_from_key(name)
    other = next(n for n in client.get_primaries() if n.name != owner.name)
    client.nodes_manager.slots_cache[slot] = [other]  # as if the slot had moved away from `other`
    out = bytearray(len(payload(700)))
    assert tier.get_into(key(700), out) is None
    assert client.get_node_from_key(name).name == owner.name  # the map was read again
    assert tier.get_into(key(700), out) == len(out) and out == payload(700)
    s = tier.stats()
    assert (s.hits, s.misses, s.errors, s.unavailable) == (1, 1, 1, 0)
    tier.close()
