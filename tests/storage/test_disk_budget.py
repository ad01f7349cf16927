"""The disk tier's shared budget and full filesystems: one capacity for every process and
namespace under a ``disk_path``, another writer's temp files left alone, ENOSPC evicts and retries."""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from kvdepot.keys import ChunkKey
from kvdepot.storage import disk_budget
from kvdepot.storage.disk import OFFSET, DiskTier

NS, OTHER_NS = bytes(range(16)), bytes(range(1, 17))


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def payload(i: int, n: int = 20_000) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(n))


def object_bytes(base: Path) -> int:
    """Bytes of the chunk files under ``base`` (every namespace), as the filesystem has them."""
    return sum(p.stat().st_size for p in base.glob("*/*/*") if p.is_file() and not p.name.startswith("."))


def test_two_tiers_on_one_path_share_one_capacity(tmp_path: Path) -> None:
    size = OFFSET + 20_000
    a = DiskTier(tmp_path, 6 * size, NS, o_direct=False)
    b = DiskTier(tmp_path, 6 * size, OTHER_NS, o_direct=False)  # e.g. a second model group
    for i in range(20):
        assert a.put(key(i), payload(i)) and b.put(key(i), payload(100 + i))
        assert object_bytes(tmp_path) <= 6 * size
    assert a.stats().shared_used_bytes == b.stats().shared_used_bytes == object_bytes(tmp_path) == 6 * size
    assert a.get(key(19)) == payload(19) and b.get(key(19)) == payload(119)
    a.close()
    b.close()


def _writer(path: Path, capacity: int, first: int, die: bool, out: Connection) -> None:
    """A second process (forked: no interpreter start-up) writing 40 chunks into ``path``."""
    tier = DiskTier(path, capacity, NS, o_direct=False)
    out.send(sum(tier.put(key(i), payload(i)) for i in range(first, first + 40)))
    if die:  # hold a reservation and die without closing
        with tier._budget.locked() as budget:
            budget.reserve(12345)
        os.kill(os.getpid(), signal.SIGKILL)
    tier.close()


def _run_writers(path: Path, capacity: int, firsts: list[int], die: bool = False) -> tuple[list[int], list[int]]:
    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in firsts]
    procs = [ctx.Process(target=_writer, args=(path, capacity, first, die, w)) for first, (_r, w) in zip(firsts, pipes, strict=True)]
    for proc in procs:
        proc.start()
    counts = [r.recv() for r, _w in pipes]
    for proc in procs:
        proc.join(60)
    return counts, [proc.exitcode for proc in procs]


def test_processes_sharing_a_path_stay_within_one_capacity(tmp_path: Path) -> None:
    """Two processes write 40 chunks each into a path of 10 chunks' capacity, at the same time."""
    capacity = 10 * (OFFSET + 20_000)
    counts, codes = _run_writers(tmp_path, capacity, [0, 1000])
    assert codes == [0, 0]
    assert counts == [40, 40]  # every put found room (by evicting)
    held = object_bytes(tmp_path)
    assert 0 < held <= capacity
    tier = DiskTier(tmp_path, capacity, NS, o_direct=False)  # alone now: the books match the files
    assert tier.stats().shared_used_bytes == held
    tier.close()


def test_a_dead_process_reservation_is_returned(tmp_path: Path) -> None:
    capacity = 10 * (OFFSET + 20_000)
    _counts, codes = _run_writers(tmp_path, capacity, [0], die=True)
    assert codes == [-signal.SIGKILL]
    assert len(os.listdir(tmp_path / disk_budget.CLAIMS)) == 1  # its claim outlived it
    tier = DiskTier(tmp_path, capacity, NS, o_direct=False)
    assert os.listdir(tmp_path / disk_budget.CLAIMS) == [tier._budget.claim_id]
    assert tier.stats().shared_used_bytes == object_bytes(tmp_path)  # 12345 reserved bytes returned
    tier.close()
    assert os.listdir(tmp_path / disk_budget.CLAIMS) == []


def test_start_up_leaves_a_live_writers_temp_files(tmp_path: Path) -> None:
    writer = DiskTier(tmp_path, 10**8, NS, o_direct=False)
    assert writer.put(key(1), payload(1))
    shard = Path(writer._path(key(1))).parent
    in_flight = shard / f".{key(2).hex()}.{writer._budget.claim_id}.tmp"  # a write in progress
    in_flight.write_bytes(b"half")
    orphan = shard / f".{key(3).hex()}.{uuid.uuid4().hex}.tmp"  # its writer (and claim) is gone
    orphan.write_bytes(b"half")
    legacy = shard / ".deadbeef.1234.tmp"  # no claim id: whose it is cannot be told
    legacy.write_bytes(b"half")
    other = DiskTier(tmp_path, 10**8, NS, o_direct=False)  # a second process starting
    assert in_flight.exists() and legacy.exists() and not orphan.exists()
    assert other.get(key(1)) is None or other.get(key(1)) == payload(1)
    other.close()
    writer.close()
    DiskTier(tmp_path, 10**8, NS, o_direct=False).close()  # alone: the legacy temp is litter now
    assert not legacy.exists()


def test_the_ledger_does_not_follow_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    base = tmp_path / "disk"
    base.mkdir()
    (base / disk_budget.LEDGER).symlink_to(victim)
    with pytest.raises(OSError):
        DiskTier(base, 10**8, NS, o_direct=False)
    assert victim.read_bytes() == b"precious"


def test_same_chunk_from_two_writers_is_published_once(tmp_path: Path) -> None:
    a = DiskTier(tmp_path, 10**8, NS, o_direct=False)
    b = DiskTier(tmp_path, 10**8, NS, o_direct=False)
    assert a.put(key(1), payload(1)) and b.put(key(1), payload(1))  # b did not know a had it
    assert b.contains(key(1)) and b.get(key(1)) == payload(1)
    assert a.stats().shared_used_bytes == object_bytes(tmp_path) == OFFSET + 20_000
    a.close()
    b.close()


# ---- full filesystems ---------------------------------------------------------------------------
def _fill(tier: DiskTier, n: int, size: int) -> list[bool]:
    return [tier.put(key(i), payload(i, size)) for i in range(n)]


def _check_full_fs(tier: DiskTier, size: int) -> None:
    """A tier whose capacity (1 GB) is far above what the filesystem holds keeps storing."""
    results = _fill(tier, 60, size)
    s = tier.stats()
    assert s.no_space > 0, "the filesystem never filled: the test proves nothing"
    assert all(results), f"puts failed after the filesystem filled: {results}"
    assert s.evictions > 0 and s.dropped == 0
    assert all(tier.get(key(i)) == payload(i, size) for i in range(55, 60))  # the newest, bit-exact
    assert tier.stats().shared_used_bytes == object_bytes(tier.base)


def test_enospc_evicts_and_retries_injected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem of 1 MiB, emulated: a write that would take the files past it fails ENOSPC."""
    tier = DiskTier(tmp_path, 10**9, NS, o_direct=False)
    real_pwritev, limit = os.pwritev, 1 << 20

    def small_fs(fd: int, parts: list[memoryview], at: int) -> int:
        in_use = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
        if in_use + sum(memoryview(part).nbytes for part in parts) > limit:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, parts, at)

    monkeypatch.setattr(os, "pwritev", small_fs)
    _check_full_fs(tier, 100_000)
    tier.close()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs (needs the right to mount: root, as in CI's container)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here; test_enospc_evicts_and_retries_injected covers it")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_enospc_on_a_real_small_filesystem(small_tmpfs: Path) -> None:
    tier = DiskTier(small_tmpfs / "disk", 10**9, NS)
    _check_full_fs(tier, 100_000)
    tier.close()


def _use_inherited(tier: DiskTier, parent_claim: str, out: Connection) -> None:
    ok = tier.put(key(7), payload(7))
    out.send((ok, tier._budget.claim_id != parent_claim, tier.get(key(7)) == payload(7)))
    tier.close()


def test_a_forked_child_takes_its_own_claim(tmp_path: Path) -> None:
    """flock locks belong to open file descriptions, which a fork shares: a child using its
    parent's tier must not write under the parent's lock and claim."""
    tier = DiskTier(tmp_path, 10**8, NS, o_direct=False)
    assert tier.put(key(1), payload(1))
    ctx = multiprocessing.get_context("fork")
    r, w = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_use_inherited, args=(tier, tier._budget.claim_id, w))
    child.start()
    assert r.recv() == (True, True, True)
    child.join(30)
    assert child.exitcode == 0
    assert os.listdir(tmp_path / disk_budget.CLAIMS) == [tier._budget.claim_id]  # the child's is gone
    assert tier.put(key(2), payload(2)) and tier.stats().shared_used_bytes == object_bytes(tmp_path)
    tier.close()
