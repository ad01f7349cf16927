"""REGISTER and the model groups it creates: checks, one host budget for all groups, freeing.

    Registry(config, allow_shm).register(session, msg, drain_s) -> RegisterReply
    Registry.leave(reg)      a session's registration ended (END_SESSION, reaped, re-registered)
    Registry.groups() / close()

Budget: ``host_capacity_gb`` is the server's, not each model's. Every shard's host arena takes
its segments from one ``HostBudget`` (``storage/budget.py``), so however many model ids (or cache
salts) register, the host memory of all of them together stays within it. Each group is entitled
to an equal share, split among its shards, whatever order they register in: an arena above its
share gives whole segments back to one starving below its own (a CUDA arena is pinned ahead, so
the first group would otherwise hold it all), and one at its share evicts its own coldest chunks,
as a full arena does.

Freeing: a group whose last session has gone is *idle*. Its chunks stay (an engine that restarts
finds its cache, the reason the server outlives engines) until another model's first REGISTER:
then every idle group is freed — its engines closed, its memory back in the budget — before the
new group is made. A REGISTER that fails leaves no group behind.
"""

from __future__ import annotations

import logging
import threading

import torch

from kvdepot.config import DepotConfig
from kvdepot.errors import LayoutError
from kvdepot.events.publisher import KVEventPublisher
from kvdepot.layout import PoolLayout
from kvdepot.server import protocol as p
from kvdepot.server.ipc import MAX_LAYER_EVENTS, IpcError, device_by_uuid, open_pool, torch_dtype
from kvdepot.server.protocol import ErrorCode, ProtocolError
from kvdepot.server.session import Registration, Session
from kvdepot.server.shard import Group
from kvdepot.storage.budget import HostBudget

logger = logging.getLogger("kvdepot")

_LIMITS = {"tp_size": 4096, "num_blocks": 1 << 31, "num_layers": 4096, "block_elems": 1 << 31,
           "tokens_per_block": 1 << 20, "bytes_per_block": 1 << 36}


class Registry:
    """The server's model groups, keyed by (model id, cache salt), and who is registered where."""

    def __init__(self, config: DepotConfig, *, allow_shm: bool, events: KVEventPublisher | None = None) -> None:
        self.config, self.allow_shm, self.events = config, allow_shm, events
        self.budget = HostBudget(int(config.host_capacity_gb * 1e9))
        self._lock = threading.Lock()  # the tables below; never held across engine calls
        self._groups: dict[tuple[str, str], Group] = {}
        self._members: dict[Group, int] = {}  # sessions registered (or registering) per group
        self._used: set[Group] = set()  # groups with a successful REGISTER

    def groups(self) -> list[Group]:
        with self._lock:
            return list(self._groups.values())

    def register(self, session: Session, msg: p.Register, drain_s: float) -> p.RegisterReply:
        layout, dtype = self._check(msg)
        group = self._join(msg, layout)
        try:
            shard = group.shard(msg.tp_rank, layout, _cuda_index(msg.pool))
            shape = (layout.num_blocks, layout.num_layers, layout.kv_factor, layout.block_elems)
            pool = open_pool(msg.pool, shape, dtype, allow_shm=self.allow_shm)
            old = session.install(Registration(group, shard, layout, pool), drain_s)
        except BaseException:
            self.leave_group(group)
            raise
        with self._lock:
            self._used.add(group)
        if old is not None:
            self.leave(old)
        logger.info("kvdepot server: %s registered rank %d/%d of %s (%s pool, %d blocks of %d B)", session,
                    msg.tp_rank, msg.tp_size, group.name, pool.kind, layout.num_blocks, layout.bytes_per_block)
        host_blocks = shard.engine.host.num_slots * layout.blocks_per_chunk
        disk_blocks = int(group.config.disk_capacity_gb * 1e9) // layout.bytes_per_block if group.config.disk_path else 0
        return p.RegisterReply(self.config.chunk_size, self.config.hash_algo, host_blocks, disk_blocks,
                               group.hasher.seed, group.name, self.events is not None)

    def _check(self, msg: p.Register) -> tuple[PoolLayout, torch.dtype]:
        for name, limit in _LIMITS.items():
            if not 0 < getattr(msg, name) <= limit:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"REGISTER: {name}={getattr(msg, name)} not in 1..{limit}")
        if not 0 <= msg.tp_rank < msg.tp_size or len(msg.model_id) > 1024 or len(msg.cache_salt) > 1024:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"REGISTER: tp_rank {msg.tp_rank} / tp_size {msg.tp_size} or ids invalid")
        try:
            dtype = torch_dtype(msg.dtype)
        except IpcError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"REGISTER: {exc}") from None
        try:
            layout = PoolLayout(msg.num_blocks, msg.num_layers, msg.kv_factor, msg.block_elems, dtype,
                                msg.tokens_per_block, self.config.chunk_size)
        except LayoutError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"REGISTER: {exc} (the server's chunk_size is "
                                f"{self.config.chunk_size}; start it with --chunk-size to change it)") from None
        if layout.bytes_per_block != msg.bytes_per_block:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"REGISTER: bytes_per_block {msg.bytes_per_block} != "
                                f"{layout.bytes_per_block} computed from the geometry")
        layer_events = len(msg.pool.layer_events) if isinstance(msg.pool, p.CudaIpcPool) else 0
        if layer_events not in (0, layout.num_layers) or layer_events > MAX_LAYER_EVENTS:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"REGISTER: {layer_events} layer events for {layout.num_layers} "
                                f"layers (none, or one per layer up to {MAX_LAYER_EVENTS})")
        return layout, dtype

    def _join(self, msg: p.Register, layout: PoolLayout) -> Group:
        """The model's group with one more member (made, after freeing the idle ones, if new)."""
        key = (msg.model_id, msg.cache_salt)
        with self._lock:
            group = self._groups.get(key)
            idle = [] if group is not None else [g for g, n in self._members.items() if n == 0]
            for old in idle:
                self._forget(old)
            if group is None:  # cheap: a group makes its engines at its ranks' first REGISTER
                group = self._groups[key] = Group(msg, layout, self.config, self.budget, self.events)
            self._members[group] = self._members.get(group, 0) + 1
        for old in idle:
            self._free(old)
        try:
            group.check(msg, layout)
        except BaseException:
            self.leave_group(group)
            raise
        return group

    def leave(self, reg: Registration) -> None:
        """``reg``'s session no longer uses its group (the pool is unmapped already)."""
        self.leave_group(reg.group)

    def leave_group(self, group: Group) -> None:
        with self._lock:
            left = self._members.get(group, 0) - 1
            self._members[group] = max(0, left)
            orphan = left <= 0 and group not in self._used  # no REGISTER of it ever succeeded
            if orphan:
                self._forget(group)
        if orphan:
            self._free(group)

    def _forget(self, group: Group) -> None:  # under self._lock
        self._members.pop(group, None)
        self._used.discard(group)
        if self._groups.get((group.model_id, group.cache_salt)) is group:
            del self._groups[(group.model_id, group.cache_salt)]

    def _free(self, group: Group) -> None:
        logger.info("kvdepot server: freeing idle model group %s (no session left)", group.name)
        group.close()

    def close(self) -> None:
        with self._lock:
            groups = list(self._groups.values())
            self._groups.clear()
            self._members.clear()
            self._used.clear()
        for group in groups:
            group.close()


def _cuda_index(desc: p.PoolDesc) -> int | None:
    """The local index of a CUDA pool's GPU, or None (not CUDA, or not visible here)."""
    if not isinstance(desc, p.CudaIpcPool) or not torch.cuda.is_available():
        return None
    try:
        return device_by_uuid(desc.device_uuid)
    except IpcError:
        return None
