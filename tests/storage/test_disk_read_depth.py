"""A long disk read keeps ``READ_DEPTH`` pieces in flight, and none outlives the call.

The pieces land in the caller's buffer from reader threads, so a read that ends early (a damaged
header, a short file) must still wait for every piece it started; the reader threads end with
the tier.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

import pytest

from kvdepot.keys import ChunkKey
from kvdepot.storage import codec, disk, disk_io
from kvdepot.storage.disk import DiskTier

NS = bytes(range(16))
PIECE = 2 * disk.ALIGN
N = 12 * PIECE + 123  # twelve pieces and a partial block


def _payload(i: int, n: int = N) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(n))


def _buffer(n: int = N) -> memoryview:
    return memoryview(mmap.mmap(-1, n + 1))[:n]


class _SlowReads:
    """``disk_io._transfer`` with every read after the first held for a while: counts the reads
    started, finished, and the most in flight at once."""

    def __init__(self, real, delay: float = 0.02) -> None:
        self.real, self.delay, self.lock = real, delay, threading.Lock()
        self.started = self.finished = self.active = self.most = 0

    def __call__(self, call, fd, parts, offset, want):
        with self.lock:
            self.started += 1
            self.active += 1
            self.most = max(self.most, self.active)
        try:
            if call is os.preadv and offset > 0:
                time.sleep(self.delay)
            return self.real(call, fd, parts, offset, want)
        finally:
            with self.lock:
                self.active -= 1
                self.finished += 1


@pytest.fixture
def tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(disk_io, "READ_PIECE", PIECE)
    t = DiskTier(tmp_path / "disk", 10**8, NS, o_direct=False)
    yield t
    t.close()


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch) -> _SlowReads:
    reads = _SlowReads(disk_io._transfer)
    monkeypatch.setattr(disk_io, "_transfer", reads)
    return reads


def test_a_long_read_keeps_read_depth_pieces_in_flight(tier: DiskTier, slow: _SlowReads) -> None:
    assert tier.put(ChunkKey(bytes(16)), _payload(1))
    out = _buffer()
    slow.started = slow.finished = slow.most = 0
    assert tier.get_into(ChunkKey(bytes(16)), out) == N and out == _payload(1)
    assert slow.most == disk_io.READ_DEPTH  # never more, and not one at a time
    assert slow.started == slow.finished == 12 + 1  # the pieces and the partial block's read



def test_a_slow_piece_does_not_hold_back_the_pieces_after_it(tier: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each reader thread takes the next piece as soon as its last one lands, not when this read's
    thread gets to it in order: while the second piece is held, every later one is read, so the
    disk's queue stays ``READ_DEPTH`` deep behind a straggler."""
    key = ChunkKey(bytes(16))
    assert tier.put(key, _payload(6))
    held, lock, done_while_held = threading.Event(), threading.Lock(), []
    real = disk_io._transfer

    def straggler(call, fd, parts, offset, want):
        if call is os.preadv and offset == disk.OFFSET + PIECE:
            held.set()
            time.sleep(0.5)
            with lock:
                done_while_held.append(len(finished))
        n = real(call, fd, parts, offset, want)
        with lock:
            finished.append(offset)
        return n

    finished: list[int] = []
    monkeypatch.setattr(disk_io, "_transfer", straggler)
    out = _buffer()
    assert tier.get_into(key, out) == N and out == _payload(6)
    others = len(disk_io._spans(12 * PIECE, PIECE)) - 1  # (the partial block is read after them all)
    assert held.is_set() and done_while_held == [others]  # every other piece landed under the straggler


@pytest.mark.parametrize("damage", ["header", "zeroed"])
def test_a_read_that_fails_early_waits_for_every_piece_it_started(
    tier: DiskTier, slow: _SlowReads, damage: str
) -> None:
    key = ChunkKey(bytes(16))
    assert tier.put(key, _payload(2))
    (path,) = [p for p in tier.root.rglob("*") if p.is_file() and p.name == key.hex()]
    if damage == "header":
        raw = bytearray(path.read_bytes())
        raw[41] ^= 0x80  # the length field: the header fails when the first piece lands
        path.write_bytes(raw)
    else:
        os.truncate(path, disk.OFFSET + 2 * PIECE)
        os.truncate(path, disk.OFFSET + N)  # same size, zeros from the third piece: the checksum fails at the end
    slow.started = slow.finished = 0
    assert tier.get_into(key, _buffer()) is None
    assert slow.started == slow.finished > 1  # pieces were in flight, and all of them ended
    assert tier.stats().corrupt == 1 and not tier.contains(key)


def test_the_reader_threads_end_with_the_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_io, "READ_PIECE", PIECE)

    def readers() -> int:
        return sum(t.name.startswith("kvdepot-disk-") for t in threading.enumerate())

    before = readers()
    t = DiskTier(tmp_path / "disk", 10**8, NS, o_direct=False)
    assert t.put(ChunkKey(bytes(16)), _payload(3)) and t.get_into(ChunkKey(bytes(16)), _buffer()) == N
    assert readers() > before
    t.close()
    assert readers() == before


def test_an_io_error_in_a_middle_piece_is_a_counted_error_and_waits_for_the_rest(
    tier: DiskTier, slow: _SlowReads, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = ChunkKey(bytes(16))
    assert tier.put(key, _payload(4))
    bad = disk.OFFSET + 3 * PIECE

    def failing(call, fd, parts, offset, want):
        if call is os.preadv and offset == bad:
            raise OSError(5, "Input/output error")
        return slow(call, fd, parts, offset, want)

    monkeypatch.setattr(disk_io, "_transfer", failing)
    slow.started = slow.finished = 0
    assert tier.get_into(key, _buffer()) is None
    assert slow.started == slow.finished > 3  # the pieces around the bad one, all ended
    stats = tier.stats()
    assert stats.errors == 1 and stats.corrupt == 0


def test_closing_the_tier_under_a_long_read_waits_for_it(
    tier: DiskTier, slow: _SlowReads, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read hands its later pieces to the reader threads as the earlier ones land: a close
    that shut them under it made that read raise. Close now waits for the read, which returns the
    chunk whole, and no reader thread outlives it; the tier reads again after (new threads)."""
    key = ChunkKey(bytes(16))
    assert tier.put(key, _payload(5))

    reading = threading.Event()

    def all_slow(call, fd, parts, offset, want):  # the first piece too: close comes before any lands
        if call is os.preadv:
            reading.set()
            time.sleep(0.05)
        return slow(call, fd, parts, offset, want)

    monkeypatch.setattr(disk_io, "_transfer", all_slow)
    results: list[object] = []

    def read() -> None:
        out = _buffer()
        try:
            results.append(out.tobytes() if tier.get_into(key, out) == N else None)
        except BaseException as exc:  # the test's verdict: nothing may escape the read
            results.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    assert reading.wait(10)  # the first pieces are in flight
    tier.close()
    reader.join(10)
    assert results == [_payload(5)]
    assert not [t for t in threading.enumerate() if t.name.startswith("kvdepot-disk-")]
    out = _buffer()
    assert tier.get_into(key, out) == N and out == _payload(5)


def test_a_tier_given_its_own_read_setting_reads_by_it(tmp_path: Path, slow: _SlowReads) -> None:
    """``read_piece`` / ``read_depth`` set one tier's long reads (``bench tiers --read-settings``
    builds one tier per setting), whatever the module's defaults."""
    t = DiskTier(tmp_path / "disk", 10**8, NS, o_direct=False, read_piece=3 * PIECE, read_depth=2)
    try:
        assert t.put(ChunkKey(bytes(16)), _payload(4))
        out = _buffer()
        slow.started = slow.finished = slow.most = 0
        assert t.get_into(ChunkKey(bytes(16)), out) == N and out == _payload(4)
        assert slow.most == 2
        assert slow.started == slow.finished == 4 + 1  # twelve PIECEs in pieces of three, and the partial block
    finally:
        t.close()


@pytest.mark.parametrize(("kwargs", "named"), [({"read_piece": disk.ALIGN + 1}, "read_piece=4097"),
                                               ({"read_piece": 0}, "read_piece=0"), ({"read_depth": 0}, "read_depth=0")])
def test_a_bad_read_setting_is_refused_naming_it(tmp_path: Path, kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        DiskTier(tmp_path / "disk", 10**8, NS, o_direct=False, **kwargs)


def test_a_long_read_hashes_its_pieces_on_the_helpers_and_its_last_piece_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each landed piece's checksum blocks go to the helper threads (several may hash at once), and
    the last piece is read, and so hashed, in ``TAPER`` smaller pieces: what is left to hash after
    the last read is one small piece."""
    monkeypatch.setattr(codec, "HASH_BLOCK", disk.ALIGN)
    piece, n = 4 * disk.ALIGN, 24 * disk.ALIGN
    hashed: list[tuple[str, int]] = []
    real = codec.block_digests
    monkeypatch.setattr(codec, "block_digests", lambda part: hashed.append(
        (threading.current_thread().name, memoryview(part).nbytes)) or real(part))
    t = DiskTier(tmp_path / "disk", 10**8, NS, o_direct=False, read_piece=piece)
    try:
        assert t.put(ChunkKey(bytes(16)), _payload(6, n))
        hashed.clear()
        out = _buffer(n)
        assert t.get_into(ChunkKey(bytes(16)), out) == n and out == _payload(6, n)
    finally:
        t.close()
    assert all(name.startswith("kvdepot-disk-verify") for name, _ in hashed)  # not the writes' threads
    assert [size for _, size in hashed] == [piece] * 5 + [disk.ALIGN] * 4


def test_the_read_spans_cover_the_payload_once_tapering_at_the_end() -> None:
    assert disk_io._spans(32 << 20, 2 << 20) == [(lo, lo + (2 << 20)) for lo in range(0, 30 << 20, 2 << 20)] + [
        (lo, lo + (512 << 10)) for lo in range(30 << 20, 32 << 20, 512 << 10)]
    for cut, piece in [(12 * PIECE + 123, PIECE), (9 * disk.ALIGN, 2 * disk.ALIGN), (5 * disk.ALIGN + 1, 8 * disk.ALIGN)]:
        spans = disk_io._spans(cut, piece)
        assert spans[0][0] == 0 and spans[-1][1] == cut and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert all(lo % disk.ALIGN == 0 and 0 < hi - lo <= piece for lo, hi in spans)


_A = disk.ALIGN


@pytest.mark.parametrize(("n", "where"), [(24 * _A, 0), (24 * _A, 5 * _A + 9), (24 * _A, 21 * _A + 1), (24 * _A, 24 * _A - 1),
                                          (24 * _A + 123, 24 * _A - 1), (24 * _A + 123, 24 * _A + 50)])
def test_a_flipped_byte_in_any_piece_or_block_is_a_corrupt_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int, where: int
) -> None:
    """Hashed block by block on several threads, the checksum still covers every byte: the first
    piece, a middle one, the tapered last piece's pieces (24 blocks read as 5 pieces of 4, then 4
    of 1), the last whole block, the partial block after it."""
    monkeypatch.setattr(codec, "HASH_BLOCK", disk.ALIGN)
    t = DiskTier(tmp_path / "disk", 10**8, NS, o_direct=False, read_piece=4 * disk.ALIGN)
    try:
        key = ChunkKey(bytes(16))
        assert t.put(key, _payload(7, n))
        (path,) = [p for p in t.root.rglob("*") if p.is_file() and p.name == key.hex()]
        raw = bytearray(path.read_bytes())
        raw[disk.OFFSET + where] ^= 0x10
        path.write_bytes(raw)
        assert t.get_into(key, _buffer(n)) is None
        assert t.stats().corrupt == 1 and not t.contains(key)
    finally:
        t.close()
