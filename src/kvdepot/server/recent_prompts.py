"""The tokens of a client's recent prompts, for a server that publishes KV events.

The core calls are keys-only; a KV event names a chunk's tokens. When the server asks for tokens
(``RegisterReply.wants_tokens``), ``RemoteEngine`` remembers each described prompt's tokens by its
last chunk key, so a later LOOKUP by keys can carry them (docs/events.md). Bounded: the oldest
prompts are forgotten first, and a forgotten prompt is simply not announced.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvdepot.keys import ChunkKey

RECENT_PROMPTS = 1024  # prompts whose tokens a KV-event server may still be sent


class RecentPrompts:
    """Tokens by last chunk key, the ``limit`` most recently described; thread-safe."""

    def __init__(self, limit: int = RECENT_PROMPTS) -> None:
        self._limit = limit
        self._tokens: OrderedDict[ChunkKey, Sequence[int]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, keys: Sequence[ChunkKey], tokens: Sequence[int]) -> None:
        if not keys:
            return
        with self._lock:
            self._tokens[keys[-1]] = tokens
            self._tokens.move_to_end(keys[-1])
            if len(self._tokens) > self._limit:
                self._tokens.popitem(last=False)

    def tokens_for(self, keys: Sequence[ChunkKey], chunk_size: int) -> list[int]:
        """The tokens of ``keys``' chunks if their prompt was described; else nothing."""
        if not keys:
            return []
        with self._lock:
            tokens = self._tokens.get(keys[-1])
        return [] if tokens is None else list(tokens[: len(keys) * chunk_size])
