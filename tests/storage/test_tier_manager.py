"""TierManager: find across tiers, promotion into reserved targets (and, through ``Promotions``,
into host slots), the write-behind queue, admission, shutdown; and the leader's tier sizing. The remote tier is an in-memory fake whose writes can be
held until the test says so (and one test runs against a real redis-server)."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvdepot.config import load_config
from kvdepot.errors import ConfigError
from kvdepot.keys import ChunkKey
from kvdepot.storage import codec
from kvdepot.storage.admission import SecondHit
from kvdepot.storage.base import CopyInto, TierStats
from kvdepot.storage.disk import OFFSET, DiskTier
from kvdepot.storage.host import HostTier
from kvdepot.storage.manager import Lent, TierManager
from kvdepot.storage.promotions import Promotions
from kvdepot.storage.redis_tier import RedisTier
from kvdepot.storage.sizing import TierSizes, size_tiers

if TYPE_CHECKING:
    from conftest import RedisServer  # tests/conftest.py

NS = bytes(range(16))


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def payload(i: int) -> bytes:
    return bytes([i % 256]) * 512


class MemoryTier(CopyInto):
    """A reference lower tier in a dict; ``gate`` (when set) holds every put until it opens."""

    def __init__(self, name: str = "memory") -> None:
        self.name = name
        self.objects: dict[ChunkKey, bytes] = {}
        self.gate: threading.Event | None = None
        self.closed = False
        self._stats = TierStats(name=name)

    def contains(self, key: ChunkKey) -> bool:
        return key in self.objects

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [k in self.objects for k in keys]

    def get(self, key: ChunkKey) -> bytes | None:
        return self.objects.get(key)

    def put(self, key: ChunkKey, payload: codec.Payload) -> bool:
        if self.gate is not None:
            self.gate.wait(5)
        self.objects[key] = bytes(payload)
        self._stats.puts += 1
        return True

    def delete(self, key: ChunkKey) -> bool:
        return self.objects.pop(key, None) is not None

    def stats(self) -> TierStats:
        return self._stats

    def note_write_dropped(self) -> None:
        self._stats.dropped += 1

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def disk(tmp_path: Path) -> DiskTier:
    return DiskTier(tmp_path / "disk", 10**7, NS)


@pytest.fixture
def make(disk: DiskTier) -> Iterator[Callable[..., TierManager]]:
    made: list[TierManager] = []

    def build(**kwargs: object) -> TierManager:
        kwargs.setdefault("disk", disk)
        made.append(TierManager(**kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield build
    for manager in made:
        manager.close()


class Sink:
    """Promotion targets in plain memory: ``got`` = (key, bytes) committed, ``freed`` = keys whose
    read failed; refuses the target after ``refuse_at`` reservations (reads run several at once:
    reservations run ahead of commits); ``present`` keys are there already. Every target must be
    finished exactly once (``finished`` counts the calls per key)."""

    def __init__(self, refuse_at: int | None = None, size: int = 512, present: Sequence[ChunkKey] = ()) -> None:
        self.got: list[tuple[ChunkKey, bytes]] = []
        self.freed: list[ChunkKey] = []
        self.reserved = 0
        self.finished: dict[ChunkKey, int] = {}
        self.refuse_at, self.size, self.present = refuse_at, size, set(present)

    def __call__(self, key: ChunkKey) -> tuple[memoryview | None, Callable[[bool], None]] | None:
        if self.refuse_at is not None and self.reserved == self.refuse_at:
            return None
        self.reserved += 1
        if key in self.present:
            return None, lambda ok: None
        buf = bytearray(self.size)

        def done(ok: bool) -> None:
            self.finished[key] = self.finished.get(key, 0) + 1
            if ok:
                self.got.append((key, bytes(buf)))
            else:
                self.freed.append(key)

        return memoryview(buf), done


def verify_written(manager: TierManager, *, written: int, dropped: int = 0, deferred: int = 0) -> None:
    manager.flush()
    s = manager.stats()
    assert (s.written, s.dropped, s.deferred) == (written, dropped, deferred)


def test_find_counts_consecutive_chunks_across_tiers(make: Callable[..., TierManager], disk: DiskTier) -> None:
    remote = MemoryTier()
    manager = make(remote=remote)
    disk.put(key(0), payload(0))
    remote.put(key(1), payload(1))
    disk.put(key(2), payload(2))
    remote.put(key(2), payload(2))
    remote.put(key(4), payload(4))
    keys = [key(i) for i in range(5)]
    assert manager.find(keys) == 3
    assert manager.find(keys[1:]) == 2
    assert manager.find(keys[3:]) == 0
    assert manager.find([]) == 0
    assert TierManager().find(keys) == 0  # no lower tiers at all


def test_promote_reads_the_highest_tier_and_fills_disk(make: Callable[..., TierManager], disk: DiskTier) -> None:
    remote = MemoryTier()
    manager = make(remote=remote)
    disk.put(key(0), payload(0))
    remote.put(key(0), b"stale copy: the disk is read first")
    remote.put(key(1), payload(1))
    sink = Sink()
    assert manager.promote([key(0), key(1), key(2)], sink).result(timeout=5) == 2
    assert sink.got == [(key(0), payload(0)), (key(1), payload(1))]
    verify_written(manager, written=1)
    assert disk.get(key(1)) == payload(1)  # promoted from Redis, now on disk too
    assert manager.stats().promoted == 2


def test_promote_reads_the_disk_into_the_target(make: Callable[..., TierManager], disk: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = make()
    disk.put(key(0), payload(0))
    monkeypatch.setattr(disk, "get", None)  # get_into only: no fresh memory per chunk
    sink = Sink(present=[key(1)])
    assert manager.promote([key(0), key(1)], sink).result(timeout=5) == 2  # key(1): there already
    assert sink.got == [(key(0), payload(0))] and sink.freed == []


def test_corrupt_missing_or_wrong_sized_chunks_free_the_target(make: Callable[..., TierManager], disk: DiskTier) -> None:
    remote = MemoryTier()
    manager = make(remote=remote, promote_to_disk=False)
    for i in range(3):
        disk.put(key(i), payload(i))
    remote.put(key(1), payload(1))
    path = Path(disk._path(key(0)))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(raw)
    Path(disk._path(key(1))).write_bytes(raw[:100])  # truncated: Redis still has it
    sink = Sink()
    assert manager.promote([key(0)], sink).result(timeout=5) == 0
    assert sink.freed == [key(0)] and not disk.contains(key(0))  # corrupt: removed, nothing served
    assert manager.promote([key(1), key(2)], sink).result(timeout=5) == 2  # disk corrupt, Redis good
    assert sink.got == [(key(1), payload(1)), (key(2), payload(2))]
    remote.put(key(3), payload(3)[:100])
    disk.put(key(4), payload(4) * 2)  # longer than a target
    for k in (key(3), key(4), key(5)):
        assert manager.promote([k], sink).result(timeout=5) == 0
    assert sink.freed == [key(0), key(3), key(4), key(5)] and len(sink.got) == 2
    assert disk.contains(key(4))  # valid, just not this target's size: kept


def test_promotions_into_host_slots(make: Callable[..., TierManager], disk: DiskTier) -> None:
    """Through the engine's ``Promotions``: a slot is invisible until committed, a corrupt chunk
    frees its slot, and pins go back to zero."""
    gate, entered = threading.Event(), threading.Event()
    get_into = disk.get_into

    def slow_get_into(k: ChunkKey, out: codec.Payload, *, held: int | None = None) -> int | None:
        entered.set()
        gate.wait(5)
        return get_into(k, out, held=held)

    manager = make(promote_to_disk=False)
    host = HostTier(4 * 512, 512)
    promotions = Promotions(host, manager, threading.Lock(), lease_timeout_s=60)
    keys = [key(i) for i in range(3)]
    for i in range(3):
        disk.put(key(i), payload(i))
    path = Path(disk._path(key(2)))
    path.write_bytes(path.read_bytes()[:-1])  # truncated
    disk.get_into = slow_get_into  # type: ignore[method-assign]
    assert promotions.find(keys, 0, "lease") == 3
    assert entered.wait(5)
    assert host.lookup(keys) == 0 and not promotions.done("lease")  # WRITING: not visible
    assert promotions.promoted("lease") is None  # still running
    gate.set()
    deadline = time.monotonic() + 5
    while not promotions.done("lease") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert promotions.promoted("lease") == 2  # stopped short: what a lookup's status must shrink to
    promotions.settle("lease")
    assert host.lookup(keys) == 2 and not host.contains(key(2))
    assert bytes(host.slot(key(1)).numpy()) == payload(1)
    assert host.holds("lease", key(0)) and not host.holds("lease", key(2))
    assert host.stats().puts == 2 and len(host._free) == 2  # the corrupt chunk's slot is free again
    promotions.release("lease")
    assert host.pinned_chunks == 0 and host.live_leases == 0


def test_promote_stops_at_the_first_refusal(make: Callable[..., TierManager], disk: DiskTier) -> None:
    manager = make(promote_to_disk=False)
    for i in range(4):
        disk.put(key(i), payload(i))
    future = manager.promote([key(i) for i in range(4)], Sink(refuse_at=2))
    assert future.result(timeout=5) == 2 and future.done()


def test_promote_to_disk_can_be_off(make: Callable[..., TierManager], disk: DiskTier) -> None:
    remote = MemoryTier()
    remote.put(key(1), payload(1))
    manager = make(remote=remote, promote_to_disk=False)
    assert manager.promote([key(1)], Sink()).result(timeout=5) == 1
    verify_written(manager, written=0)
    assert not disk.contains(key(1))


def test_write_behind_writes_every_tier_once(make: Callable[..., TierManager], disk: DiskTier) -> None:
    remote = MemoryTier()
    manager = make(remote=remote)
    calls: list[ChunkKey] = []

    def provider(i: int) -> Callable[[], bytes]:
        def read() -> bytes:
            calls.append(key(i))
            return payload(i)

        return read

    assert manager.write_behind(key(1), provider(1))
    verify_written(manager, written=2)
    assert disk.get(key(1)) == payload(1) and remote.get(key(1)) == payload(1)
    assert manager.write_behind(key(1), provider(1))  # present everywhere: nothing rewritten
    verify_written(manager, written=2)
    assert remote.stats().puts == 1 and disk.stats().puts == 1 and calls == [key(1)]  # nothing missing: not even read


def test_a_lent_payload_is_given_back_once_every_tier_has_written_it(make: Callable[..., TierManager],
                                                                     disk: DiskTier) -> None:
    """The engine lends its pinned host slot (``Lent``): it must stay lent through every tier's
    write, and be given back exactly once after the last."""
    remote = MemoryTier()
    remote.gate = threading.Event()
    manager = make(remote=remote)
    released: list[int] = []
    lent = Lent(memoryview(bytearray(payload(1))), lambda: released.append(1))
    assert manager.write_behind(key(1), lambda: lent)
    time.sleep(0.2)  # the writer is now held in the remote's put, the disk's done or not begun
    assert released == []
    remote.gate.set()
    verify_written(manager, written=2)
    assert released == [1] and disk.get(key(1)) == payload(1) and remote.get(key(1)) == payload(1)


def test_a_lent_payload_is_given_back_when_a_tier_fails(make: Callable[..., TierManager]) -> None:
    class Broken(MemoryTier):
        def put(self, key: ChunkKey, payload: codec.Payload) -> bool:
            raise OSError("the tier went away")

    manager = make(disk=None, remote=Broken())
    released: list[int] = []
    assert manager.write_behind(key(1), lambda: Lent(memoryview(payload(1)), lambda: released.append(1)))
    manager.flush()
    assert released == [1] and manager.stats().write_failures == 1


def test_write_behind_queue_is_bounded_and_never_blocks(make: Callable[..., TierManager]) -> None:
    remote = MemoryTier()
    remote.gate = threading.Event()
    manager = make(disk=None, remote=remote, queue_depth=2, writers=1)
    taken = threading.Event()

    def first() -> bytes:
        taken.set()
        return payload(0)

    accepted = [manager.write_behind(key(0), first)]
    assert taken.wait(5)  # the writer holds job 0 (blocked in the gated put)
    started = time.monotonic()
    accepted += [manager.write_behind(key(i), functools.partial(payload, i)) for i in range(1, 6)]
    assert time.monotonic() - started < 0.5
    assert accepted == [True, True, True, False, False, False]
    remote.gate.set()
    verify_written(manager, written=3, dropped=3)
    assert sorted(remote.objects) == [key(0), key(1), key(2)]


def test_a_long_prompts_write_behind_is_not_dropped_by_default(make: Callable[..., TierManager]) -> None:
    """512 chunks (a 128K-token prompt at chunk 256) queued while the writer is stuck: all kept.
    With the old default depth of 32, all but 32 were dropped and never reached Redis."""
    remote = MemoryTier()
    remote.gate = threading.Event()
    manager = make(disk=None, remote=remote, writers=1)
    assert all(manager.write_behind(key(i), functools.partial(payload, i)) for i in range(512))
    remote.gate.set()
    verify_written(manager, written=512)


def test_copies_that_hold_their_payload_have_their_own_small_bound(make: Callable[..., TierManager]) -> None:
    """Copies promoted from Redis to disk carry their bytes in the queue: at most held_depth wait,
    while plain (lazy) jobs still queue behind them."""
    remote = MemoryTier()
    remote.gate = threading.Event()
    manager = make(disk=None, remote=remote, writers=1, held_depth=2)
    taken = threading.Event()

    def first() -> bytes:
        taken.set()
        return payload(0)

    assert manager.write_behind(key(0), first)
    assert taken.wait(5)  # the writer is stuck in job 0's gated put
    held = [manager._enqueue(key(i), functools.partial(payload, i), (remote,), internal=True, holds=True) for i in (1, 2, 3)]
    assert held == [True, True, False]
    assert manager.write_behind(key(4), functools.partial(payload, 4))  # a lazy job is not held back
    remote.gate.set()
    verify_written(manager, written=4, dropped=1)
    assert manager._enqueue(key(5), functools.partial(payload, 5), (remote,), internal=True, holds=True)  # the bound freed up


def test_gone_chunks_and_bad_providers_are_counted(make: Callable[..., TierManager], disk: DiskTier) -> None:
    manager = make()

    def broken() -> bytes:
        raise RuntimeError("engine bug")

    assert manager.write_behind(key(1), lambda: None)
    assert manager.write_behind(key(2), broken)
    assert manager.write_behind(key(3), lambda: payload(3))  # the writer survived
    verify_written(manager, written=1)
    s = manager.stats()
    assert (s.gone, s.write_failures) == (1, 1) and disk.contains(key(3))


def test_second_hit_admission(make: Callable[..., TierManager], disk: DiskTier) -> None:
    remote = MemoryTier()
    manager = make(remote=remote, admission="second_hit")
    assert manager.write_behind(key(1), lambda: payload(1))
    assert manager.write_behind(key(2), lambda: payload(2))
    verify_written(manager, written=2, deferred=2)  # Redis took both, the disk neither
    assert not disk.contains(key(1)) and remote.contains(key(1))
    manager.note_hits([key(1)])  # reused from host memory: admitted, written from its provider
    verify_written(manager, written=3, deferred=2)
    assert disk.get(key(1)) == payload(1)
    assert manager.write_behind(key(2), lambda: payload(2))  # stored a second time: admitted
    verify_written(manager, written=4, deferred=2)
    assert disk.contains(key(2))
    manager.note_hits([key(3)])
    assert manager.write_behind(key(3), lambda: payload(3))  # hit then stored: second sighting
    verify_written(manager, written=6, deferred=2)


def test_second_hit_memory_is_bounded() -> None:
    policy = SecondHit(memory=2)
    assert [policy.admit(key(i)) for i in (1, 2, 3, 1)] == [False, False, False, False]
    assert policy.admit(key(1)) and policy.admit(key(3))


def test_close_joins_threads_and_refuses_work(disk: DiskTier) -> None:
    before = threading.active_count()
    remote = MemoryTier()
    manager = TierManager(disk, remote, promoters=2, writers=2)
    disk.put(key(0), payload(0))
    futures = [manager.promote([key(0)], Sink()) for _ in range(4)]
    for i in range(1, 5):
        manager.write_behind(key(i), functools.partial(payload, i))
    assert threading.active_count() > before
    manager.close()
    manager.close()  # idempotent
    assert threading.active_count() == before
    assert all(f.result() == 1 for f in futures)
    assert all(disk.contains(key(i)) for i in range(1, 5))  # drained, not dropped
    assert remote.closed
    assert not manager.write_behind(key(9), lambda: payload(9))
    assert manager.promote([key(0)], Sink()).result() == 0


def test_close_without_drain_drops_queued_writes(disk: DiskTier) -> None:
    before = threading.active_count()
    remote = MemoryTier()
    remote.gate = threading.Event()
    manager = TierManager(None, remote, queue_depth=8)
    for i in range(5):
        manager.write_behind(key(i), functools.partial(payload, i))
    opener = threading.Timer(0.1, remote.gate.set)
    opener.start()
    manager.close(drain=False)
    opener.join()
    s = manager.stats()
    assert s.written + s.dropped == 5 and s.dropped >= 4  # at most the job in the writer's hands
    assert threading.active_count() == before


def test_size_tiers() -> None:
    sizes = size_tiers(bytes_per_block=1_000_000, host_capacity_gb=1.0, disk_capacity_gb=2.5, blocks_per_chunk=4)
    assert sizes == TierSizes(1_000_000, 4, host_chunks=250, disk_chunks=624, num_host_blocks=1000, num_disk_blocks=2496)
    assert size_tiers(4096, 0, 0, 16).num_disk_blocks == 0
    small = size_tiers(4096, 0, 0.001, 1)  # a disk file is its 4 KiB header block + the payload
    assert small.disk_chunks == 10**6 // (4096 + OFFSET) == 122
    with pytest.raises(ConfigError):
        size_tiers(0, 1, 1, 1)
    with pytest.raises(ConfigError):
        size_tiers(1, -1, 1, 1)


def test_bad_options_raise() -> None:
    with pytest.raises(ConfigError, match="admission"):
        TierManager(admission="third_hit")
    with pytest.raises(ConfigError):
        TierManager(queue_depth=0)


def test_from_config_with_disk_and_redis(tmp_path: Path, redis_server: RedisServer) -> None:
    config = load_config(disk_path=str(tmp_path / "d"), disk_capacity_gb=0.001, remote_url=redis_server.url)
    manager = TierManager.from_config(config, NS)
    try:
        assert isinstance(manager.disk, DiskTier) and isinstance(manager.remote, RedisTier)
        assert manager.disk.capacity_bytes == 1_000_000
        assert manager.write_behind(key(1), lambda: payload(1))
        manager.flush()
        assert manager.find([key(1), key(2)]) == 1
        manager.disk.delete(key(1))  # only Redis has it now
        sink = Sink()
        assert manager.promote([key(1)], sink).result(timeout=5) == 1 and sink.got[0][1] == payload(1)
        manager.flush()
        assert manager.disk.contains(key(1))
    finally:
        manager.close()
    empty = TierManager.from_config(load_config(disk_path=None, remote_url=None), NS)
    assert empty.tiers == []
    empty.close()


def test_unusable_disk_path_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(ConfigError, match="disk_path"):
        TierManager.from_config(load_config(disk_path=str(blocker / "sub"), remote_url=None), NS)
