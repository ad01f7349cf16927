"""Promotions read several chunks at once (``streams``) and keep the one-at-a-time contract: the
count is of consecutive chunks placed from the first, every target is finished exactly once and in
order, a miss or a refusal stops what follows; and chunks promoted from Redis go down to disk as
lazy jobs read back from host memory (``copy_from_host``), not as bytes held on the promotion's path."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
from test_tier_manager import NS, MemoryTier, Sink, key, payload

from kvdepot.keys import ChunkKey
from kvdepot.storage import codec
from kvdepot.storage.disk import DiskTier
from kvdepot.storage.manager import TierManager


class ScriptedTier(MemoryTier):
    """A remote tier whose reads wait until the test lets each one go, and that records how many
    run at once; ``broken`` keys raise from ``get_into`` (a tier's bug)."""

    def __init__(self) -> None:
        super().__init__("scripted")
        self.release: dict[ChunkKey, threading.Event] = {}
        self.broken: set[ChunkKey] = set()
        self.inside = self.most = 0
        self._count = threading.Lock()
        self.started = threading.Semaphore(0)

    def get_into(self, key: ChunkKey, out: codec.Payload) -> int | None:
        with self._count:
            self.inside += 1
            self.most = max(self.most, self.inside)
        self.started.release()
        try:
            gate = self.release.get(key)
            if gate is not None:
                assert gate.wait(5), "the test never let this read go"
            if key in self.broken:
                raise RuntimeError("tier bug")
            return super().get_into(key, out)
        finally:
            with self._count:
                self.inside -= 1


@pytest.fixture
def managers() -> Iterator[Callable[..., TierManager]]:
    made: list[TierManager] = []

    def build(*tiers: object, **kwargs: object) -> TierManager:
        made.append(TierManager(*tiers, promote_to_disk=False, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield build
    for manager in made:
        manager.close()


def filled(n: int) -> ScriptedTier:
    remote = ScriptedTier()
    for i in range(n):
        remote.objects[key(i)] = payload(i)
    return remote


def test_reads_run_several_at_once_and_finish_in_order(managers: Callable[..., TierManager]) -> None:
    remote = filled(6)
    gates = {key(i): threading.Event() for i in range(6)}
    remote.release = gates
    manager = managers(None, remote, streams=3)
    sink = Sink()
    future = manager.promote([key(i) for i in range(6)], sink)
    for _ in range(3):
        assert remote.started.acquire(timeout=5)
    assert remote.inside == 3 and sink.reserved == 3  # three in flight, nothing reserved beyond them
    for i in reversed(range(6)):  # the last read ends first
        gates[key(i)].set()
    assert future.result(timeout=5) == 6
    assert [k for k, _ in sink.got] == [key(i) for i in range(6)]  # targets finished in order
    assert [b for _, b in sink.got] == [payload(i) for i in range(6)]
    assert remote.most == 3 and set(sink.finished.values()) == {1}


def test_one_stream_reads_one_chunk_at_a_time(managers: Callable[..., TierManager]) -> None:
    remote = filled(4)
    manager = managers(None, remote, streams=1)
    assert manager.promote([key(i) for i in range(4)], Sink()).result(timeout=5) == 4
    assert remote.most == 1


def test_a_miss_stops_what_follows_and_reads_under_way_are_not_counted(managers: Callable[..., TierManager]) -> None:
    remote = filled(6)
    del remote.objects[key(1)]
    manager = managers(None, remote, streams=3)
    sink = Sink()
    assert manager.promote([key(i) for i in range(6)], sink).result(timeout=5) == 1
    assert sink.freed == [key(1)]
    # key 3 was reserved once key 0 was done, before key 1's miss was seen; nothing after it
    assert sink.reserved == 4 and set(sink.finished) == {key(i) for i in range(4)}
    assert set(sink.finished.values()) == {1}
    assert {k for k, _ in sink.got} == {key(0), key(2), key(3)}  # committed, only key 0 counted
    assert manager.stats().promoted == 1


def test_a_refusal_keeps_the_reads_before_it(managers: Callable[..., TierManager]) -> None:
    manager = managers(None, filled(6), streams=4)
    sink = Sink(refuse_at=2)
    assert manager.promote([key(i) for i in range(6)], sink).result(timeout=5) == 2
    assert [k for k, _ in sink.got] == [key(0), key(1)] and sink.freed == []


def test_a_tier_that_raises_fails_its_chunk_only(managers: Callable[..., TierManager], caplog: pytest.LogCaptureFixture) -> None:
    remote = filled(5)
    remote.broken = {key(2)}
    manager = managers(None, remote, streams=2)
    sink = Sink()
    assert manager.promote([key(i) for i in range(5)], sink).result(timeout=5) == 2
    assert key(2) in sink.freed and set(sink.finished.values()) == {1}
    assert "promotion read of chunk" in caplog.text


def test_a_target_that_raises_still_lets_every_read_finish(managers: Callable[..., TierManager]) -> None:
    """An exception on the promotion's own path (here: a target's ``done``) ends it, but only after
    every read under way is over and its target finished (no slot is freed while being written)."""
    remote = filled(4)
    manager = managers(None, remote, streams=3)
    sink = Sink()
    real = sink.__call__

    def reserve(k: ChunkKey):  # noqa: ANN202 - the Sink's own type
        target = real(k)
        if k != key(0) or target is None:
            return target
        view, done = target

        def failing(ok: bool) -> None:
            done(ok)
            raise RuntimeError("commit failed")

        return view, failing

    with pytest.raises(RuntimeError, match="commit failed"):
        manager.promote([key(i) for i in range(4)], reserve).result(timeout=5)
    assert remote.inside == 0 and set(sink.finished) == {key(0), key(1), key(2)}
    assert set(sink.finished.values()) == {1} and sink.freed == []  # good reads committed all the same
    assert [k for k, _ in sink.got] == [key(0), key(1), key(2)] and sink.reserved == 3


def test_promoted_chunks_go_to_disk_as_lazy_jobs(disk: DiskTier) -> None:
    remote = MemoryTier()
    for i in range(3):
        remote.put(key(i), payload(i))
    host = {key(0): payload(0), key(1): payload(1)}  # key 2: evicted before the writer got to it
    read_back: list[ChunkKey] = []

    def provider_of(k: ChunkKey) -> Callable[[], bytes | None]:
        def read() -> bytes | None:
            read_back.append(k)
            return host.get(k)

        return read

    manager = TierManager(disk, remote, streams=2)
    manager.copy_from_host(provider_of)
    try:
        assert manager.promote([key(i) for i in range(3)], Sink()).result(timeout=5) == 3
        manager.flush()
        assert sorted(read_back) == [key(0), key(1), key(2)]  # read on the writer thread, from host memory
        assert disk.get(key(0)) == payload(0) and disk.get(key(1)) == payload(1) and not disk.contains(key(2))
        s = manager.stats()
        assert (s.written, s.gone, s.dropped) == (2, 1, 0) and manager._held == 0  # no bytes held in the queue
    finally:
        manager.close()


def test_finished_promotions_measure_the_read_rate(managers: Callable[..., TierManager]) -> None:
    remote = filled(4)
    manager = managers(None, remote, streams=2)
    assert manager.read_rate() is None
    assert manager.promote([key(0)], Sink(present=[key(0)])).result(timeout=5) == 1
    assert manager.read_rate() is None  # nothing was read: no sample
    assert manager.promote([key(i) for i in range(4)], Sink()).result(timeout=5) == 4
    measured = manager.read_rate()
    assert measured is not None and measured > 0
    assert manager.promote([key(9)], Sink()).result(timeout=5) == 0  # a miss moves nothing
    assert manager.read_rate() == measured


@pytest.fixture
def disk(tmp_path: object) -> DiskTier:
    from pathlib import Path

    return DiskTier(Path(str(tmp_path)) / "disk", 10**7, NS)
