"""A small prefix-aware router fed only by KV events (``kvdepot bench cluster`` routes with it).

    PrefixRouter.apply(node, batch)     fold one node's ``KVEventBatch`` into its holdings
    PrefixRouter.score(node, tokens)    (blocks reachable from ``node``, blocks in its host memory)
    PrefixRouter.route(tokens, nodes)   the node with the best score; ties go round-robin
    EventFeed                           SUB sockets, one per node, gap-checked and replayed

Per node it keeps the block hashes announced for each (medium, locality, ownership). A prompt is
hashed the way the events are (``hashes.py``), so its longest held prefix is a walk from the
first block. Reachable from a node: its host memory and disk, and the shared (REMOTE) tier that
any node announced. A routing decision is a hint only: a node that has lost a block since its
event simply recomputes it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq

from kvdepot.events.hashes import BlockHasher
from kvdepot.events.wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    seq_bytes,
)

Residence = tuple[str | None, str | None, str | None]  # (medium, locality, ownership) as on the wire


@dataclass(frozen=True)
class Score:
    reachable: int  # leading blocks of the prompt held in this node's host/disk or the shared tier
    host: int  # leading blocks held in this node's host memory ("CPU")

    @property
    def key(self) -> tuple[int, int]:
        return self.reachable, self.host


class PrefixRouter:
    """Holdings per node, from events alone; scores prompts by their longest held prefix."""

    def __init__(self, model_id: str, block_size: int, cache_salt: str = "") -> None:
        self.block_size = block_size
        self._hasher = BlockHasher(model_id, cache_salt)
        self._held: dict[str, dict[Residence, set[int]]] = {}
        self._turn = itertools.count()

    def apply(self, node: str, batch: KVEventBatch) -> None:
        held = self._held.setdefault(node, {})
        for event in batch.events:
            if isinstance(event, BlockStored):
                held.setdefault((event.medium, event.locality, event.ownership), set()).update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.get((event.medium, event.locality, event.ownership), set()).difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()

    def blocks(self, node: str) -> dict[Residence, int]:
        """How many blocks ``node`` has announced per residence (tests, reports)."""
        return {where: len(hashes) for where, hashes in self._held.get(node, {}).items() if hashes}

    def score(self, node: str, tokens: Sequence[int], hashes: list[int] | None = None) -> Score:
        hashes = self._hasher.hashes(tokens, self.block_size) if hashes is None else hashes
        mine = self._held.get(node, {})
        host = set().union(*(h for (medium, _loc, _own), h in mine.items() if medium == "CPU"))
        local = set().union(*(h for (_m, locality, _own), h in mine.items() if locality != "REMOTE"))
        shared = set().union(*(h for held in self._held.values()
                               for (_m, locality, _own), h in held.items() if locality == "REMOTE"))
        return Score(_leading(hashes, local | shared), _leading(hashes, host))

    def route(self, tokens: Sequence[int], nodes: Sequence[str]) -> str:
        """The node whose score is best; among equals, the next in turn (round-robin)."""
        if not nodes:
            raise ValueError("route() needs at least one node")
        hashes = self._hasher.hashes(tokens, self.block_size)
        scores = [self.score(node, tokens, hashes).key for node in nodes]
        best = max(scores)
        tied = [node for node, s in zip(nodes, scores, strict=True) if s == best]
        return tied[next(self._turn) % len(tied)]


def _leading(hashes: list[int], held: set[int]) -> int:
    count = 0
    while count < len(hashes) and hashes[count] in held:
        count += 1
    return count


@dataclass
class _Source:
    node: str
    sub: zmq.Socket
    replay_endpoint: str | None
    next_seq: int = 0


class EventFeed:
    """Feeds a ``PrefixRouter`` from nodes' PUB sockets; a gap in a node's sequence numbers is
    filled from its replay endpoint (when it has one) before anything newer is applied."""

    def __init__(self, router: PrefixRouter, topic: str = "") -> None:
        self.router, self._topic = router, topic.encode()
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._sources: dict[zmq.Socket, _Source] = {}
        self.gaps = 0  # batches missed and not recovered by replay

    def add(self, node: str, endpoint: str, replay_endpoint: str | None = None, *, bind: bool = False) -> None:
        """Subscribe to ``node``'s events: connect to its PUB (or ``bind``, if it connects)."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.bind(endpoint) if bind else sub.connect(endpoint)
        self._sources[sub] = _Source(node, sub, replay_endpoint)
        self._poller.register(sub, zmq.POLLIN)

    def catch_up(self, timeout_ms: int = 1000) -> None:
        """Replay everything each node still buffers (a feed that starts late)."""
        for source in self._sources.values():
            if source.replay_endpoint:
                self._replay(source, source.next_seq, timeout_ms)

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply every batch that arrives within ``timeout_ms``; the number applied."""
        applied = 0
        for sock, _ in self._poller.poll(timeout_ms):
            source = self._sources[sock]
            while sock.poll(0):
                _topic, seq, payload = sock.recv_multipart()
                applied += self._take(source, int.from_bytes(seq, "big"), payload)
        return applied

    def _take(self, source: _Source, seq: int, payload: bytes) -> int:
        if seq < source.next_seq:
            return 0  # replayed already
        if seq > source.next_seq:
            if source.replay_endpoint:
                self._replay(source, source.next_seq)
            if seq > source.next_seq:
                self.gaps += seq - source.next_seq
        if seq < source.next_seq:
            return 0
        try:
            self.router.apply(source.node, decode_batch(payload))
        except msgspec.DecodeError:
            self.gaps += 1
        source.next_seq = seq + 1
        return 1

    def _replay(self, source: _Source, start: int, timeout_ms: int = 1000) -> None:
        assert source.replay_endpoint is not None
        req = self._ctx.socket(zmq.DEALER)
        try:
            req.connect(source.replay_endpoint)
            req.send_multipart((b"", seq_bytes(start)))
            while req.poll(timeout_ms):
                frames = req.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    break
                seq = int.from_bytes(frames[2], "big")
                if seq >= source.next_seq:
                    self.gaps += seq - source.next_seq  # older than the replay buffer reaches
                    self.router.apply(source.node, decode_batch(frames[3]))
                    source.next_seq = seq + 1
        finally:
            req.close(linger=0)

    def close(self) -> None:
        for sock in self._sources:
            sock.close(linger=0)
        self._sources.clear()
        self._ctx.term()
