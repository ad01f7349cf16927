"""One disk budget for every process (and every namespace) sharing a ``disk_path``.

Why the directory itself keeps the books: engines of one node (TP ranks, model groups in one
server, restarted processes) share a ``disk_path`` but nothing else — no server, no shared memory.
Each used to count only its own objects, so two of them held twice the capacity, and a starting
process removed every temp file it found, including another's write in flight. Now:

* ``<disk_path>/.kvdepot-ledger`` holds two little-endian int64s: bytes of committed objects
  under the whole ``disk_path``, and bytes reserved by writes in flight. Every change to it — a
  reservation, a commit (the ``os.replace`` that publishes an object), a removal — happens under
  an exclusive ``flock`` of that file, so the sum never passes the capacity the writer checked.
  The lock is held for bookkeeping, renames and unlinks only, never across a data write.
* ``<disk_path>/.kvdepot-claims/<claim id>``: one file per live tier, ``flock``ed for its whole
  life and holding the bytes it has reserved. The kernel drops a dead process's lock, so a claim
  whose lock can be taken belongs to nobody: its reservation is returned to the ledger and the
  file removed (``sweep``). Temp files carry their writer's claim id in their name; a temp is
  litter only when its claim is gone, so no process deletes another's write in flight.
* A process that finds no other live claim at start recounts the committed bytes from the files
  (``recount``), so a crash inside a critical section (a skew of at most one object) or files
  left from before the ledger existed cannot leave the books wrong for longer than one start.

Why not per-process sub-budgets: a fixed split strands space (an idle rank's share cannot be used)
and re-splitting when processes come and go needs the same shared lock. Why a lock and not
lock-free counters: updates are a few per chunk write (hundreds of KB to hundreds of MB each), so
a syscall-level lock costs nothing measurable, and eviction must decide victims and count them
atomically anyway. Lock and claim files are opened with ``O_NOFOLLOW`` and mode 0600, so a
symlink planted in a shared directory cannot redirect them.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

LEDGER = ".kvdepot-ledger"
CLAIMS = ".kvdepot-claims"
_COUNTS = struct.Struct("<qq")  # committed, reserved
_OWN = struct.Struct("<q")  # a claim's reserved bytes


def _open_private(path: Path, create_new: bool = False) -> int:
    """Open ``path`` read-write without following a symlink; refuse a file that is not ours."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_EXCL if create_new else 0)
    fd = os.open(path, flags, 0o600)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise PermissionError(f"{path} is not a regular file owned by this user")
    return fd


class SharedBudget:
    """The ledger of one ``disk_path`` and this tier's claim in it (see the module docstring).

    Call ``reserve``/``release``/``commit``/``uncount``/``counts`` only inside ``locked()``.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.directory / CLAIMS).mkdir(exist_ok=True, mode=0o700)
        self._mutex = threading.RLock()  # flock does not exclude the threads of one open file
        self._fd: int | None = None
        self._claim_fd: int | None = None
        self._pid = os.getpid()
        self.claim_id = ""
        self._own = 0
        self.others_at_start = self._open()

    def _open(self) -> int:
        """Open the ledger, take a fresh claim (under the lock: a sweeper never sees it unlocked),
        sweep dead claims; the number of other live claims."""
        with self._mutex:
            self._fd = _open_private(self.directory / LEDGER)
            with self.locked():
                self.claim_id = uuid.uuid4().hex
                self._claim_fd = _open_private(self._claim_path(self.claim_id), create_new=True)
                fcntl.flock(self._claim_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._own = 0
                self._write_own()
                return self.sweep()

    def _forget_inherited(self) -> None:
        """In a forked child: drop the parent's descriptors (closing them releases nothing the
        parent holds) and its claim; ``locked()`` then takes a claim of the child's own."""
        for fd in (self._fd, self._claim_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._claim_fd = None
        self._own, self._pid = 0, os.getpid()

    def _claim_path(self, claim_id: str) -> Path:
        return self.directory / CLAIMS / claim_id

    @contextmanager
    def locked(self) -> Iterator[SharedBudget]:
        """Exclusive use of the ledger, against this process's threads and every other process."""
        with self._mutex:
            if self._pid != os.getpid():  # a forked child: the parent's descriptions share its locks
                self._forget_inherited()
            if self._fd is None:  # reopened after close(): the tier is still in use
                self._open()
            assert self._fd is not None
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield self
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    # ---- the books (inside locked()) -----------------------------------------------------------
    def counts(self) -> tuple[int, int]:
        """(committed, reserved) bytes under the whole directory."""
        assert self._fd is not None
        raw = os.pread(self._fd, _COUNTS.size, 0)
        return _COUNTS.unpack(raw) if len(raw) == _COUNTS.size else (0, 0)

    def used(self) -> int:
        return sum(self.counts())

    def _write(self, committed: int, reserved: int) -> None:
        assert self._fd is not None
        os.pwrite(self._fd, _COUNTS.pack(max(0, committed), max(0, reserved)), 0)

    def _write_own(self) -> None:
        assert self._claim_fd is not None
        os.pwrite(self._claim_fd, _OWN.pack(self._own), 0)

    def reserve(self, n: int) -> None:
        committed, reserved = self.counts()
        self._write(committed, reserved + n)
        self._own += n
        self._write_own()

    def release(self, n: int) -> None:
        committed, reserved = self.counts()
        self._write(committed, reserved - n)
        self._own -= n
        self._write_own()

    def commit(self, n: int) -> None:
        """A reserved write of ``n`` bytes became a committed object."""
        committed, reserved = self.counts()
        self._write(committed + n, reserved - n)
        self._own -= n
        self._write_own()

    def uncount(self, n: int) -> None:
        """A committed object of ``n`` bytes was removed."""
        committed, reserved = self.counts()
        self._write(committed - n, reserved)

    def recount(self, committed: int) -> None:
        """Alone in the directory: the committed bytes are what the files say, and nothing but
        this tier's own writes is in flight."""
        self._write(committed, self._own)

    def sweep(self) -> int:
        """Return dead claims' reservations to the ledger and remove them; the live others."""
        alive = 0
        for entry in os.scandir(self.directory / CLAIMS):
            if entry.name == self.claim_id:
                continue
            try:
                fd = os.open(entry.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    alive += 1
                    continue
                raw = os.pread(fd, _OWN.size, 0)
                lost = _OWN.unpack(raw)[0] if len(raw) == _OWN.size else 0
                committed, reserved = self.counts()
                self._write(committed, reserved - lost)
                with suppress(FileNotFoundError):
                    os.unlink(entry.path)
            finally:
                os.close(fd)
        return alive

    # ---- outside the lock ----------------------------------------------------------------------
    def claim_alive(self, claim_id: str) -> bool:
        """Whether a temp file named with ``claim_id`` may still be written: its claim file exists
        (claims are made before any temp and removed only once their owner is gone)."""
        return bool(claim_id) and self._claim_path(claim_id).exists()

    def shared_used(self) -> int:
        """Committed + reserved bytes, read without the lock (a snapshot for stats)."""
        with self._mutex:
            return self.used() if self._fd is not None else 0

    def close(self) -> None:
        """Return this tier's reservations, remove its claim and close both files. Idempotent;
        ``locked()`` opens them again if the tier is used after this."""
        with self._mutex:
            if self._fd is None:
                return
            with self.locked():
                if self._own:
                    self.release(self._own)
                with suppress(FileNotFoundError):
                    os.unlink(self._claim_path(self.claim_id))
                assert self._claim_fd is not None
                os.close(self._claim_fd)
                self._claim_fd = None
            os.close(self._fd)
            self._fd = None
