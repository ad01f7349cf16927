"""The KV-event seam: what the tiers tell a publisher, and nothing else.

Primitives of an ``EventSink`` (keys are ``ChunkKey``s; every call must return at once and never
call back into a tier: tiers call it under their own locks):

    describe(keys, tokens, space)   the chunks ``keys[i]`` hold ``tokens[i*C:(i+1)*C]``; called
                                    at the edge, where tokens become keys (``CacheEngine.chunk_keys``,
                                    a server LOOKUP that carries tokens). A chunk never described is
                                    never announced: its token ids are what a router needs.
    stored(medium, keys)            each chunk is now held (readable) in ``medium``
    removed(medium, keys)           each chunk has left ``medium`` (evicted, deleted, found gone)
    cleared()                       forget everything announced so far

``stored``/``removed`` may repeat or name chunks that were never described or never stored: a
sink filters them, so a tier reports what it sees without keeping any state for the sink.
``NULL_SINK`` is the default everywhere: with events off nothing else changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from kvdepot.keys import ChunkKey


class Medium(Enum):
    """Where a chunk is held, as kvdepot's tiers name it; ``wire`` gives vLLM's spelling."""

    HOST = "host"
    DISK = "disk"
    REDIS = "redis"

    @property
    def wire(self) -> tuple[str, str, str | None]:
        """(medium, locality, ownership) of vLLM's ``BlockStored``/``BlockRemoved``: host memory
        is "CPU"; disk and Redis are both "STORAGE", told apart by locality (the disk is this
        node's, Redis is shared) and ownership (the secondary tier's name)."""
        return _WIRE[self]


_WIRE: dict[Medium, tuple[str, str, str | None]] = {
    Medium.HOST: ("CPU", "LOCAL", None),
    Medium.DISK: ("STORAGE", "LOCAL", "disk"),
    Medium.REDIS: ("STORAGE", "REMOTE", "redis"),
}


@dataclass(frozen=True)
class EventSpace:
    """Everything, besides the tokens, that decides the block hashes a chunk is announced with.

    Rank- and geometry-free on purpose: a router knows the model and the salt, not kvdepot's
    namespace, and every TP rank of a prefix is announced under the same hashes.
    """

    model_id: str  # the engine's model name (``config.model_id``)
    cache_salt: str  # ``config.cache_salt``: different salts never share a prefix
    chunk_size: int  # tokens per chunk key
    tokens_per_block: int  # the engine's block size: one hash per engine block

    def __post_init__(self) -> None:
        if self.tokens_per_block <= 0 or self.chunk_size % self.tokens_per_block:
            raise ValueError(f"chunk_size={self.chunk_size} must be a multiple of tokens_per_block={self.tokens_per_block} > 0")


class EventSink(Protocol):
    """Receives what the tiers hold; see the module docstring for the contract."""

    def describe(self, keys: Sequence[ChunkKey], tokens: Sequence[int], space: EventSpace) -> None: ...

    def stored(self, medium: Medium, keys: Sequence[ChunkKey]) -> None: ...

    def removed(self, medium: Medium, keys: Sequence[ChunkKey]) -> None: ...

    def cleared(self) -> None: ...


class NullSink:
    """Events off: every call is a no-op."""

    def describe(self, keys: Sequence[ChunkKey], tokens: Sequence[int], space: EventSpace) -> None:
        pass

    def stored(self, medium: Medium, keys: Sequence[ChunkKey]) -> None:
        pass

    def removed(self, medium: Medium, keys: Sequence[ChunkKey]) -> None:
        pass

    def cleared(self) -> None:
        pass


NULL_SINK: EventSink = NullSink()
