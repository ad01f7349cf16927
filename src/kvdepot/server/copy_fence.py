"""The fence between a client that gave up on a mapped-pool copy and a server still doing it.

Why: a STORE or RETRIEVE of a mapped pool (CUDA IPC, a shared file) has the server read or write
the engine's own blocks. The client's call has a timeout; past it the engine takes the blocks
back (recomputes them, hands them to another request). The deadline (half the timeout) only stops
the server from *starting* late: a server stalled between that check and the end of its copy
(stopped, swapped out, descheduled, waiting on a promotion) went on writing into blocks that were
no longer the load's, or storing bytes the engine had since overwritten under this chunk's key.
Both are silently wrong KV. CI's soak caught the first once: 8 KiB written after a load was over.

The fence is a file per registration beside the pool: ``SLOTS`` 8-byte words and one byte-range
lock per word (open-file-description locks, which the kernel drops when the holder's process dies).
Neither side maps it: a mapping would hold the open file (and its locks) past ``close``. Words are
read and written with ``pread``/``pwrite``, one system call per copy entered or abandoned.

    client  FenceFile.create()           a fresh 0600 file; its path and epoch go in REGISTER
            fence.ticket() -> Ticket     one per copy, its number sent with the copy
            ticket.settle()              the reply came: the server is done with the blocks
            ticket.abandon(wait) -> bool no reply: write the number into its word, then take the
                                         word's lock (and drop it); True once the blocks are free
    server  ServedFence.open(path, epoch)
            fence.admit(number, deadline_ns) -> Admission
            admission.enter()            right before the copy: refuses (DEADLINE_EXCEEDED) past
                                         the deadline, or where the client abandoned the copy
            admission.leave()            once the copy is over: a store's completed, a load's
                                         enqueued and its event recorded, a layered load's last
                                         layer recorded

``enter`` takes the word's lock *without waiting* and then reads the word: the lock taken (the
client is abandoning) or the word holding this copy's number refuse the copy; otherwise the lock
is held until ``leave``. ``abandon`` writes the word first and then waits for the lock: when it
has it, the server is either past the copy or will refuse it, whichever came first. For a CUDA load
the client's stream then waits on the events the server records before ``leave``.

What it costs: nothing while the server answers (a reply settles the ticket). With the server
stalled *inside* a copy, the engine waits for the copy to end or the server process to exit,
logging every ``LOG_EVERY_S``: blocks another process may still be writing are never used. A
server killed mid-copy drops its locks as it exits. The one case this does not cover: on CUDA, a
dead server's copies already enqueued on the GPU; the driver's teardown of its context is not
ordered with the release of its locks.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import struct
import threading
import time
import weakref
from collections.abc import Callable

from kvdepot.server import shared_file
from kvdepot.server.protocol import CudaIpcPool, ErrorCode, PoolDesc, ProtocolError, ShmPool

logger = logging.getLogger("kvdepot")

SLOTS = 4096  # copies a registration may have unsettled at once (a step's loads, its stores)
FILE_BYTES = SLOTS * 8
PREFIX = "kvdepot-fence-"  # the server opens no file not named so
LOG_EVERY_S = 10.0
SUPPORTED = hasattr(fcntl, "F_OFD_SETLK")  # Linux: locks owned by the open file, dropped at exit
_SEQ_BITS = 32
_FLOCK = "hhqqi4x"  # struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid
_WORD = struct.Struct("<Q")


class FenceError(shared_file.SharedFileError):
    """A fence file could not be made or mapped (copies then go with the deadline alone)."""


def _try_lock(fd: int, slot: int) -> bool:
    """Take slot ``slot``'s lock without waiting; False where another open file holds it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, slot * 8, 8, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _unlock(fd: int, slot: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_UNLCK, os.SEEK_SET, slot * 8, 8, 0))


# ---- client side ---------------------------------------------------------------------------------
class FenceFile:
    """The client's fence of one registration: numbers copies, abandons them. Thread-safe."""

    def __init__(self, path: str, fd: int, epoch: int) -> None:
        self.path, self.epoch = path, epoch
        self._fd: int | None = fd
        self._seq = 0
        self._out: dict[int, int] = {}  # slot -> number of the unsettled copy that owns it
        self._lock = threading.Lock()
        self._full_logged = False
        self._closer = weakref.finalize(self, os.close, fd)  # a fence dropped unclosed still frees its fd

    @classmethod
    def create(cls) -> FenceFile:
        path, fd = shared_file.create(PREFIX, FILE_BYTES, FenceError)
        return cls(path, fd, secrets.randbits(31) | 1)

    def ticket(self, on_abandoned: Callable[[], None] | None = None) -> Ticket | None:
        """A number for the next copy, in a slot no unsettled copy holds; None if every slot is
        held (logged once: that copy goes with the deadline alone)."""
        with self._lock:
            for _ in range(SLOTS):
                self._seq = self._seq % ((1 << _SEQ_BITS) - 1) + 1
                slot = self._seq % SLOTS
                if slot not in self._out:
                    number = self.epoch << _SEQ_BITS | self._seq
                    self._out[slot] = number
                    return Ticket(self, number, on_abandoned)
            if not self._full_logged:
                self._full_logged = True
                logger.warning("kvdepot: %d copies unsettled at once; the next go unfenced", SLOTS)
        return None

    @property
    def unsettled(self) -> int:
        with self._lock:
            return len(self._out)

    def settle(self, number: int) -> None:
        with self._lock:
            slot = number % SLOTS
            if self._out.get(slot) == number:
                del self._out[slot]

    def abandon(self, number: int, wait: bool) -> bool:
        """See the module docstring; True once the server will not touch the copy's blocks again
        (also for a settled ticket, or a closed fence: its engine is going away)."""
        slot = number % SLOTS
        with self._lock:
            if self._out.get(slot) != number or self._fd is None:
                return True
            os.pwrite(self._fd, _WORD.pack(number), slot * 8)  # NOTE: before the lock: see the module docstring
        start = warned = time.monotonic()
        pause = 1e-4
        while True:
            with self._lock:
                if self._fd is None:
                    return True
                if _try_lock(self._fd, slot):
                    _unlock(self._fd, slot)
                    self._out.pop(slot, None)
                    return True
            if not wait:
                return False
            now = time.monotonic()
            if now - warned >= LOG_EVERY_S:
                warned = now
                logger.warning("kvdepot: the server has been in a copy this engine gave up on for %.0f s; its "
                               "blocks stay unused until the copy ends or the server exits", now - start)
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def unlink(self) -> None:
        """Remove the name (REGISTER has been answered: the server holds its own descriptor)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        with self._lock:
            self._fd = None
            self._out.clear()
        self._closer()


class Ticket:
    """One copy's place in a ``FenceFile``; ``on_abandoned`` runs once an abandon succeeded
    (a CUDA load: the caller's stream waits on what the server recorded before letting go)."""

    def __init__(self, fence: FenceFile, number: int, on_abandoned: Callable[[], None] | None = None) -> None:
        self.fence, self.number, self._on_abandoned = fence, number, on_abandoned

    def settle(self) -> None:
        self.fence.settle(self.number)

    def abandon(self, wait: bool) -> bool:
        if not self.fence.abandon(self.number, wait):
            return False
        if self._on_abandoned is not None:
            on_abandoned, self._on_abandoned = self._on_abandoned, None
            on_abandoned()
        return True


# ---- server side ---------------------------------------------------------------------------------
class ServedFence:
    """The server's side of a registration's fence: its descriptor, which owns the locks taken
    through it (closed, it drops them)."""

    def __init__(self, path: str, fd: int, epoch: int) -> None:
        self.path, self.epoch = path, epoch
        self._fd: int | None = fd
        self._held: dict[int, int] = {}  # slot -> number of the copy in it
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str, epoch: int) -> ServedFence:
        """A fresh fence file only (name, size, zeros), checked through the descriptor kept."""
        if not 0 < epoch < 1 << 31:
            raise FenceError(f"fence epoch {epoch} is not in 1..2**31-1")
        fd = shared_file.open_checked(path, PREFIX, FILE_BYTES, FenceError)
        try:
            fresh = os.pread(fd, FILE_BYTES, 0).count(0) == FILE_BYTES
        except OSError as exc:
            os.close(fd)
            raise FenceError(f"cannot read fence file {path[:256]!r}: {exc.strerror}") from None
        if not fresh:
            os.close(fd)
            raise FenceError(f"fence file {path[:256]!r} is not fresh (zeroed)")
        return cls(path, fd, epoch)

    def admit(self, number: int, deadline_ns: int = 0) -> Admission:
        return Admission(self, number, deadline_ns)

    def _enter(self, number: int) -> None:
        if number >> _SEQ_BITS != self.epoch or not number & ((1 << _SEQ_BITS) - 1):
            raise ProtocolError(ErrorCode.DEADLINE_EXCEEDED, "the copy's ticket is not of this registration "
                                "(sent before the client registered again)")
        slot = number % SLOTS
        with self._lock:
            if self._fd is None:
                raise ProtocolError(ErrorCode.NOT_REGISTERED, "the registration is closing")
            if slot in self._held:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"ticket slot {slot} is in use by another copy")
            if not _try_lock(self._fd, slot):
                raise ProtocolError(ErrorCode.DEADLINE_EXCEEDED, "the client abandoned this copy")
            if _WORD.unpack(os.pread(self._fd, 8, slot * 8))[0] == number:
                _unlock(self._fd, slot)
                raise ProtocolError(ErrorCode.DEADLINE_EXCEEDED, "the client abandoned this copy")
            self._held[slot] = number

    def _leave(self, number: int) -> None:
        slot = number % SLOTS
        with self._lock:
            if self._held.get(slot) == number:
                del self._held[slot]
                if self._fd is not None:
                    _unlock(self._fd, slot)

    def close(self) -> None:
        """Drop the descriptor (and every lock taken through it): the pool's copies are over."""
        with self._lock:
            fd, self._fd = self._fd, None
            self._held.clear()
        if fd is not None:
            os.close(fd)


class Admission:
    """Whether one copy may start (``enter``), and its end (``leave``, idempotent)."""

    def __init__(self, fence: ServedFence | None, number: int = 0, deadline_ns: int = 0) -> None:
        self._fence, self.number, self.deadline_ns = fence, number, deadline_ns
        self._entered = False

    def enter(self) -> None:
        if self.deadline_ns and time.monotonic_ns() > self.deadline_ns:
            # The client has stopped waiting and may reuse these blocks: a copy now could race it.
            raise ProtocolError(ErrorCode.DEADLINE_EXCEEDED, "the client's deadline passed before the copy could start")
        if self._fence is not None and self.number:
            self._fence._enter(self.number)
            self._entered = True

    def leave(self) -> None:
        if self._entered and self._fence is not None:
            self._entered = False
            self._fence._leave(self.number)


OPEN = Admission(None)  # a copy with neither deadline nor ticket (a bytes pool's payload)


def serve_fence(desc: PoolDesc, allow_shm: bool) -> ServedFence | None:
    """The fence REGISTER names, opened where it may be (a mapped pool on an ipc:// server), else
    None (logged if it could not be opened): that client's copies then go with the deadline alone."""
    if not (isinstance(desc, CudaIpcPool | ShmPool) and desc.fence and allow_shm and SUPPORTED):
        return None
    try:
        return ServedFence.open(desc.fence, desc.fence_epoch)
    except FenceError as exc:
        logger.warning("kvdepot server: %s; this client's copies go with their deadline alone", exc)
        return None
