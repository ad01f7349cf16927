"""The workload of ``kvdepot bench cluster``: multi-turn chat sessions over shared prefixes.

    Shape(...)                          how many system prompts, documents, sessions, turns
    requests(shape, vocab, seed)        every request in arrival order, deterministic in the seed
    Ledger(block_size)                  which prompt blocks the cluster has computed already

Each session has one of a few system prompts and, most of them, one of a few documents (what
agents and RAG chats share across users); turn t's prompt is the session's whole history: the
system prompt, the document, every earlier user message and reply, then the new user message.
Replies are seeded tokens, not the model's output, so the prompts do not depend on the weights
and every configuration of the bench sees exactly the same requests. Turns arrive in rounds (all
sessions' turn 0 in a shuffled order, then all turns 1, ...), so a session's next turn comes after
other sessions' requests, as it would from people typing.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvdepot.events.hashes import BlockHasher


@dataclass(frozen=True)
class Shape:
    systems: int = 3  # shared system prompts
    system_tokens: int = 512
    documents: int = 4  # shared documents; a session has one with probability doc_share
    document_tokens: int = 1024
    doc_share: float = 0.75
    sessions: int = 12
    turns: int = 3
    user_tokens: int = 64  # each new user message
    reply_tokens: int = 64  # each earlier reply kept in the history


@dataclass(frozen=True)
class Request:
    session: int
    turn: int
    tokens: tuple[int, ...]


def requests(shape: Shape, vocab: int, seed: int) -> list[Request]:
    """Every request of the run, in arrival order."""
    rng = random.Random(seed)

    def text(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab) for _ in range(n))

    systems = [text(shape.system_tokens) for _ in range(shape.systems)]
    documents = [text(shape.document_tokens) for _ in range(shape.documents)]
    history: list[tuple[int, ...]] = []
    for s in range(shape.sessions):
        doc = documents[rng.randrange(shape.documents)] if shape.documents and rng.random() < shape.doc_share else ()
        history.append(systems[s % shape.systems] + doc)
    out: list[Request] = []
    for turn in range(shape.turns):
        order = list(range(shape.sessions))
        rng.shuffle(order)
        for s in order:
            prompt = history[s] + text(shape.user_tokens)
            out.append(Request(s, turn, prompt))
            history[s] = prompt + text(shape.reply_tokens)
    return out


class Ledger:
    """Prompt blocks some node of the cluster has computed (or loaded) before: a block computed
    again is *recomputed* — work the cluster did twice, what a shared cache is there to save."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._hasher = BlockHasher("bench-cluster-ledger")
        self._seen: set[int] = set()

    def hashes(self, tokens: Sequence[int]) -> list[int]:
        """The chained hashes of ``tokens``' full blocks (equal prefixes, equal hashes)."""
        return self._hasher.hashes(tokens, self.block_size)

    def account(self, tokens: Sequence[int], cached_tokens: int) -> int:
        """Record one served request; returns how many of its computed prompt tokens were
        recomputed (in full blocks the cluster had seen before)."""
        hashes = self.hashes(tokens)
        first_computed = cached_tokens // self.block_size
        again = sum(1 for h in hashes[first_computed:] if h in self._seen)
        self._seen.update(hashes)
        return again * self.block_size
