"""DiskTier: round trips, verification, restart, capacity and the O_DIRECT/buffered paths."""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from pathlib import Path

import pytest

from kvdepot.keys import ChunkKey
from kvdepot.storage import codec, disk, disk_io
from kvdepot.storage.disk import DiskTier

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
SIZES = [0, 1, 4031, 4095, 4096, 4097, 8192, 70_001]  # around the 4 KiB alignment of the payload


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
        monkeypatch.setattr(disk_io, "O_DIRECT", 0)
        monkeypatch.setattr(disk, "probe_o_direct", lambda *_a: True)
    return request.param


@pytest.fixture(params=["inline", "overlap"])
def overlap(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """inline: the test's payloads are checksummed before they are written and after one read.
    overlap: on a helper thread while the payload is written (the header block last), and piece
    by piece while the rest is read (what a chunk over ``OVERLAP`` / ``READ_PIECE`` bytes gets)."""
    if request.param == "overlap":
        monkeypatch.setattr(disk_io, "OVERLAP", 2 * disk.ALIGN)
        monkeypatch.setattr(disk_io, "READ_PIECE", 2 * disk.ALIGN)
    return disk_io.OVERLAP


def make(tmp_path: Path, mode: str, capacity: int = 10**8, ns: bytes = NS) -> DiskTier:
    return DiskTier(tmp_path / "disk", capacity, ns, o_direct=mode != "buffered")


@pytest.mark.usefixtures("overlap")
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
    assert s.used_bytes == sum(disk.OFFSET + n for n in SIZES)
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
    monkeypatch.setattr(disk_io, "O_DIRECT", 0)
    monkeypatch.setattr(disk, "probe_o_direct", lambda *_a: True)
    aligned = make(tmp_path, "emulated")
    assert aligned.put(key(1), payload(1, 5000))
    buffered = make(tmp_path, "buffered")
    assert buffered.get(key(1)) == payload(1, 5000)
    assert buffered.put(key(2), payload(2, 300))
    assert make(tmp_path, "emulated").get(key(2)) == payload(2, 300)


def test_probe_failure_falls_back_to_buffered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "probe_o_direct", lambda *_a: False)
    tier = make(tmp_path, "direct")
    assert tier.o_direct is False
    assert tier.put(key(1), payload(1)) and tier.get(key(1)) == payload(1)


def test_probe_on_this_filesystem_cleans_up(tmp_path: Path) -> None:
    result = disk.probe_o_direct(tmp_path)
    assert isinstance(result, bool) and list(tmp_path.iterdir()) == []


def _flip_payload(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[disk.OFFSET + 10] ^= 0x01
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


def _flip_padding(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[codec.HEADER_BYTES + 100] ^= 0x04  # between the header and the payload: must be zeros
    path.write_bytes(raw)


def _truncate_padding(path: Path) -> None:
    os.truncate(path, disk.OFFSET - 1)


def _foreign(path: Path) -> None:
    path.write_bytes(codec.encode_header(OTHER_NS, key(1), payload(1), aligned=True) + payload(1))


def _other_key(path: Path) -> None:
    path.write_bytes(codec.encode_header(NS, key(2), payload(1), aligned=True) + payload(1))


def _unaligned_layout(path: Path) -> None:  # a valid Redis-layout object: not where the disk keeps it
    path.write_bytes(bytes(codec.encode(NS, key(1), payload(1))).ljust(disk.OFFSET + len(payload(1)), b"\0"))


def _version_1(path: Path) -> None:  # what kvdepot wrote before the aligned layout
    raw = bytearray(codec.encode(NS, key(1), payload(1)))
    struct.pack_into("<H", raw, 4, 1)
    path.write_bytes(raw)


@pytest.mark.parametrize(
    "damage", [_flip_payload, _flip_header, _flip_padding, _truncate, _truncate_header, _truncate_padding,
               _garbage, _foreign, _other_key, _unaligned_layout, _version_1]
)
@pytest.mark.parametrize("into", [False, True], ids=["get", "get_into"])
def test_damaged_object_is_a_miss_removed_and_counted(tmp_path: Path, mode: str, damage, into: bool) -> None:
    tier = make(tmp_path, mode)
    assert tier.put(key(1), payload(1))
    assert tier.put(key(3), payload(3))
    (path,) = [f for f in files(tier) if f.name == key(1).hex()]
    damage(path)
    assert (tier.get_into(key(1), aligned_buffer(2000)) if into else tier.get(key(1))) is None
    assert not path.exists() and not tier.contains(key(1))
    s = tier.stats()
    assert (s.corrupt, s.misses, s.chunks) == (1, 1, 1)
    assert s.used_bytes == disk.OFFSET + len(payload(3))
    assert tier.get(key(3)) == payload(3)  # neighbours untouched
    assert tier.put(key(1), payload(1)) and tier.get(key(1)) == payload(1)  # and it can come back


def _flip_last_piece(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x10
    path.write_bytes(raw)


def _flip_middle_piece(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[disk.OFFSET + 5 * disk_io.READ_PIECE + 7] ^= 0x01
    path.write_bytes(raw)


def _cut_a_piece(path: Path) -> None:
    os.truncate(path, disk.OFFSET + 3 * disk_io.READ_PIECE)


@pytest.mark.parametrize("damage", [_flip_last_piece, _flip_middle_piece, _cut_a_piece, _flip_payload, _flip_header])
@pytest.mark.parametrize("into", [False, True], ids=["get", "get_into"])
def test_damage_in_any_piece_of_a_long_read_is_a_miss(
    tmp_path: Path, mode: str, damage, into: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A payload read in pieces (checksummed while the next piece is read) is verified whole."""
    monkeypatch.setattr(disk_io, "READ_PIECE", 2 * disk.ALIGN)
    n = 20 * disk.ALIGN + 123  # ten pieces and a partial block
    tier = make(tmp_path, mode)
    assert tier.put(key(1), payload(1, n)) and tier.put(key(3), payload(3, n))
    out = aligned_buffer(n)
    assert tier.get_into(key(3), out) == n and out == payload(3, n)
    (path,) = [f for f in files(tier) if f.name == key(1).hex()]
    damage(path)
    assert (tier.get_into(key(1), aligned_buffer(n)) if into else tier.get(key(1))) is None
    assert not path.exists() and not tier.contains(key(1))
    assert tier.stats().corrupt == 1
    assert tier.get(key(3)) == payload(3, n)


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
    used = tier.stats().used_bytes
    tier.close()  # the process ends: a legacy temp (no claim id) is litter once nobody else is here
    again = make(tmp_path, mode)
    assert not stray.exists()
    assert again.contains_many([key(i) for i in range(6)]) == [True] * 5 + [False]
    assert again.stats().used_bytes == used == again.stats().shared_used_bytes
    assert all(again.get(key(i)) == payload(i) for i in range(5))


def test_restart_keeps_lru_order_and_capacity(tmp_path: Path) -> None:
    size = disk.OFFSET + 1000
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
    size = disk.OFFSET + 1000
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


@pytest.mark.usefixtures("overlap")
def test_concurrent_puts_and_gets_stay_within_capacity(tmp_path: Path) -> None:
    tier = make(tmp_path, "buffered", capacity=8 * (disk.OFFSET + 20_000))
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for i in range(40):
                k = (offset + i) % 24
                tier.put(key(k), payload(k, 20_000))
                got = tier.get(key((k + 3) % 24))
                assert got is None or got == payload((k + 3) % 24, 20_000)
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


@pytest.mark.usefixtures("overlap")
def test_short_reads_and_writes_are_resumed(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Linux moves at most ~2 GiB per syscall: emulate that limit at a few KiB (whole blocks when
    the file is opened with O_DIRECT, as the kernel's limit is)."""
    real_preadv, real_pwritev = os.preadv, os.pwritev
    step = 5000 if mode == "buffered" else 2 * disk.ALIGN

    def first(parts: list[memoryview], limit: int) -> list[memoryview]:
        out = []
        for part in map(memoryview, parts):
            if limit <= 0:
                break
            out.append(part[:limit])
            limit -= out[-1].nbytes
        return out

    monkeypatch.setattr(disk.os, "preadv", lambda fd, parts, at: real_preadv(fd, first(parts, step), at))
    monkeypatch.setattr(disk.os, "pwritev", lambda fd, parts, at: real_pwritev(fd, first(parts, step), at))
    tier = make(tmp_path, mode)
    for i, n in enumerate([0, 4032, 30_000]):
        assert tier.put(key(i), payload(i, n))
        assert tier.get(key(i)) == payload(i, n)
        out = aligned_buffer(n)
        assert tier.get_into(key(i), out) == n and out[:n] == payload(i, n)


def aligned_buffer(n: int, skew: int = 0) -> memoryview:
    """``n`` writable bytes at ``skew`` bytes past a page boundary (a host-arena slot when 0)."""
    return memoryview(mmap.mmap(-1, n + skew + 1))[skew : skew + n]


@pytest.mark.parametrize("skew", [0, 8], ids=["aligned", "unaligned"])
@pytest.mark.usefixtures("overlap")
def test_get_into_a_caller_buffer(tmp_path: Path, mode: str, skew: int) -> None:
    tier = make(tmp_path, mode)
    for i, n in enumerate(SIZES):
        assert tier.put(key(i), payload(i, n))
    for i, n in enumerate(SIZES):
        out = aligned_buffer(n + 100, skew)
        out[n:] = b"\xee" * 100
        assert tier.get_into(key(i), out) == n
        assert out[:n] == payload(i, n) and out[n:] == b"\xee" * 100  # nothing written past the payload
    assert tier.get_into(key(99), aligned_buffer(10)) is None
    big = bytearray(70_001)  # any writable bytes-like object
    assert tier.get_into(key(len(SIZES) - 1), big) == 70_001 and big == payload(len(SIZES) - 1, 70_001)
    s = tier.stats()
    assert (s.hits, s.misses, s.corrupt) == (len(SIZES) + 1, 1, 0)


def test_get_into_a_buffer_too_small_raises_and_keeps_the_object(tmp_path: Path, mode: str) -> None:
    tier = make(tmp_path, mode)
    assert tier.put(key(1), payload(1, 5000))
    with pytest.raises(ValueError, match="5000 bytes"):
        tier.get_into(key(1), aligned_buffer(4999))
    assert tier.contains(key(1)) and tier.stats().corrupt == 0
    assert tier.get(key(1)) == payload(1, 5000)


def test_get_returns_a_read_only_view_of_new_memory(tmp_path: Path, mode: str) -> None:
    tier = make(tmp_path, mode)
    assert tier.put(key(1), payload(1, 5000))
    first, second = tier.get(key(1)), tier.get(key(1))
    assert isinstance(first, memoryview) and first.readonly and first == payload(1, 5000)
    assert first == second and first.obj is not second.obj


@pytest.mark.usefixtures("overlap")
def test_file_layout(tmp_path: Path, mode: str) -> None:
    """Header, zeros to 4 KiB, the payload at 4096: the same bytes whatever the I/O mode."""
    tier = make(tmp_path, mode)
    data = payload(1, 5000)
    assert tier.put(key(1), data)
    (path,) = files(tier)
    raw = path.read_bytes()
    assert len(raw) == disk.OFFSET + len(data) == 4096 + 5000
    assert raw[: disk.OFFSET] == codec.encode_header(NS, key(1), data, aligned=True)
    assert raw[4:6] == codec.FORMAT_VERSION.to_bytes(2, "little") and raw[6:8] == codec.FLAG_ALIGNED.to_bytes(2, "little")
    assert raw[codec.HEADER_BYTES : disk.OFFSET] == bytes(disk.OFFSET - codec.HEADER_BYTES)
    assert raw[disk.OFFSET :] == data
    assert codec.decode(raw, NS, key(1)) == data  # self-describing: the codec alone reads it


def test_aligned_sources_and_destinations_take_no_bounce_copy(tmp_path: Path, mode: str) -> None:
    """A page-aligned payload (a host-arena slot) is written from and read into in place; only an
    unaligned one goes through the thread's aligned bounce buffer, and only under O_DIRECT."""
    tier = make(tmp_path, mode)
    src = aligned_buffer(3 * disk.ALIGN + 100)
    src[:] = payload(1, src.nbytes)
    assert tier.put(key(1), src)
    out = aligned_buffer(src.nbytes)
    assert tier.get_into(key(1), out) == src.nbytes and out == src
    assert not hasattr(tier._io._local, "bounce")
    assert tier.put(key(2), aligned_buffer(5000, skew=8))
    assert tier.get_into(key(2), aligned_buffer(5000, skew=8)) == 5000
    assert hasattr(tier._io._local, "bounce") is tier.o_direct
    tier.close()
    assert not hasattr(tier._io._local, "bounce") and not hasattr(tier._io._local, "blocks")


def test_close_stops_the_helpers_and_the_tier_still_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_io, "OVERLAP", 2 * disk.ALIGN)
    tier = make(tmp_path, "buffered")
    assert tier.put(key(1), payload(1, 50_000))
    helpers = tier._io._pools["write"]
    tier.close()
    assert tier._io._pools == {} and helpers._shutdown
    assert tier.put(key(2), payload(2, 50_000)) and tier.get(key(2)) == payload(2, 50_000)
    tier.close()


@pytest.mark.usefixtures("overlap")
def test_a_failed_write_waits_for_its_checksum_and_leaves_nothing(tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = make(tmp_path, mode)
    real_pwritev, real_header, done = os.pwritev, codec.encode_header, []

    def full(fd: int, parts: list[memoryview], at: int) -> int:
        raise OSError(28, "No space left on device")

    def slow_header(*args: object, **kwargs: object) -> bytes:
        time.sleep(0.05)
        done.append(real_header(*args, **kwargs))
        return done[-1]

    monkeypatch.setattr(disk.os, "pwritev", full)
    monkeypatch.setattr(codec, "encode_header", slow_header)
    assert not tier.put(key(1), aligned_buffer(50_000))
    assert len(done) == 1  # put returned only once nothing read the caller's buffer any more
    monkeypatch.setattr(disk.os, "pwritev", real_pwritev)
    s = tier.stats()
    assert (s.dropped, s.chunks, s.used_bytes) == (1, 0, 0) and files(tier) == []
    assert tier.put(key(1), payload(1, 50_000)) and tier.get(key(1)) == payload(1, 50_000)
