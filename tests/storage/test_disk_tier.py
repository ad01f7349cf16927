"""DiskTier: round trips, verification, restart, capacity and the O_DIRECT/buffered paths."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvdepot.keys import ChunkKey
from kvdepot.storage import codec, disk
from kvdepot.storage.disk import DiskTier

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
SIZES = [0, 1, 4031, 4032, 4033, 4096, 70_001]  # around the 4 KiB alignment incl. the header


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def payload(i: int, n: int = 1000) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(n))


def files(tier: DiskTier) -> list[Path]:
    return sorted(p for p in tier.root.rglob("*") if p.is_file())


@pytest.fixture(params=["buffered", "direct", "emulated"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """buffered: O_DIRECT off. direct: real O_DIRECT where tmp_path's filesystem takes it (else
    the tier must have fallen back). emulated: the aligned-buffer path with the flag itself
    stripped, so it runs on any filesystem (tmpfs too)."""
    if request.param == "emulated":
        monkeypatch.setattr(disk, "O_DIRECT", 0)
        monkeypatch.setattr(disk, "probe_o_direct", lambda _d: True)
    return request.param


def make(tmp_path: Path, mode: str, capacity: int = 10**8, ns: bytes = NS) -> DiskTier:
    return DiskTier(tmp_path / "disk", capacity, ns, o_direct=mode != "buffered")


def test_round_trip(tmp_path: Path, mode: str) -> None:
    tier = make(tmp_path, mode)
    expected = {"buffered": False, "direct": disk.probe_o_direct(tmp_path), "emulated": True}[mode]
    assert tier.o_direct is expected
    for i, n in enumerate(SIZES):
        assert tier.put(key(i), payload(i, n))
    for i, n in enumerate(SIZES):
        assert tier.contains(key(i))
        assert tier.get(key(i)) == payload(i, n)
    assert tier.get(key(99)) is None and not tier.contains(key(99))
    assert tier.contains_many([key(0), key(99), key(1)]) == [True, False, True]
    s = tier.stats()
    assert (s.chunks, s.puts, s.hits, s.misses, s.corrupt) == (len(SIZES), len(SIZES), len(SIZES), 1, 0)
    assert s.used_bytes == sum(codec.HEADER_BYTES + n for n in SIZES)
    assert sum(f.stat().st_size for f in files(tier)) == s.used_bytes  # padding truncated away
    assert tier.delete(key(0)) and not tier.delete(key(0)) and not tier.contains(key(0))
    assert len(files(tier)) == len(SIZES) - 1


def test_put_accepts_views_and_keeps_existing(tmp_path: Path, mode: str) -> None:
    tier = make(tmp_path, mode)
    data = bytearray(payload(1, 5000))
    assert tier.put(key(1), memoryview(data)[:4000])
    assert tier.put(key(1), b"different bytes, same key: kept as is")
    assert tier.get(key(1)) == bytes(data[:4000])
    assert tier.stats().puts == 1


def test_objects_readable_across_io_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "O_DIRECT", 0)
    monkeypatch.setattr(disk, "probe_o_direct", lambda _d: True)
    aligned = make(tmp_path, "emulated")
    assert aligned.put(key(1), payload(1, 5000))
    buffered = make(tmp_path, "buffered")
    assert buffered.get(key(1)) == payload(1, 5000)
    assert buffered.put(key(2), payload(2, 300))
    assert make(tmp_path, "emulated").get(key(2)) == payload(2, 300)


def test_probe_failure_falls_back_to_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "probe_o_direct", lambda _d: False)
    tier = make(tmp_path, "direct")
    assert tier.o_direct is False
    assert tier.put(key(1), payload(1)) and tier.get(key(1)) == payload(1)


def test_probe_on_this_filesystem_cleans_up(tmp_path: Path) -> None:
    result = disk.probe_o_direct(tmp_path)
    assert isinstance(result, bool) and list(tmp_path.iterdir()) == []


def _flip_payload(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[codec.HEADER_BYTES + 10] ^= 0x01
    path.write_bytes(raw)


def _flip_header(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[41] ^= 0x80  # the length field
    path.write_bytes(raw)


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


def _truncate_header(path: Path) -> None:
    os.truncate(path, 10)


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def _foreign(path: Path) -> None:
    path.write_bytes(codec.encode(OTHER_NS, key(1), payload(1)))


def _other_key(path: Path) -> None:
    path.write_bytes(codec.encode(NS, key(2), payload(1)))


@pytest.mark.parametrize(
    "damage", [_flip_payload, _flip_header, _truncate, _truncate_header, _garbage, _foreign, _other_key]
)
def test_damaged_object_is_a_miss_removed_and_counted(tmp_path: Path, mode: str, damage) -> None:
    tier = make(tmp_path, mode)
    assert tier.put(key(1), payload(1))
    assert tier.put(key(3), payload(3))
    (path,) = [f for f in files(tier) if f.name == key(1).hex()]
    damage(path)
    assert tier.get(key(1)) is None
    assert not path.exists() and not tier.contains(key(1))
    s = tier.stats()
    assert (s.corrupt, s.misses, s.chunks) == (1, 1, 1)
    assert s.used_bytes == codec.HEADER_BYTES + len(payload(3))
    assert tier.get(key(3)) == payload(3)  # neighbours untouched
    assert tier.put(key(1), payload(1)) and tier.get(key(1)) == payload(1)  # and it can come back


def test_vanished_file_is_a_plain_miss(tmp_path: Path) -> None:
    tier = make(tmp_path, "buffered")
    tier.put(key(1), payload(1))
    files(tier)[0].unlink()
    assert tier.get(key(1)) is None and not tier.contains(key(1))
    assert tier.stats().corrupt == 0 and tier.stats().used_bytes == 0


def test_restart_rebuilds_the_index(tmp_path: Path, mode: str) -> None:
    tier = make(tmp_path, mode)
    for i in range(5):
        assert tier.put(key(i), payload(i))
    stray = files(tier)[0].parent / ".deadbeef.1234.tmp"
    stray.write_bytes(b"half-written")
    (files(tier)[0].parent / "not-a-key").write_bytes(b"left alone")
    again = make(tmp_path, mode)
    assert not stray.exists()
    assert again.contains_many([key(i) for i in range(6)]) == [True] * 5 + [False]
    assert again.stats().used_bytes == tier.stats().used_bytes
    assert all(again.get(key(i)) == payload(i) for i in range(5))


def test_restart_keeps_lru_order_and_capacity(tmp_path: Path) -> None:
    size = codec.HEADER_BYTES + 1000
    tier = make(tmp_path, "buffered", capacity=5 * size)
    for i in range(5):
        tier.put(key(i), payload(i))
    for age, i in enumerate([3, 0, 4, 1, 2]):  # oldest mtime first
        os.utime(tier._path(key(i)), ns=(10**18 + age * 10**9,) * 2)
    smaller = make(tmp_path, "buffered", capacity=3 * size)  # shrunk: evicts at start
    assert smaller.contains_many([key(i) for i in range(5)]) == [False, True, True, False, True]
    assert smaller.stats().evictions == 2
    assert len(files(smaller)) == 3


def test_full_disk_evicts_lru_within_capacity(tmp_path: Path, mode: str) -> None:
    size = codec.HEADER_BYTES + 1000
    tier = make(tmp_path, mode, capacity=3 * size + 10)
    for i in range(3):
        assert tier.put(key(i), payload(i))
    assert tier.get(key(0)) is not None  # 0 is now the most recently used
    for i in range(3, 10):
        assert tier.put(key(i), payload(i))
        assert tier.stats().used_bytes <= tier.capacity_bytes
    assert tier.contains_many([key(i) for i in range(10)]) == [False] * 7 + [True] * 3
    s = tier.stats()
    assert (s.chunks, s.evictions, s.dropped) == (3, 7, 0)
    assert len(files(tier)) == 3
    assert not tier.put(key(20), payload(20, 4 * size))  # larger than the whole tier
    assert tier.stats().dropped == 1 and tier.contains(key(9))


def test_namespaces_share_a_directory_without_mixing(tmp_path: Path) -> None:
    a, b = make(tmp_path, "buffered"), make(tmp_path, "buffered", ns=OTHER_NS)
    a.put(key(1), payload(1))
    b.put(key(1), payload(2))
    assert a.get(key(1)) == payload(1) and b.get(key(1)) == payload(2)
    assert not b.contains(key(2)) and a.root != b.root


def test_write_failure_is_a_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make(tmp_path, "buffered")

    def broken(_src: object, _dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk.os, "replace", broken)
    assert not tier.put(key(1), payload(1))
    monkeypatch.undo()
    s = tier.stats()
    assert (s.dropped, s.chunks, s.used_bytes) == (1, 0, 0) and files(tier) == []
    assert tier.put(key(1), payload(1)) and tier.get(key(1)) == payload(1)


def test_bad_namespace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="16-byte"):
        DiskTier(tmp_path, 100, b"short")


def test_concurrent_puts_and_gets_stay_within_capacity(tmp_path: Path) -> None:
    tier = make(tmp_path, "buffered", capacity=8 * (codec.HEADER_BYTES + 2000))
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for i in range(40):
                k = (offset + i) % 24
                tier.put(key(k), payload(k, 2000))
                got = tier.get(key((k + 3) % 24))
                assert got is None or got == payload((k + 3) % 24, 2000)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n * 5,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = tier.stats()
    assert s.used_bytes <= tier.capacity_bytes and s.corrupt == 0
    assert len(files(tier)) == s.chunks


def test_short_reads_and_writes_are_resumed(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Linux moves at most ~2 GiB per syscall: emulate that limit at a few KiB."""
    real_writev, real_pread = os.writev, os.pread
    monkeypatch.setattr(disk, "_MAX_IO", 2 * disk.ALIGN)

    def short_writev(fd: int, parts: list[memoryview]) -> int:
        first = memoryview(parts[0])
        return real_writev(fd, [first[: min(first.nbytes, 5000 if mode == "buffered" else 8192)]])

    def short_pread(fd: int, n: int, offset: int) -> bytes:
        return real_pread(fd, min(n, 3000), offset)

    monkeypatch.setattr(disk.os, "writev", short_writev)
    monkeypatch.setattr(disk.os, "pread", short_pread)
    tier = make(tmp_path, mode)
    for i, n in enumerate([0, 4032, 30_000]):
        assert tier.put(key(i), payload(i, n))
        assert tier.get(key(i)) == payload(i, n)
