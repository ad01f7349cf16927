"""The disk tier: one checksummed file per chunk under ``<path>/<namespace hex>/<kk>/<key hex>``.

* **Atomic writes.** An object is written to a hidden temp file in its final directory (named
  with this tier's claim id, see ``disk_budget``), fsynced when asked, then renamed to its final
  name under the shared ledger lock: readers see a whole object or none, and two processes
  storing the same chunk publish it once.
* **Verified reads.** A file whose header or checksum does not match (flipped byte, truncation,
  another namespace's object, garbage) is a miss; it is deleted and counted in ``corrupt``.
* **Held reads.** ``hold(keys)`` opens objects when a hit is promised; ``get_into(held=fd)``
  reads them later even if they were evicted or replaced meanwhile (an unlinked file's bytes stay
  readable through an open descriptor), still verified.
* **Restart.** The index is rebuilt from file names and sizes (LRU order from mtimes, which hits
  refresh); contents are validated lazily, on the first read. Temp files whose writer is gone are
  removed; a live writer's are left alone.
* **Capacity: one budget per directory.** Bytes of committed objects plus writes in flight under
  the whole ``disk_path`` — every process and namespace sharing it — never exceed
  ``capacity_bytes`` (``disk_budget.SharedBudget``). Room is made by evicting this tier's least
  recently used objects first (``policy.LRUPolicy``), then, if they do not free enough, the
  directory's oldest files by mtime, whoever wrote them: an approximate global LRU with no shared
  index to contend on.
* **A full filesystem evicts, never freezes.** A write that meets ENOSPC/EDQUOT (the filesystem
  is smaller than the capacity, or shared with other data) evicts least recently used objects
  worth the object and retries; only when there is nothing left to evict is the write dropped.
* File I/O (O_DIRECT, aligned buffers, the one checksum pass) is ``disk_io.ObjectFiles``'s.

Thread-safe. Lock order: the ledger lock (``SharedBudget.locked``) before the index lock; file
data is never read or written under either.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

from kvdepot.events.base import NULL_SINK, EventSink, Medium
from kvdepot.keys import ChunkKey
from kvdepot.storage import codec, disk_io
from kvdepot.storage.codec import Payload
from kvdepot.storage.disk_budget import SharedBudget
from kvdepot.storage.disk_io import ALIGN, O_DIRECT, OFFSET, ObjectFiles, probe_o_direct
from kvdepot.storage.disk_scan import objects as _objects
from kvdepot.storage.disk_scan import stat_all as _stat_all
from kvdepot.storage.disk_scan import temp_owner as _temp_owner
from kvdepot.storage.policy import POLICIES
from kvdepot.storage.tier_stats import ByteTierStats

__all__ = ["ALIGN", "O_DIRECT", "OFFSET", "DiskTier", "probe_o_direct"]

logger = logging.getLogger("kvdepot")

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_SPACE_RETRIES = 4  # evict-and-retry rounds for one write on a full filesystem
class DiskTier:
    """Chunk objects of one namespace in a directory shared under one ``capacity_bytes`` budget."""

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
        read_piece: int | None = None,
        read_depth: int | None = None,
    ) -> None:
        """Args:
        path: the tier's directory (shared by namespaces: each gets its own subdirectory).
        capacity_bytes: limit on the bytes of all objects under ``path`` (every process and
            namespace using it; the smallest limit among them is the one that holds).
        namespace: the 16-byte ``Namespace.digest`` whose objects this tier serves.
        o_direct: None or True = use O_DIRECT if the probe succeeds; False = never.
        fsync: fsync each object and its directory before it counts as stored.
        events: told of every object stored and every one forgotten (evicted, deleted, corrupt).
        read_piece, read_depth: a long read's piece size (bytes) and pieces in flight (None: the
            defaults, ``disk_io.READ_PIECE`` and ``READ_DEPTH``); ``bench tiers --read-settings``
            compares settings, one tier each.
        """
        self.namespace = codec.check_namespace(namespace)
        self.base = Path(path)
        self.root = self.base / namespace.hex()
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.capacity_bytes = int(capacity_bytes)
        self.fsync = fsync
        self._budget = SharedBudget(self.base)
        direct = o_direct is not False and probe_o_direct(self.root, self._budget.claim_id)
        if o_direct and not direct:
            logger.info("disk tier %s: O_DIRECT not supported here; using buffered I/O", self.root)
        self._io = ObjectFiles(self.namespace, direct, fsync, self.root, read_piece=read_piece, read_depth=read_depth)
        self._sizes: dict[ChunkKey, int] = {}
        self._writing: set[ChunkKey] = set()
        self._policy = POLICIES[policy]()
        self._used = 0  # bytes of this namespace's objects known to this tier
        self._lock = threading.Lock()
        self._io_failing = False
        self._stats = ByteTierStats(name=self.name, capacity_bytes=self.capacity_bytes)
        self._events = events
        self._scan()

    @property
    def o_direct(self) -> bool:
        return self._io.o_direct

    # ---- index ---------------------------------------------------------------------------
    def _path(self, key: ChunkKey) -> str:
        name = key.hex()
        return os.path.join(self.root, name[:2], name)

    def _scan(self) -> None:
        """Index this namespace's files; alone in the directory, recount the ledger from them all;
        remove temp files whose writer is gone; evict down to the capacity."""
        found = [(st, ChunkKey(bytes.fromhex(os.path.basename(path))))
                 for path, st in _stat_all(self.base) if Path(path).parent.parent == self.root]
        with self._budget.locked() as budget:
            alone = budget.sweep() == 0
            if alone:
                budget.recount(sum(st.st_size for _path, st in _stat_all(self.base)))
            with self._lock:
                for st, key in sorted(found, key=lambda item: item[0].st_mtime_ns):
                    self._sizes[key] = st.st_size
                    self._used += st.st_size
                    self._policy.touch(key)
            self._make_room(budget, 0)
        for entry, temp in _objects(self.base):
            owner = _temp_owner(entry.name) if temp else None
            if temp and owner != self._budget.claim_id and (owner or alone) and not self._budget.claim_alive(owner):
                with suppress(FileNotFoundError):
                    os.unlink(entry.path)

    def _forget_locked(self, key: ChunkKey) -> None:
        self._used -= self._sizes.pop(key)
        self._policy.remove(key)
        self._events.removed(Medium.DISK, (key,))

    def _unlink(self, budget: SharedBudget, path: str) -> int:
        """Remove a committed object (under the ledger lock): the bytes it gave back."""
        try:
            size = os.lstat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return 0  # someone else removed it, and uncounted it
        budget.uncount(size)
        return size

    def _evict(self, budget: SharedBudget, need: int) -> bool:
        """Free at least ``need`` bytes (under the ledger lock): this tier's LRU objects first, then
        the directory's oldest files. Victims are all decided before any is removed; False (and
        nothing removed) if everything there is would not be enough."""
        need_at_least = need
        with self._lock:
            mine, freed = [], 0
            for key in self._policy.candidates():
                if freed >= need:
                    break
                if key not in self._writing:
                    mine.append(key)
                    freed += self._sizes[key]
        others: list[str] = []
        if freed < need:
            # NOTE: a walk of the whole directory: free a batch (1/64 of the capacity at least)
            # so that a tier living on others' objects does not walk it for every write.
            need = max(need, freed + self.capacity_bytes // 64)
            chosen = {self._path(key) for key in mine}
            rest = sorted((st.st_mtime_ns, path, st.st_size) for path, st in _stat_all(self.base) if path not in chosen)
            for _mtime, path, size in rest:
                if freed >= need:
                    break
                others.append(path)
                freed += size
            if freed < need_at_least:
                return False
        for key in mine:
            self._unlink(budget, self._path(key))
        for path in others:
            self._unlink(budget, path)
        with self._lock:
            for key in mine:
                if key in self._sizes:
                    self._forget_locked(key)
            for path in others:  # this namespace's files that another writer published
                key = ChunkKey(bytes.fromhex(os.path.basename(path)))
                if Path(path).parent.parent == self.root and key in self._sizes:
                    self._forget_locked(key)
            self._stats.evictions += len(mine) + len(others)
        return True

    def _make_room(self, budget: SharedBudget, size: int) -> bool:
        """Evict until ``size`` more bytes fit the shared budget (under the ledger lock)."""
        for _ in range(8):  # another writer may have removed some victims first: check again
            excess = budget.used() + size - self.capacity_bytes
            if excess <= 0:
                return True
            if not self._evict(budget, excess):
                return False
        return budget.used() + size <= self.capacity_bytes

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

    def get_into(self, key: ChunkKey, out: Payload, *, held: int | None = None) -> int | None:
        """Read ``key``'s verified payload into the writable buffer ``out`` (e.g. a host-arena slot;
        page-aligned lets O_DIRECT fill it in place): its length, or None on a miss (``out``'s
        contents are then undefined). A corrupt object is deleted and counted. ValueError if the
        payload is longer than ``out``. ``held``: the descriptor ``hold`` gave for ``key`` (read
        even if the object was evicted since; closed here)."""
        payload = self._get(key, memoryview(out).cast("B"), held)
        return None if payload is None else payload.nbytes

    def hold(self, keys: Sequence[ChunkKey]) -> list[int | None]:
        """Open ``keys``' objects now (None where absent), so that a read promised from them still
        finds their bytes after an eviction: an unlinked file stays readable through an open
        descriptor. Each descriptor goes to ``get_into(held=)`` or ``let_go`` exactly once."""
        with self._lock:
            paths = [self._path(key) if key in self._sizes else None for key in keys]
        return [None if path is None else self._io.open(path) for path in paths]

    let_go = staticmethod(disk_io.close_all)  # descriptors from ``hold`` that no read took

    def _get(self, key: ChunkKey, out: memoryview | None, held: int | None = None) -> memoryview | None:
        with self._lock:
            if key not in self._sizes and held is None:
                self._stats.misses += 1
                return None
            if key in self._sizes:
                self._policy.touch(key)
        path = self._path(key)
        inode = disk_io.inode(held)
        payload, fault = self._io.read(path, key, out, held)
        if payload is not None:
            with suppress(OSError):
                os.utime(path)  # recency other processes (and a restart) can see
            with self._lock:
                self._stats.hits += 1
                self._stats.bytes_read += payload.nbytes
            return payload
        with self._budget.locked() as budget, self._lock:
            self._stats.misses += 1
            self._stats.errors += fault == disk_io.ERROR
            if key in self._sizes and key not in self._writing and (inode is None or inode == disk_io.inode(path)):
                # (a held object that was replaced since says nothing of the file there now)
                if fault == disk_io.CORRUPT:
                    self._stats.corrupt += 1
                    self._unlink(budget, path)
                self._forget_locked(key)  # corrupt, vanished or unreadable: stop advertising it
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
            self._writing.add(key)
        try:
            with self._budget.locked() as budget:
                ok = size <= self.capacity_bytes and self._make_room(budget, size)
                if ok:
                    budget.reserve(size)
            if ok:
                ok = self._store(key, data, size)
        finally:
            with self._lock:
                self._writing.discard(key)
        with self._lock:
            if ok:
                self._stats.puts += 1
                self._stats.bytes_written += data.nbytes
            else:
                self._stats.dropped += 1
        return ok

    def _store(self, key: ChunkKey, data: memoryview, size: int) -> bool:
        """Write the reserved object and publish it; the reservation is settled either way."""
        path = self._path(key)
        tmp = os.path.join(os.path.dirname(path), f".{key.hex()}.{self._budget.claim_id}.tmp")
        published = False
        try:
            for attempt in range(_SPACE_RETRIES + 1):
                try:
                    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                    self._io.write(tmp, key, data)
                    break
                except OSError as exc:
                    if exc.errno not in _NO_SPACE or attempt == _SPACE_RETRIES:
                        raise
                    with self._budget.locked() as budget:
                        self._stats.no_space += 1
                        if not self._evict(budget, size):  # nothing left to evict
                            raise
            with self._budget.locked() as budget:
                if os.path.lexists(path):  # another process published this chunk meanwhile
                    budget.release(size)
                    size = os.lstat(path).st_size
                else:
                    os.replace(tmp, path)
                    budget.commit(size)
                published = True
                with self._lock:
                    if key not in self._sizes:
                        self._sizes[key] = size
                        self._used += size
                        self._events.stored(Medium.DISK, (key,))
                    self._policy.touch(key)
            if self.fsync:
                dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except OSError as exc:
            if not published:
                with self._budget.locked() as budget:
                    budget.release(size)
            with suppress(OSError):
                os.unlink(tmp)
            with self._lock:
                self._stats.errors += 1
            if not self._io_failing:  # log once per run of failures, one line
                logger.warning("disk tier %s: cannot write %s (%s); dropping writes until one succeeds",
                               self.root, key.hex(), exc)
            self._io_failing = True
            return published
        with suppress(FileNotFoundError):
            os.unlink(tmp)  # the other writer's object won
        if self._io_failing:
            logger.warning("disk tier %s: writing again", self.root)
        self._io_failing = False
        return True

    def delete(self, key: ChunkKey) -> bool:
        with self._budget.locked() as budget, self._lock:
            if key not in self._sizes:
                return False
            self._unlink(budget, self._path(key))
            self._forget_locked(key)
            return True

    def stats(self) -> ByteTierStats:
        shared = self._budget.shared_used()
        with self._lock:
            self._stats.chunks = len(self._sizes)
            self._stats.used_bytes = self._used
            self._stats.shared_used_bytes = shared
            return ByteTierStats(**vars(self._stats))

    def note_write_dropped(self) -> None:
        """The write-behind queue dropped a copy meant for this tier (counted for operators)."""
        with self._lock:
            self._stats.write_behind_dropped += 1

    def close(self) -> None:
        """Stop the checksum helpers, drop this thread's buffers, give up the claim on the
        directory (a later call takes a new one)."""
        self._io.close()
        self._budget.close()
