"""First-request hits from disk and Redis, in-process (``lower_tier_hits: load``, the default).

A fresh engine's first request is served the 1792 tokens another engine stored through Redis, a
restarted engine's from its disk tier, every byte equal to what was stored: its lookup waits while
they are read into host memory and then promises them synchronously (``(1792, False)``). Each
failure injected between the lookup and the read ends as a good load from another copy or as a
shorter promise — only what was read — with the rest recomputed; a failure after the promise
(host memory evicting) cannot touch the pinned bytes. Never output over wrong KV, never an error,
never a hang. The cases and their endings are listed in docs/tiers.md.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from first_hits_rig import (
    HIT,
    Gate,
    Rig,
    assert_first_hit_exact,
    assert_shorter_hit_right,
    engine,
    prompt_a,
    worker_of,
    write,
)

from kvdepot.integrations.tensorrt_llm.providers import current_engine, destroy_engine
from redis_server import REDIS_CLI, RedisClusterServers

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def tiers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, redis_factory) -> Iterator:
    """Configure the tiers a case names ("disk", "redis", or "cluster": a real 3-master Redis
    Cluster); host memory for 22 chunks."""
    clusters: list[RedisClusterServers] = []

    def configure(*names: str):
        monkeypatch.setenv("KVDEPOT_HOST_CAPACITY_GB", "0.003")
        monkeypatch.delenv("KVDEPOT_LOWER_TIER_HITS", raising=False)  # the default is under test
        redis = None
        if "disk" in names:
            monkeypatch.setenv("KVDEPOT_DISK_PATH", str(tmp_path / "depot"))
        if "redis" in names:
            redis = redis_factory()
            monkeypatch.setenv("KVDEPOT_REMOTE_URL", redis.url)
            monkeypatch.setenv("KVDEPOT_REMOTE_TIMEOUT_S", "0.5")
        if "cluster" in names:
            if REDIS_CLI is None:
                pytest.skip("redis-cli not found: apt-get install redis-server (brings redis-tools)")
            redis = RedisClusterServers(tmp_path / "cluster")
            clusters.append(redis)
            redis.start()
            monkeypatch.setenv("KVDEPOT_REMOTE_URL", redis.url)
            monkeypatch.setenv("KVDEPOT_REMOTE_CLUSTER", "true")
        return redis

    yield configure
    destroy_engine()
    for cluster in clusters:
        cluster.stop()


@pytest.mark.parametrize("redis", ["redis", "cluster"], ids=["one server", "3-master cluster"])
def test_fresh_engine_first_request_hits_from_redis(tiers, redis: str) -> None:
    """Issue 16's first figure: another process stored A through Redis (one server, or a real
    3-master Redis Cluster whose masters' slots the chunks spread over); a fresh engine's first
    request is served 1792 of its 1800 tokens, every byte equal to what was stored."""
    servers = tiers(redis)
    written = write()
    destroy_engine()  # drains write-behind to Redis, like the writer process exiting
    rig = Rig()
    eng = engine(rig)  # a fresh engine: empty host tier, the same Redis
    hit = eng.generate([prompt_a()], 4)[0]
    assert rig.promised[0] == (HIT, False)
    assert_first_hit_exact(eng, rig, hit, written)
    stats = settled_stats()
    assert stats.lower[0].hits == HIT // 256 and stats.live_leases == 0 and stats.pinned_chunks == 0
    assert worker_of(eng).stats.failed_promises == 0
    if redis == "cluster":
        depot = current_engine()
        names = [depot.lower.remote.redis_key(key) for key in depot.chunk_keys(prompt_a())[: HIT // 256]]
        assert len({servers.node_of(name).url for name in names}) > 1  # spread over the masters


def test_restarted_engine_first_request_hits_from_disk(tiers) -> None:
    tiers("disk")
    written = write()
    destroy_engine()
    rig = Rig()
    eng = engine(rig)
    hit = eng.generate([prompt_a()], 4)[0]
    assert rig.promised[0] == (HIT, False)
    assert_first_hit_exact(eng, rig, hit, written)
    assert settled_stats().live_leases == 0


def settled_stats():
    """The engine's stats once its write-behind is written: a chunk being written is pinned (its
    host slot is lent in place), so pins are counted after the writer is done."""
    depot = current_engine()
    depot.lower.flush()
    return depot.stats()


def _last_chunk():
    """The reader's engine and the key of A's last promised chunk."""
    depot = current_engine()
    key = depot.chunk_keys(prompt_a())[HIT // 256 - 1]
    return depot, key


def _remove_disk_file() -> None:
    depot, key = _last_chunk()
    os.unlink(depot.lower.disk._path(key))


def _corrupt_disk_file() -> None:
    depot, key = _last_chunk()
    path = Path(depot.lower.disk._path(key))
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def _redis_client():
    depot, key = _last_chunk()
    return depot.lower.remote, key


def _delete_redis_value(redis) -> None:
    tier, key = _redis_client()
    assert redis.client().delete(tier.redis_key(key)) == 1


def _corrupt_redis_value(redis) -> None:
    tier, key = _redis_client()
    name = tier.redis_key(key)
    value = bytearray(redis.client().get(name))
    value[-100] ^= 0xFF
    redis.client().set(name, bytes(value))


def _flood_host() -> None:
    """Evict everything host memory may evict: fill it with other chunks after the promotion."""
    depot = current_engine()
    depot.wait_promotions(timeout=30)
    promised = depot.chunk_keys(prompt_a())[: HIT // 256]
    with depot._lock:
        for i in range(2 * depot.host.num_slots):
            key = bytes([i % 256, i // 256]) * 8
            if depot.host.reserve(key) is not None:
                depot.host.commit(key, True)
        assert all(depot.host.contains(key) for key in promised), (depot.stats(), [depot.host.contains(k) for k in promised])  # pinned by the lease
    assert depot.stats().evictions > 0


# (case, tiers, injection, tokens promised: HIT = a good load from some copy)
SHORT = HIT - 256  # the last chunk failed: the six before it were read
CASES = [
    ("disk-file-removed", ("disk",), lambda r: _remove_disk_file(), HIT),  # held open since the lookup
    ("disk-file-removed-redis-has-it", ("disk", "redis"), lambda r: _remove_disk_file(), HIT),
    ("disk-file-corrupt", ("disk",), lambda r: _corrupt_disk_file(), SHORT),
    ("disk-file-corrupt-redis-has-it", ("disk", "redis"), lambda r: _corrupt_disk_file(), HIT),
    ("redis-value-deleted", ("redis",), _delete_redis_value, SHORT),
    ("redis-value-corrupt", ("redis",), _corrupt_redis_value, SHORT),
    ("redis-killed", ("redis",), lambda r: r.stop(), 0),
]


@pytest.mark.parametrize(("case", "names", "inject", "promised"), CASES, ids=[c[0] for c in CASES])
def test_failure_between_lookup_and_read(case, names, inject, promised, tiers, monkeypatch) -> None:
    redis = tiers(*names)
    written = write()
    destroy_engine()
    Gate(monkeypatch, lambda: inject(redis))
    rig = Rig()
    eng = engine(rig)
    first = eng.generate([prompt_a()], 4)[0]
    assert rig.promised[0] == (promised, False)
    if promised == HIT:
        assert_first_hit_exact(eng, rig, first, written)
    else:
        assert_shorter_hit_right(eng, rig, first, written, promised)
    assert worker_of(eng).stats.failed_promises == 0
    depot = current_engine()
    depot.wait_promotions(timeout=30)
    stats = settled_stats()
    assert stats.live_leases == 0 and stats.pinned_chunks == 0 and stats.inflight_transfers == 0


def test_host_eviction_after_the_promise_cannot_touch_the_promised_bytes(tiers) -> None:
    tiers("redis")
    written = write()
    destroy_engine()
    rig = Rig()
    rig.after_promise = _flood_host
    eng = engine(rig)
    first = eng.generate([prompt_a()], 4)[0]
    assert rig.promised[0] == (HIT, False)
    assert_first_hit_exact(eng, rig, first, written)
    stats = settled_stats()
    assert stats.live_leases == 0 and stats.pinned_chunks == 0


def test_a_slow_tier_is_waited_for_at_most_lower_tier_wait_s(tiers, monkeypatch) -> None:
    """A promotion slower than ``lower_tier_wait_s``: the lookup promises what is in host memory
    then (nothing here) and the request recomputes; the promotion runs on for later requests."""
    tiers("redis")
    written = write()
    destroy_engine()
    monkeypatch.setenv("KVDEPOT_LOWER_TIER_WAIT_S", "0.2")
    release = threading.Event()
    Gate(monkeypatch, lambda: release.wait(30))
    rig = Rig()
    eng = engine(rig)
    started = time.monotonic()
    first = eng.generate([prompt_a()], 4)[0]
    waited = time.monotonic() - started
    release.set()
    assert rig.promised[0] == (0, False) and first.error is None
    assert first.output_ids == written.result.output_ids
    assert waited < 20  # bounded by the wait, not by the held promotion (30 s)
    depot = current_engine()
    depot.wait_promotions(timeout=30)
    second = eng.generate([prompt_a()], 4)[0]  # the promotion landed meanwhile: a host hit now
    assert second.num_device_reused_tokens == HIT or second.num_connector_matched_tokens == HIT
    assert settled_stats().live_leases == 0

