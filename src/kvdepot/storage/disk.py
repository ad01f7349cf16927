"""The disk tier: one checksummed file per chunk under ``<path>/<namespace hex>/<kk>/<key hex>``.

* **Atomic writes.** An object is written to a hidden temp file in its final directory, fsynced
  when asked, then ``os.replace``d over the final name: readers see a whole object or none.
* **Verified reads.** A file whose header or checksum does not match (flipped byte, truncation,
  another namespace's object, garbage) is a miss; it is deleted and counted in ``corrupt``.
* **Restart.** The index is rebuilt from file names and sizes (LRU order from mtimes); contents
  are validated lazily, on the first read. Stray temp files of a crashed writer are removed.
* **Capacity.** Bytes of committed objects plus writes in flight never exceed ``capacity_bytes``;
  room is made by evicting least recently used objects (``policy.LRUPolicy``).
* **O_DIRECT** when the directory's filesystem takes it (probed once with an aligned write), so
  gigabytes of KV do not churn the page cache; otherwise (tmpfs before Linux 6.6, non-Linux)
  buffered I/O. An object's header fills its first 4 KiB block (``codec.FLAG_ALIGNED``), so the payload sits at an
  aligned offset and moves straight between the file and an aligned caller buffer (a host-arena
  slot) in one ``pwritev``/``preadv`` with the header block: no copy of the payload either way.
* **Reads into the caller's memory.** ``get_into(key, out)`` fills a buffer the caller reuses
  (no page faults of fresh memory); ``get(key)`` returns new memory.
* **One checksum pass.** A write sends a payload over ``OVERLAP`` bytes to the file while a
  helper thread computes its header (xxhash releases the GIL), then writes the header block; a read
  of a payload over ``READ_PIECE`` bytes goes in pieces, a helper checksumming each piece where it
  landed while the next is read (on the GPU host one pass after a whole read cost ~20% of it).

Thread-safe: an index lock is held for bookkeeping only, never across file I/O.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import suppress
from pathlib import Path

import numpy as np

from kvdepot.events.base import NULL_SINK, EventSink, Medium
from kvdepot.keys import KEY_BYTES, ChunkKey
from kvdepot.storage import codec
from kvdepot.storage.base import TierStats
from kvdepot.storage.codec import Payload
from kvdepot.storage.policy import POLICIES

logger = logging.getLogger("kvdepot")

O_DIRECT = getattr(os, "O_DIRECT", 0)  # module attribute so tests can emulate the aligned path
ALIGN = 4096  # O_DIRECT offset/length/buffer alignment (a multiple of every logical block size)
OFFSET = codec.ALIGNED_OFFSET  # where the payload of every disk object starts (one aligned block)
OVERLAP = 4 << 20  # a longer payload is checksummed on a helper thread while it is written
READ_PIECE = 4 << 20  # a longer payload is read in pieces of this size, checksummed as they land


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _is_aligned(view: memoryview) -> bool:
    """Whether ``view`` starts on an ``ALIGN`` boundary (what O_DIRECT asks of a buffer)."""
    return not view.nbytes or np.frombuffer(view, np.uint8).ctypes.data % ALIGN == 0


def _fresh(n: int) -> memoryview:
    """``n`` bytes of new page-aligned memory (the kernel faults its pages in as it reads)."""
    return memoryview(mmap.mmap(-1, _align(n) or ALIGN))[:n]


def _write_at(fd: int, views: list[memoryview], offset: int) -> None:
    total = sum(view.nbytes for view in views)
    if _transfer(os.pwritev, fd, views, offset, total) < total:
        raise OSError(errno.EIO, "short write")


def probe_o_direct(directory: str | os.PathLike[str]) -> bool:
    """Whether an aligned O_DIRECT write succeeds in ``directory``."""
    if not O_DIRECT:
        return False
    path = os.path.join(directory, f".probe-{uuid.uuid4().hex}.tmp")
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o600)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        buf.close()
        with suppress(FileNotFoundError):
            os.unlink(path)


def _transfer(call: Callable[[int, list[memoryview], int], int], fd: int, parts: list[memoryview],
              offset: int, want: int) -> int:
    """``os.preadv``/``os.pwritev`` of ``parts`` at ``offset``, resumed after short transfers (Linux
    moves at most ~2 GiB per call), until ``want`` bytes moved or the file ends; bytes moved."""
    parts, done = [part for part in parts if part.nbytes], 0
    while parts and done < want:
        n = call(fd, parts, offset + done)
        if n <= 0:
            break
        done += n
        while n:
            if n >= parts[0].nbytes:
                n -= parts.pop(0).nbytes
            else:
                parts[0], n = parts[0][n:], 0
    return done


class DiskTier:
    """Chunk objects of one namespace in a directory, LRU within ``capacity_bytes``."""

    name = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        namespace: bytes,
        *,
        o_direct: bool | None = None,
        fsync: bool = False,
        policy: str = "lru",
        events: EventSink = NULL_SINK,
    ) -> None:
        """Args:
        path: the tier's directory (shared by namespaces: each gets its own subdirectory).
        capacity_bytes: limit on the bytes of this namespace's objects.
        namespace: the 16-byte ``Namespace.digest`` whose objects this tier serves.
        o_direct: None or True = use O_DIRECT if the probe succeeds; False = never.
        fsync: fsync each object and its directory before it counts as stored.
        events: told of every object stored and every one forgotten (evicted, deleted, corrupt).
        """
        self.namespace = codec.check_namespace(namespace)
        self.root = Path(path) / namespace.hex()
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.capacity_bytes = int(capacity_bytes)
        self.fsync = fsync
        self.o_direct = o_direct is not False and probe_o_direct(self.root)
        if o_direct and not self.o_direct:
            logger.info("disk tier %s: O_DIRECT not supported here; using buffered I/O", self.root)
        self._sizes: dict[ChunkKey, int] = {}
        self._writing: set[ChunkKey] = set()
        self._policy = POLICIES[policy]()
        self._used = 0  # bytes of committed objects
        self._reserved = 0  # bytes of writes in flight
        self._lock = threading.Lock()
        self._local = threading.local()  # per-thread aligned buffers for O_DIRECT
        self._io_failing = False
        self._helpers: ThreadPoolExecutor | None = None  # checksums that overlap writes
        self._stats = TierStats(name=self.name, capacity_bytes=self.capacity_bytes)
        self._events = events
        self._scan()

    # ---- index ---------------------------------------------------------------------------
    def _path(self, key: ChunkKey) -> str:
        name = key.hex()
        return os.path.join(self.root, name[:2], name)

    def _scan(self) -> None:
        found: list[tuple[int, ChunkKey, int]] = []
        for shard in os.scandir(self.root):
            if shard.name.endswith(".tmp"):  # a probe file left by a crash
                with suppress(FileNotFoundError):
                    os.unlink(shard.path)
            if not (shard.is_dir(follow_symlinks=False) and len(shard.name) == 2):
                continue
            for entry in os.scandir(shard.path):
                if entry.name.endswith(".tmp"):
                    with suppress(FileNotFoundError):
                        os.unlink(entry.path)
                    continue
                try:
                    key = bytes.fromhex(entry.name)
                except ValueError:
                    continue
                if len(key) == KEY_BYTES and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, ChunkKey(key), st.st_size))
        with self._lock:
            for _mtime, key, size in sorted(found):
                self._sizes[key] = size
                self._used += size
                self._policy.touch(key)
            self._make_room_locked(0)

    def _forget_locked(self, key: ChunkKey) -> None:
        self._used -= self._sizes.pop(key)
        self._policy.remove(key)
        self._events.removed(Medium.DISK, (key,))

    def _remove_locked(self, key: ChunkKey) -> None:
        self._forget_locked(key)
        with suppress(FileNotFoundError):
            os.unlink(self._path(key))

    def _make_room_locked(self, size: int) -> bool:
        """Evict LRU objects until ``size`` more bytes fit; decide every victim before deleting."""
        excess = self._used + self._reserved + size - self.capacity_bytes
        victims = []
        for key in self._policy.candidates():
            if excess <= 0:
                break
            victims.append(key)
            excess -= self._sizes[key]
        if excess > 0:
            return False
        for key in victims:
            self._remove_locked(key)
        self._stats.evictions += len(victims)
        return True

    # ---- Tier ----------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._sizes

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [key in self._sizes for key in keys]

    def get(self, key: ChunkKey) -> memoryview | None:
        """The verified payload of ``key`` in new memory (a read-only view), or None on a miss; a
        corrupt object is deleted and counted. ``get_into`` a reused buffer saves the page faults."""
        payload = self._get(key, None)
        return None if payload is None else payload.toreadonly()

    def get_into(self, key: ChunkKey, out: Payload) -> int | None:
        """Read ``key``'s verified payload into the writable buffer ``out`` (e.g. a host-arena slot;
        page-aligned lets O_DIRECT fill it in place): its length, or None on a miss (``out``'s
        contents are then undefined). A corrupt object is deleted and counted. ValueError if the
        payload is longer than ``out``."""
        payload = self._get(key, memoryview(out).cast("B"))
        return None if payload is None else payload.nbytes

    def _get(self, key: ChunkKey, out: memoryview | None) -> memoryview | None:
        with self._lock:
            if key not in self._sizes:
                self._stats.misses += 1
                return None
            self._policy.touch(key)
        payload, corrupt = self._read(key, out)
        with self._lock:
            if payload is not None:
                self._stats.hits += 1
                return payload
            self._stats.misses += 1
            if key in self._sizes and key not in self._writing:
                if corrupt:
                    self._stats.corrupt += 1
                    self._remove_locked(key)
                else:
                    self._forget_locked(key)  # vanished or unreadable: stop advertising it
        return None

    def put(self, key: ChunkKey, payload: Payload) -> bool:
        """Store ``payload`` (kept if ``key`` is present already); False if it could not."""
        data = memoryview(payload).cast("B")
        size = OFFSET + data.nbytes
        with self._lock:
            if key in self._sizes or key in self._writing:
                if key in self._sizes:
                    self._policy.touch(key)
                return True
            if size > self.capacity_bytes or not self._make_room_locked(size):
                self._stats.dropped += 1
                return False
            self._reserved += size
            self._writing.add(key)
        ok = self._write(key, data)
        with self._lock:
            self._reserved -= size
            self._writing.discard(key)
            if ok:
                self._sizes[key] = size
                self._used += size
                self._policy.touch(key)
                self._stats.puts += 1
                self._events.stored(Medium.DISK, (key,))
            else:
                self._stats.dropped += 1
        return ok

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            if key not in self._sizes:
                return False
            self._remove_locked(key)
            return True

    def stats(self) -> TierStats:
        with self._lock:
            self._stats.chunks = len(self._sizes)
            self._stats.used_bytes = self._used
            return TierStats(**vars(self._stats))

    def close(self) -> None:
        """Stop the checksum helpers (after the calls in flight); drop this thread's buffers."""
        with self._lock:
            helpers, self._helpers = self._helpers, None
        if helpers is not None:
            helpers.shutdown(wait=True)
        for name in ("blocks", "bounce"):
            with suppress(AttributeError):
                delattr(self._local, name)

    def _helper(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._helpers is None:
                self._helpers = ThreadPoolExecutor(4, thread_name_prefix="kvdepot-disk-checksum")
            return self._helpers

    # ---- file I/O ----------------------------------------------------------------------------
    def _blocks(self) -> memoryview:
        """This thread's two aligned blocks: the header block, and the tail of a payload whose
        length is not a multiple of ``ALIGN`` (O_DIRECT moves whole blocks)."""
        blocks = getattr(self._local, "blocks", None)
        if blocks is None:
            blocks = self._local.blocks = memoryview(mmap.mmap(-1, 2 * ALIGN))
        return blocks

    def _bounce(self, size: int) -> memoryview:
        """This thread's page-aligned buffer of at least ``size`` bytes (reused across calls), for
        O_DIRECT I/O of a caller's buffer that is not aligned."""
        buf = getattr(self._local, "bounce", None)
        if buf is None or buf.nbytes < size:
            buf = self._local.bounce = memoryview(mmap.mmap(-1, _align(size)))
        return buf

    def _write(self, key: ChunkKey, data: memoryview) -> bool:
        path = self._path(key)
        tmp = os.path.join(os.path.dirname(path), f".{key.hex()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            try:
                self._write_file(tmp, key, data, self.o_direct)
            except OSError as exc:
                if not (self.o_direct and exc.errno == errno.EINVAL):
                    raise
                logger.warning("disk tier %s: O_DIRECT write refused; using buffered I/O", self.root)
                self.o_direct = False
                with suppress(FileNotFoundError):
                    os.unlink(tmp)
                self._write_file(tmp, key, data, False)
            os.replace(tmp, path)
            if self.fsync:
                dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except OSError:
            with suppress(OSError):
                os.unlink(tmp)
            if not self._io_failing:  # log once per run of failures
                logger.warning("disk tier %s: cannot write %s", self.root, path, exc_info=True)
            self._io_failing = True
            return False
        self._io_failing = False
        return True

    def _write_file(self, tmp: str, key: ChunkKey, data: memoryview, direct: bool) -> None:
        """Header block and payload; a long payload is written first, at ``OFFSET``, while a helper
        computes the header (the one checksum pass), which follows at 0."""
        n, blocks, header = data.nbytes, self._blocks(), None
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (O_DIRECT if direct else 0), 0o600)
        try:
            if n > OVERLAP:
                header = self._helper().submit(codec.encode_header, self.namespace, key, data, True)
            cut = n - n % ALIGN
            if not direct:
                body = [data]  # one syscall with the header block, no joined copy
            elif _is_aligned(data):  # e.g. a host-arena slot: the payload goes straight to the file
                body = [data[:cut]]
                if cut < n:  # the last partial block, padded (truncated away below)
                    blocks[ALIGN : ALIGN + n - cut] = data[cut:]
                    body.append(blocks[ALIGN:])
            else:  # NOTE: one copy into an aligned buffer (see docs/tiers.md for the measurements)
                buf = self._bounce(n)
                buf[:n] = data
                body = [buf[: _align(n)]]
            end, block = OFFSET + sum(part.nbytes for part in body), blocks[:ALIGN]
            if header is None:
                block[:] = codec.encode_header(self.namespace, key, data, aligned=True)
                _write_at(fd, [block, *body], 0)
            else:
                _write_at(fd, body, OFFSET)
                block[:] = header.result()
                _write_at(fd, [block], 0)
            if end != OFFSET + n:
                os.ftruncate(fd, OFFSET + n)
            if self.fsync:
                os.fsync(fd)
        finally:
            if header is not None:
                wait([header])  # never return while a helper still reads the caller's buffer
            os.close(fd)

    def _header(self, head: memoryview, key: ChunkKey, n: int) -> codec.Header | None:
        """``key``'s header in this namespace and the disk layout, for an ``n``-byte payload; else None."""
        header = codec.read_header(head, self.namespace, key)
        return header if header is not None and header.offset == OFFSET and header.length == n else None

    def _read_pieces(self, fd: int, key: ChunkKey, dst: memoryview, direct: bool) -> tuple[memoryview | None, bool]:
        """``_read`` of a long payload into ``dst``, ``READ_PIECE`` bytes at a time, while a helper
        checksums the pieces already read: the checksum pass hides behind the disk except for
        the last piece (the header is read with the first piece, and checked before the rest)."""
        n, blocks = dst.nbytes, self._blocks()
        head, tail = blocks[:ALIGN], blocks[ALIGN:]
        cut = n - n % ALIGN if direct else n  # O_DIRECT reads the last partial block into ``tail``
        if _transfer(os.preadv, fd, [head, dst[:READ_PIECE]], 0, OFFSET + READ_PIECE) < OFFSET + READ_PIECE:
            return None, True
        header = self._header(head, key, n)
        if header is None:
            return None, True
        pieces: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        pieces.put(dst[:READ_PIECE])
        verdict = self._helper().submit(codec.verify_pieces, header, iter(pieces.get, None))
        try:
            for pos in range(READ_PIECE, cut, READ_PIECE):
                piece = dst[pos : min(pos + READ_PIECE, cut)]
                if _transfer(os.preadv, fd, [piece], OFFSET + pos, piece.nbytes) < piece.nbytes:
                    return None, True  # shrunk while we read
                pieces.put(piece)
            if cut < n:
                if _transfer(os.preadv, fd, [tail], OFFSET + cut, n - cut) < n - cut:
                    return None, True
                dst[cut:] = tail[: n - cut]
                pieces.put(dst[cut:])
        finally:
            pieces.put(None)  # ends the helper's pass: a short one fails verification
            valid = verdict.result()
        return (dst, False) if valid else (None, True)

    def _read(self, key: ChunkKey, out: memoryview | None) -> tuple[memoryview | None, bool]:
        """(payload in ``out``, or in fresh memory when ``out`` is None; False) when valid,
        (None, True) when corrupt, (None, False) when gone or unreadable. ValueError if a valid
        object does not fit in ``out``."""
        direct = self.o_direct
        try:
            fd = os.open(self._path(key), os.O_RDONLY | (O_DIRECT if direct else 0))
        except FileNotFoundError:
            return None, False
        except OSError:
            logger.warning("disk tier %s: cannot open %s", self.root, key.hex(), exc_info=True)
            return None, False
        try:
            size = os.fstat(fd).st_size
            n = size - OFFSET
            if n < 0:
                return None, True
            blocks = self._blocks()
            head, tail = blocks[:ALIGN], blocks[ALIGN:]
            if out is None:
                out = _fresh(n)
            elif out.nbytes < n:
                got = _transfer(os.preadv, fd, [head], 0, ALIGN)
                header = codec.read_header(head[:got], self.namespace, key)
                if header is not None and header.length == n:
                    raise ValueError(f"chunk {key.hex()} has {n} bytes; the buffer holds {out.nbytes}")
                return None, True
            dst, cut = out[:n], n - n % ALIGN
            if direct and not _is_aligned(dst):  # NOTE: one copy out of an aligned buffer
                bounce = self._bounce(size)
                if _transfer(os.preadv, fd, [bounce[: _align(size)]], 0, size) < size:
                    return None, True
                head = bounce[:ALIGN]
                dst[:] = bounce[OFFSET:size]
            elif n > READ_PIECE:
                return self._read_pieces(fd, key, dst, direct)
            else:
                parts = [head, dst[:cut], tail] if direct and cut < n else [head, dst]
                if _transfer(os.preadv, fd, parts, 0, size) < size:
                    return None, True  # shrunk while we read
                if direct and cut < n:
                    dst[cut:] = tail[: n - cut]
            header = self._header(head, key, n)
            if header is None or not codec.verify(header, dst):
                return None, True
            return dst, False
        except OSError:
            logger.warning("disk tier %s: cannot read %s", self.root, key.hex(), exc_info=True)
            return None, False
        finally:
            os.close(fd)
