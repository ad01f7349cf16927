"""First-request hits from disk and Redis, in-process (``lower_tier_hits: load``, the default).

A fresh engine's first request is served the 1792 tokens another engine stored through Redis, a
restarted engine's from its disk tier, every byte equal to what was stored. Each failure injected
between the promise (``(1792, True)``) and the read ends as a good load from another copy or as
an error response (TensorRT-LLM 1.2 cannot take the promise back), never as output over wrong KV
and never as a hang. The failure cases are listed, with their endings, in docs/tiers.md.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from first_hits_rig import (
    HIT,
    Gate,
    Rig,
    assert_error_then_recovers,
    assert_first_hit_exact,
    engine,
    prompt_a,
    worker_of,
    write,
)

from kvdepot.integrations.tensorrt_llm.providers import current_engine, destroy_engine

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def tiers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, redis_factory):
    """Configure the tiers a case names ("disk", "redis"); host memory for 22 chunks."""

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
        return redis

    return configure


def test_fresh_engine_first_request_hits_from_redis(tiers) -> None:
    tiers("redis")
    written = write()
    destroy_engine()  # drains write-behind to Redis, like the writer process exiting
    rig = Rig()
    eng = engine(rig)  # a fresh engine: empty host tier, the same Redis
    hit = eng.generate([prompt_a()], 4)[0]
    assert rig.promised[0] == (HIT, True)
    assert_first_hit_exact(eng, rig, hit, written)
    stats = current_engine().stats()
    assert stats.lower[0].hits == HIT // 256 and stats.live_leases == 0 and stats.pinned_chunks == 0
    assert worker_of(eng).stats.failed_promises == 0


def test_restarted_engine_first_request_hits_from_disk(tiers) -> None:
    tiers("disk")
    written = write()
    destroy_engine()
    rig = Rig()
    eng = engine(rig)
    hit = eng.generate([prompt_a()], 4)[0]
    assert rig.promised[0] == (HIT, True)
    assert_first_hit_exact(eng, rig, hit, written)
    assert current_engine().stats().live_leases == 0


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


# (case, tiers, injection, ends as a good load?)
CASES = [
    ("host-eviction", ("redis",), lambda r: _flood_host(), True),
    ("disk-file-removed", ("disk",), lambda r: _remove_disk_file(), True),  # held open since the lookup
    ("disk-file-removed-redis-has-it", ("disk", "redis"), lambda r: _remove_disk_file(), True),
    ("disk-file-corrupt", ("disk",), lambda r: _corrupt_disk_file(), False),
    ("disk-file-corrupt-redis-has-it", ("disk", "redis"), lambda r: _corrupt_disk_file(), True),
    ("redis-value-deleted", ("redis",), _delete_redis_value, False),
    ("redis-value-corrupt", ("redis",), _corrupt_redis_value, False),
    ("redis-killed", ("redis",), lambda r: r.stop(), False),
]


@pytest.mark.parametrize(("case", "names", "inject", "good"), CASES, ids=[c[0] for c in CASES])
def test_failure_between_promise_and_load(case, names, inject, good, tiers, monkeypatch, caplog) -> None:
    redis = tiers(*names)
    written = write()
    destroy_engine()
    caplog.set_level(logging.ERROR, logger="kvdepot")
    gate = Gate(monkeypatch)
    rig = Rig()
    eng = engine(rig)

    def after_promise() -> None:
        if case == "host-eviction":
            gate.open()  # this failure comes after the read: the promoted slots are pinned
        inject(redis)
        gate.open()

    rig.after_promise = after_promise
    first = eng.generate([prompt_a()], 4)[0]
    assert rig.promised[0] == (HIT, True)
    worker = worker_of(eng)
    if good:
        assert_first_hit_exact(eng, rig, first, written)
        assert worker.stats.failed_promises == 0
    else:
        assert worker.stats.failed_promises == 1
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and "promised" in r.getMessage()]
        assert len(errors) == 1 and f"req={first.request_id} loaded" in errors[0]
        assert_error_then_recovers(eng, first, written)
    depot = current_engine()
    depot.wait_promotions(timeout=30)
    stats = depot.stats()
    assert stats.live_leases == 0 and stats.pinned_chunks == 0 and stats.inflight_transfers == 0
