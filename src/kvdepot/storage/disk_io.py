"""The disk tier's file I/O: one chunk object per file, written and read with one checksum pass.

* **O_DIRECT** when the directory's filesystem takes it (probed once with an aligned write), so
  gigabytes of KV do not churn the page cache; otherwise (tmpfs before Linux 6.6, non-Linux)
  buffered I/O. An object's header fills its first 4 KiB block (``codec.FLAG_ALIGNED``), so the
  payload sits at an aligned offset and moves straight between the file and an aligned caller
  buffer (a host-arena slot) in one ``pwritev``/``preadv`` with the header block: no copy of the
  payload either way.
* **One checksum pass.** A write sends a payload over ``OVERLAP`` bytes to the file while a
  helper thread computes its header (xxhash releases the GIL), then writes the header block; a
  read of a payload over ``READ_PIECE`` bytes goes in pieces, ``READ_DEPTH`` of them in flight on
  reader threads that each take the next piece as theirs lands, the checksum blocks of each piece
  hashed on helpers where it landed while later ones are read (on the GPU host one pass after a
  whole read cost ~20%; one piece at a time left the disk idle between pieces; one helper hashing
  the pieces in order left 1.4 ms after the read).

``ObjectFiles`` knows nothing of indexes, budgets or eviction (``disk.DiskTier`` does): it writes
one object to a path it is given and reads one back, verified. Thread-safe: buffers are per thread.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, suppress

import numpy as np

from kvdepot.keys import ChunkKey
from kvdepot.storage import codec

logger = logging.getLogger("kvdepot")

O_DIRECT = getattr(os, "O_DIRECT", 0)  # module attribute so tests can emulate the aligned path
ALIGN = 4096  # O_DIRECT offset/length/buffer alignment (a multiple of every logical block size)
OFFSET = codec.ALIGNED_OFFSET  # where the payload of every disk object starts (one aligned block)
OVERLAP = 4 << 20  # a longer payload is checksummed on a helper thread while it is written
READ_PIECE = 2 << 20  # a longer payload is read in pieces of this size, checksummed as they land
READ_DEPTH = 8  # pieces of one payload read at once (the disk's queue depth for one read; see docs/tiers.md)
TAPER = 4  # the last READ_PIECE of a long read goes in this many pieces (see ``_spans``)
CORRUPT, GONE, ERROR = "corrupt", "gone", "error"  # why ``ObjectFiles.read`` found no payload


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` by numpy, which releases the GIL for the copy (a memoryview's assignment
    holds it: ~17 ms for 32 MiB on the dev VM, with every other thread of the process stopped,
    the engine's step loop among them)."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def _is_aligned(view: memoryview) -> bool:
    """Whether ``view`` starts on an ``ALIGN`` boundary (what O_DIRECT asks of a buffer)."""
    return not view.nbytes or np.frombuffer(view, np.uint8).ctypes.data % ALIGN == 0


def fresh(n: int) -> memoryview:
    """``n`` bytes of new page-aligned memory (the kernel faults its pages in as it reads)."""
    return memoryview(mmap.mmap(-1, _align(n) or ALIGN))[:n]


def _write_at(fd: int, views: list[memoryview], offset: int) -> None:
    total = sum(view.nbytes for view in views)
    if _transfer(os.pwritev, fd, views, offset, total) < total:
        raise OSError(errno.EIO, "short write")


def close_all(fds: Sequence[int | None]) -> None:
    """Close the descriptors (None entries skipped)."""
    for fd in fds:
        if fd is not None:
            with suppress(OSError):
                os.close(fd)


def inode(where: int | str | None) -> int | None:
    """The inode of a descriptor or a path (None: none given, or gone)."""
    try:
        return None if where is None else (os.fstat(where) if isinstance(where, int) else os.lstat(where)).st_ino
    except OSError:
        return None


def probe_o_direct(directory: str | os.PathLike[str], tag: str = "probe") -> bool:
    """Whether an aligned O_DIRECT write succeeds in ``directory`` (the probe file's name carries
    ``tag``: the disk tier passes its claim id, so no other process mistakes it for litter)."""
    if not O_DIRECT:
        return False
    path = os.path.join(directory, f".probe-{tag}.tmp")
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


def _spans(cut: int, piece: int) -> list[tuple[int, int]]:
    """A long read's pieces over ``[0, cut)``: ``piece`` bytes each (the last may be short), the last
    one read as up to ``TAPER`` smaller pieces of whole ``ALIGN`` blocks, so that what is left to
    hash once the last read lands is a small piece's blocks rather than a whole piece's (issue 19:
    1.4 ms after a 32 MiB read on the GPU hosts, with 2 MiB hashed last)."""
    last = (cut - 1) // piece * piece  # where the last piece starts
    small = max(ALIGN, piece // TAPER // ALIGN * ALIGN)
    return [(lo, lo + piece) for lo in range(0, last, piece)] + [(lo, min(lo + small, cut)) for lo in range(last, cut, small)]


class ObjectFiles:
    """Aligned chunk objects of one namespace: ``write`` one to a path, ``read`` one back verified."""

    def __init__(self, namespace: bytes, o_direct: bool, fsync: bool, where: object, *,
                 read_piece: int | None = None, read_depth: int | None = None) -> None:
        """``where`` names the directory in log lines. ``read_piece`` (bytes) and ``read_depth``:
        this object's long reads (None: ``READ_PIECE`` and ``READ_DEPTH`` as they are at the read)."""
        self.namespace, self.o_direct, self.fsync, self.where = namespace, o_direct, fsync, where
        if read_piece is not None and (read_piece < ALIGN or read_piece % ALIGN):
            raise ValueError(f"read_piece={read_piece}: a positive multiple of {ALIGN} bytes (O_DIRECT offsets)")
        if read_depth is not None and read_depth < 1:
            raise ValueError(f"read_depth={read_depth}: at least 1 piece in flight")
        self.read_piece, self.read_depth = read_piece, read_depth
        self._local = threading.local()  # per-thread aligned buffers for O_DIRECT
        self._lock = threading.Lock()
        self._pools: dict[str, ThreadPoolExecutor] = {}  # by kind: see ``_pool``
        self._calls = 0  # reads and writes in progress: ``close`` waits for them
        self._quiet = threading.Condition(self._lock)

    @contextmanager
    def _busy(self) -> Iterator[None]:
        """A read or write in progress: it may hand work to the pools until it returns."""
        with self._lock:
            self._calls += 1
        try:
            yield
        finally:
            with self._lock:
                self._calls -= 1
                if not self._calls:
                    self._quiet.notify_all()

    def close(self) -> None:
        """Stop the pools' threads once the calls in progress have returned (a long read hands its
        later pieces to the readers as earlier ones land: shut under it, the pool would refuse
        them); drop this thread's buffers. A later call starts new pools."""
        with self._lock:
            self._quiet.wait_for(lambda: not self._calls)
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=True)
        for name in ("blocks", "bounce"):
            with suppress(AttributeError):
                delattr(self._local, name)

    def _pool(self, kind: str) -> ThreadPoolExecutor:
        """This object's threads of one kind, started on first use: ``write`` (a long write's
        header checksum), ``read`` (each long read's readers: four reads at once, as many as a
        promotion's default ``promote_streams``; a fifth read's readers start as one ends),
        ``verify`` (their checksum blocks).
        Kept apart so that no kind queues behind another's work: a piece's read behind hashing,
        a read's blocks behind a write's whole-payload checksum (a promotion waits for those)."""
        with self._lock:
            pool = self._pools.get(kind)
            if pool is None:
                workers = 4 * (self.read_depth or READ_DEPTH) if kind == "read" else 4
                pool = self._pools[kind] = ThreadPoolExecutor(workers, thread_name_prefix=f"kvdepot-disk-{kind}")
            return pool

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

    # ---- writes ------------------------------------------------------------------------------
    def write(self, tmp: str, key: ChunkKey, data: memoryview) -> None:
        """Write ``key``'s object to the new file ``tmp`` (fsynced when asked); OSError on failure,
        with ``tmp`` removed. O_DIRECT refused by the filesystem falls back to buffered I/O."""
        with self._busy():
            self._write(tmp, key, data)

    def _write(self, tmp: str, key: ChunkKey, data: memoryview) -> None:
        try:
            try:
                self._write_file(tmp, key, data, self.o_direct)
            except OSError as exc:
                if not (self.o_direct and exc.errno == errno.EINVAL):
                    raise
                logger.warning("disk tier %s: O_DIRECT write refused; using buffered I/O", self.where)
                self.o_direct = False
                with suppress(FileNotFoundError):
                    os.unlink(tmp)
                self._write_file(tmp, key, data, False)
        except OSError:
            with suppress(OSError):
                os.unlink(tmp)
            raise

    def _write_file(self, tmp: str, key: ChunkKey, data: memoryview, direct: bool) -> None:
        """Header block and payload; a long payload is written first, at ``OFFSET``, while a helper
        computes the header (the one checksum pass), which follows at 0."""
        n, blocks, header = data.nbytes, self._blocks(), None
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | (O_DIRECT if direct else 0)
        fd = os.open(tmp, flags, 0o600)
        try:
            if n > OVERLAP:
                header = self._pool("write").submit(codec.encode_header, self.namespace, key, data, True)
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
                _copy(buf[:n], data)
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

    # ---- reads -------------------------------------------------------------------------------
    def _header(self, head: memoryview, key: ChunkKey, n: int) -> codec.Header | None:
        """``key``'s header in this namespace and the disk layout, for an ``n``-byte payload; else None."""
        header = codec.read_header(head, self.namespace, key)
        return header if header is not None and header.offset == OFFSET and header.length == n else None

    def _read_pieces(self, fd: int, key: ChunkKey, dst: memoryview, direct: bool) -> tuple[memoryview | None, str | None]:
        """``read`` of a long payload into ``dst`` in pieces (``_spans``), ``READ_DEPTH`` of them in
        flight: that many reader threads each take the next piece the moment their last one lands,
        so the disk's queue never waits for this thread to wake and hand out work. As pieces land,
        in order, the checksum blocks each completes are hashed on helpers
        (``codec.block_digests``), several at once, so only the last small piece's blocks are left
        to hash after the read. The header block comes with the first piece and is checked when
        it lands. Readers write into ``dst``: whatever the verdict, none is left running when
        this returns."""
        n, blocks = dst.nbytes, self._blocks()
        head, tail = blocks[:ALIGN], blocks[ALIGN:]
        cut = n - n % ALIGN if direct else n  # O_DIRECT reads the last partial block into ``tail``
        spans = _spans(cut, self.read_piece or READ_PIECE)
        depth, helpers = self.read_depth or READ_DEPTH, self._pool("verify")
        landed: list[Future[bool]] = [Future() for _ in spans]  # each piece whole (False: the file shrank)
        claims, claiming, stop = iter(range(len(spans))), threading.Lock(), threading.Event()

        def reader() -> None:
            while not stop.is_set():
                with claiming:
                    i = next(claims, None)
                if i is None:
                    return
                lo, hi = spans[i]
                parts, at = ([head, dst[lo:hi]], 0) if i == 0 else ([dst[lo:hi]], OFFSET + lo)  # the header with piece 0
                want = sum(part.nbytes for part in parts)
                try:
                    landed[i].set_result(_transfer(os.preadv, fd, parts, at, want) == want)
                except BaseException as exc:
                    landed[i].set_exception(exc)
                    return

        readers = [self._pool("read").submit(reader) for _ in range(min(depth, len(spans)))]
        digests: list[Future[bytes]] = []
        hashed, header = 0, None  # bytes of ``dst`` handed to the helpers (whole checksum blocks)

        def hash_through(end: int) -> None:
            nonlocal hashed
            if end > hashed:
                digests.append(helpers.submit(codec.block_digests, dst[hashed:end]))
                hashed = end

        try:
            for i, (_, hi) in enumerate(spans):
                if not landed[i].result():
                    return None, CORRUPT  # shrunk while we read
                if header is None:
                    header = self._header(head, key, n)
                    if header is None:
                        return None, CORRUPT
                hash_through(hi - hi % codec.HASH_BLOCK)
            if cut < n:
                if _transfer(os.preadv, fd, [tail], OFFSET + cut, n - cut) < n - cut:
                    return None, CORRUPT
                dst[cut:] = tail[: n - cut]
            hash_through(n)
        finally:
            stop.set()  # readers take no further piece
            wait(readers)  # none may still write into ``dst``
            wait(digests)  # nor hash it: the caller may reuse it at once
        assert header is not None  # the first piece's header was checked, or we returned
        valid = codec.verify_digests(header, b"".join(d.result() for d in digests), n)
        return (dst, None) if valid else (None, CORRUPT)

    def open(self, path: str) -> int | None:
        """A descriptor of the object at ``path`` for a later ``read(fd=...)``, or None (absent,
        unreadable): an object unlinked meanwhile (evicted, replaced) stays readable through it."""
        try:
            return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | (O_DIRECT if self.o_direct else 0))
        except OSError:
            return None

    def read(self, path: str, key: ChunkKey, out: memoryview | None, fd: int | None = None) -> tuple[memoryview | None, str | None]:
        """(payload in ``out``, or in fresh memory when ``out`` is None; None) when valid, else
        (None, ``CORRUPT`` | ``GONE`` | ``ERROR``: unreadable). ValueError if a valid object does
        not fit in ``out``. ``fd``: the object as ``open`` found it (read instead of ``path``, and
        closed here)."""
        with self._busy():
            return self._read(path, key, out, fd)

    def _read(self, path: str, key: ChunkKey, out: memoryview | None, fd: int | None) -> tuple[memoryview | None, str | None]:
        direct = self.o_direct
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | (O_DIRECT if direct else 0))
            except FileNotFoundError:
                return None, GONE
            except OSError as exc:
                logger.warning("disk tier %s: cannot open %s (%s)", self.where, key.hex(), exc)
                return None, ERROR
        try:
            size = os.fstat(fd).st_size
            n = size - OFFSET
            if n < 0:
                return None, CORRUPT
            blocks = self._blocks()
            head, tail = blocks[:ALIGN], blocks[ALIGN:]
            if out is None:
                out = fresh(n)
            elif out.nbytes < n:
                got = _transfer(os.preadv, fd, [head], 0, ALIGN)
                header = codec.read_header(head[:got], self.namespace, key)
                if header is not None and header.length == n:
                    raise ValueError(f"chunk {key.hex()} has {n} bytes; the buffer holds {out.nbytes}")
                return None, CORRUPT
            dst, cut = out[:n], n - n % ALIGN
            if direct and not _is_aligned(dst):  # NOTE: one copy out of an aligned buffer
                bounce = self._bounce(size)
                if _transfer(os.preadv, fd, [bounce[: _align(size)]], 0, size) < size:
                    return None, CORRUPT
                head = bounce[:ALIGN]
                _copy(dst, bounce[OFFSET:size])
            elif n > (self.read_piece or READ_PIECE):
                return self._read_pieces(fd, key, dst, direct)
            else:
                parts = [head, dst[:cut], tail] if direct and cut < n else [head, dst]
                if _transfer(os.preadv, fd, parts, 0, size) < size:
                    return None, CORRUPT  # shrunk while we read
                if direct and cut < n:
                    dst[cut:] = tail[: n - cut]
            header = self._header(head, key, n)
            if header is None or not codec.verify(header, dst):
                return None, CORRUPT
            return dst, None
        except OSError as exc:
            logger.warning("disk tier %s: cannot read %s (%s)", self.where, key.hex(), exc)
            return None, ERROR
        finally:
            os.close(fd)
