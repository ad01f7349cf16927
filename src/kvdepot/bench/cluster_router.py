"""How ``kvdepot bench cluster`` picks a node for each request.

    Policy.pick(tokens) -> node index    before the request
    Policy.settle()                      after its answer (the routed policy takes in events)

``Single`` (one node), ``RoundRobin`` (what a plain load balancer does) and ``Routed``: the
prefix-aware ``kvdepot.events.router.PrefixRouter``, which knows nothing but the KV events the
nodes publish (vLLM's wire format, over ZMQ): the node whose host memory holds the longest prefix
of the prompt wins, ties go round-robin.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

from kvdepot.events.router import EventFeed, PrefixRouter


class Policy(Protocol):
    name: str

    def pick(self, tokens: Sequence[int]) -> int: ...

    def settle(self) -> None: ...

    def close(self) -> None: ...


class Single:
    name = "single"

    def pick(self, tokens: Sequence[int]) -> int:
        return 0

    def settle(self) -> None:
        pass

    def close(self) -> None:
        pass


class RoundRobin:
    name = "round-robin"

    def __init__(self, nodes: int) -> None:
        self._turn = itertools.cycle(range(nodes))

    def pick(self, tokens: Sequence[int]) -> int:
        return next(self._turn)

    def settle(self) -> None:
        pass

    def close(self) -> None:
        pass


class Routed:
    """Routes by the nodes' KV events alone; ``endpoints``: (events, replay) per node."""

    name = "routed"

    def __init__(self, model_id: str, block_size: int, endpoints: Sequence[tuple[str, str]], quiet_ms: int = 30) -> None:
        self.router = PrefixRouter(model_id, block_size)
        self.feed = EventFeed(self.router)
        self.names = [f"node{i}" for i in range(len(endpoints))]
        for name, (events, replay) in zip(self.names, endpoints, strict=True):
            self.feed.add(name, events, replay)
        self.quiet_ms = quiet_ms
        self.batches = 0
        self._caught_up = False

    def pick(self, tokens: Sequence[int]) -> int:
        self.batches += self.feed.poll(0)
        return self.names.index(self.router.route(tokens, self.names))

    def settle(self) -> None:
        """Take in events until none arrives for ``quiet_ms`` (the node has answered, so what it
        published for the request is on its way; a late batch is only a staler hint). The first
        time, the replay endpoints also give what a PUB socket sent before the SUB had joined."""
        if not self._caught_up:
            self.feed.catch_up()
            self._caught_up = True
        while (got := self.feed.poll(self.quiet_ms)) > 0:
            self.batches += got

    @property
    def gaps(self) -> int:
        return self.feed.gaps

    def close(self) -> None:
        self.feed.close()
