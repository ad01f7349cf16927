"""Disk objects held open from the lookup to the read: a promised chunk evicted (its file removed
or replaced) before the read is still read, verified; and no descriptor outlives its promotion."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_tier_manager import NS, MemoryTier, Sink, key, payload

from kvdepot.storage.disk import DiskTier
from kvdepot.storage.manager import TierManager


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def disk(tmp_path: Path) -> DiskTier:
    tier = DiskTier(tmp_path / "disk", 10**7, NS)
    yield tier
    tier.close()


def test_a_held_object_is_read_after_its_file_is_removed(disk: DiskTier) -> None:
    disk.put(key(1), payload(1))
    (fd,) = disk.hold([key(1)])
    assert fd is not None
    assert disk.delete(key(1)) and not Path(disk._path(key(1))).exists()  # evicted
    out = bytearray(512)
    assert disk.get_into(key(1), out, held=fd) == 512 and bytes(out) == payload(1)
    with pytest.raises(OSError):
        os.fstat(fd)  # the read closed it
    assert disk.get_into(key(1), bytearray(512)) is None  # without a hold: a miss, as before


def test_a_held_corrupt_object_does_not_remove_its_replacement(disk: DiskTier) -> None:
    disk.put(key(2), payload(2))
    path = Path(disk._path(key(2)))
    (fd,) = disk.hold([key(2)])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))  # the held object itself is now corrupt (same inode)
    assert disk.get_into(key(2), bytearray(512), held=fd) is None
    assert not path.exists() and disk.stats().corrupt == 1  # same file: deleted, as without a hold


@pytest.mark.parametrize("case", ["all-read", "refused", "missing-middle", "closing"])
def test_promotion_closes_every_descriptor(disk: DiskTier, case: str) -> None:
    remote = MemoryTier()
    manager = TierManager(disk, remote, promote_to_disk=False)
    for i in range(4):
        disk.put(key(i), payload(i))
    keys = [key(i) for i in range(4)]
    if case == "closing":
        manager.close()
        before = open_fds()
        assert manager.promote(keys, Sink()).result(timeout=5) == 0
    else:
        before = open_fds()
        if case == "missing-middle":
            os.unlink(disk._path(key(1)))  # before the hold: neither copy exists
        sink = Sink(refuse_at=2 if case == "refused" else None)
        count = manager.promote(keys, sink).result(timeout=5)
        assert count == {"all-read": 4, "refused": 2, "missing-middle": 1}[case]
        assert [bytes(b) for _k, b in sink.got][:count] == [payload(i) for i in range(count)]
        assert set(sink.finished.values()) <= {1}  # chunks read after the miss: committed, not counted
    assert open_fds() == before  # the promotion's finally ran before its result was set
    manager.close()


def test_promotion_reads_a_chunk_evicted_after_the_promise(disk: DiskTier) -> None:
    """The hold is taken in ``promote`` itself: a removal after it cannot shorten the read."""
    import threading

    manager = TierManager(disk, None, promote_to_disk=False)
    for i in range(3):
        disk.put(key(i), payload(i))
    gate = threading.Event()
    real = TierManager._promote

    def late(self: TierManager, *args: object) -> int:
        gate.wait(5)
        return real(self, *args)

    manager._promote = late.__get__(manager)  # type: ignore[method-assign]
    future = manager.promote([key(i) for i in range(3)], sink := Sink())
    for i in range(3):
        assert disk.delete(key(i))  # all evicted before the read starts
    gate.set()
    assert future.result(timeout=5) == 3 and [bytes(b) for _k, b in sink.got] == [payload(i) for i in range(3)]
    manager.close()
