"""How far the server has recorded a load's layer events, in shared memory: no round trip to read it.

Why (issue 19): a forward that reached layer ``l`` of a load answered early before the server had
told it that layer ``l``'s event was recorded asked LAYERS and waited for the reply — a round
trip, a hand-off to the server's pool and a GIL switch there, per layer the forward caught up
with. Here the server writes each load's progress into a page the client maps, and the forward's
wait reads it; LAYERS stays as the fallback for everything the page cannot tell.

    ProgressPage.create() -> page     client: a fresh 0600 file (``/dev/shm``), mapped read-only
    ProgressPage.open(path) -> page   server: the file checked (named ``PREFIX``*, ``O_NOFOLLOW``,
                                      a regular file of its own user, ``PAGE_BYTES`` of zeros) and
                                      mapped read-write
    serve_page(desc, allow_shm)       server: REGISTER's page mapped where it may be, else None
    page.write(load_id, recorded, failure, fenced)     server, after the events are recorded
    page.read(load_id, layers) -> Seen | None          client, before it waits on an event
    page.path / page.unlink() / page.close()

Layout (v1): ``SLOTS`` native uint64 words; load ``id`` owns slot ``id % SLOTS`` until load
``id + SLOTS`` of the same registration takes it. A word is
``id << 14 | fenced << 13 | failure << 11 | recorded``: layers ``0..recorded-1`` have their
events recorded for load ``id`` (at most ``MAX_LAYER_EVENTS`` = 1024 < 2**11), ``failure`` is
0 (none) or a ``FAILURES`` kind, ``fenced`` as in ``LayersReply``. A word of an older load reads
as nothing recorded yet, one of a later load (the slot was taken) as unknown: the client then
asks LAYERS. Load ids are unique per server and never near 2**50.

Lifecycle: the client names the file in REGISTER (``CudaIpcPool.progress_page``) and unlinks it
once the REGISTER reply — or its failure — is in, so both mappings stay and nothing is left in
``/dev/shm`` (a client killed during REGISTER leaves one 4 KiB file). The server says it mapped
it (``RegisterReply.progress_page``); an older server does not, and the client then uses LAYERS.
``close`` drops the page's own reference; the mapping goes with the last reader of it.

Why a read is safe (x86-64, where the page is offered: ``PAGE_SUPPORTED``):

* The server writes a word only after ``cudaEventRecord`` of every layer it counts has returned,
  and after taking a lock (``LayerProgress``'s): a locked instruction, so every earlier store of
  that thread — the driver's record included — is visible to other cores before the word is.
* The client reads the word (a fresh load from the mapping: numpy reads memory, nothing caches
  it) before it calls ``cudaStreamWaitEvent``; x86 does not reorder a load with later loads, so
  the driver's wait sees a record at least as new as the word says.
* A word is one aligned 8-byte store and load (a numpy uint64 element of a page-aligned
  mapping), single-copy atomic on x86-64: no read is torn. A stale read returns an older word
  of the same load (``recorded`` only grows) or an older load's: it under-reports, never more.

On weakly ordered CPUs (aarch64) the second point needs a barrier Python cannot issue, so no page
is offered there and loads by layer keep the LAYERS round trips.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import platform
from dataclasses import dataclass

import numpy as np

from kvdepot.server import shared_file
from kvdepot.server.protocol import CudaIpcPool, PoolDesc

logger = logging.getLogger("kvdepot")

PAGE_BYTES = 4096
SLOTS = PAGE_BYTES // 8
_ID_BITS = 50
_ID_MASK = (1 << _ID_BITS) - 1
_RECORDED_MASK = (1 << 11) - 1
# failure kinds a word can carry (0: none); what the client's ``TransferFailed`` says
FAILURES = {1: "a layer's copies could not be enqueued", 2: "the client's deadline passed before a layer was enqueued",
            3: "the server could not signal a layer"}
PAGE_SUPPORTED = platform.machine().lower() in ("x86_64", "amd64")
PREFIX = "kvdepot-progress-"  # a page's file name starts so; the server maps no other


class PageError(shared_file.SharedFileError):
    """A progress page could not be made or mapped (the load then goes by LAYERS)."""


@dataclass(frozen=True)
class Seen:
    """What a word says of one load: ``recorded`` layers, and whether (how) it failed."""

    recorded: int
    failure: int = 0
    fenced: bool = False


def encode(load_id: int, recorded: int, failure: int = 0, fenced: bool = False) -> int:
    return ((load_id & _ID_MASK) << 14) | (int(fenced) << 13) | ((failure & 3) << 11) | (recorded & _RECORDED_MASK)


def decode(word: int, load_id: int, layers: int) -> Seen | None:
    """``word`` read for ``load_id`` of ``layers`` layers: None where it cannot tell (a later
    load's word, or a value no server writes)."""
    owner, mine = word >> 14, load_id & _ID_MASK
    if owner < mine:
        return Seen(0)  # the server has not written this load yet
    recorded = word & _RECORDED_MASK
    if owner > mine or recorded > layers:
        return None
    return Seen(recorded, (word >> 11) & 3, bool(word >> 13 & 1))


class ProgressPage:
    """One registration's page; ``read`` and ``write`` take no lock (see the module docstring)."""

    def __init__(self, path: str, memory: mmap.mmap) -> None:
        self.path = path
        # read-only where mapped so (the client's); the array holds the mapping
        self._words: np.ndarray | None = np.frombuffer(memory, dtype=np.uint64)

    @classmethod
    def create(cls) -> ProgressPage:
        """A zeroed page in a new file (the client's); the caller unlinks it after REGISTER."""
        path, fd = shared_file.create(PREFIX, PAGE_BYTES, PageError)
        try:
            memory = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError as exc:
            os.unlink(path)
            raise PageError(f"cannot map a progress page: {exc}") from None
        finally:
            os.close(fd)
        return cls(path, memory)

    @classmethod
    def open(cls, path: str) -> ProgressPage:
        """The client's page, mapped for writing once checked through the descriptor it maps: a
        fresh page only (its name, size and zeros), so a REGISTER cannot make the server write
        into some other file of its user."""
        fd = shared_file.open_checked(path, PREFIX, PAGE_BYTES, PageError)
        try:
            memory = mmap.mmap(fd, PAGE_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise PageError(f"cannot map progress page {path[:256]!r}: {exc}") from None
        finally:
            os.close(fd)
        page = cls(path, memory)
        if page._words is not None and page._words.any():
            page.close()
            raise PageError(f"progress page {path[:256]!r} is not a fresh (zeroed) page")
        return page

    @property
    def closed(self) -> bool:
        return self._words is None

    def write(self, load_id: int, recorded: int, failure: int = 0, fenced: bool = False) -> None:
        """Publish ``load_id``'s progress (call after the events it counts are recorded)."""
        words = self._words  # a local reference keeps the mapping alive against a concurrent close
        if words is not None:
            words[load_id % SLOTS] = encode(load_id, recorded, failure, fenced)

    def read(self, load_id: int, layers: int) -> Seen | None:
        words = self._words
        if words is None:
            return None
        return decode(int(words[load_id % SLOTS]), load_id, layers)

    def unlink(self) -> None:
        """Remove the file (its mappings stay); a second call does nothing."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        """Drop this page's reference to the mapping: unmapped once no reader holds it."""
        self._words = None


def serve_page(desc: PoolDesc, allow_shm: bool) -> ProgressPage | None:
    """The page a REGISTER names, mapped: for a pool with layer events, on a server that maps
    files (ipc://: over TCP it maps none), on a CPU where the page is safe. None otherwise, or if
    it cannot be mapped (logged): the client then follows its loads by LAYERS."""
    if not (isinstance(desc, CudaIpcPool) and desc.progress_page and desc.layer_events and allow_shm
            and PAGE_SUPPORTED):
        return None
    try:
        return ProgressPage.open(desc.progress_page)
    except PageError as exc:
        logger.warning("kvdepot server: %s; this client's loads by layer go by LAYERS", exc)
        return None
