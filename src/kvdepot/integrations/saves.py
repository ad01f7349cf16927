"""What every connector's worker half asks at the end of a step: which finished requests may be
reported now. A request's blocks go back to the engine once it is reported, so it must not be
while a store still reads them."""

from __future__ import annotations

from collections.abc import Hashable, MutableMapping, MutableSet, Sequence
from typing import Protocol, TypeVar

from kvdepot.engine_api import PendingStore

RequestId = TypeVar("RequestId", bound=Hashable)  # TensorRT-LLM: int; vLLM: str


class Saving(Protocol):
    """A worker's record of one request: the stores it issued."""

    @property
    def handles(self) -> Sequence[PendingStore]: ...


State = TypeVar("State", bound=Saving)


def take_saved(finishing: MutableSet[RequestId], requests: MutableMapping[RequestId, State]) -> list[RequestId]:
    """Remove from ``finishing`` and ``requests`` every request whose stores (``state.handles``)
    have all completed, or that has no state left, and return their ids."""
    done = [rid for rid in finishing if (state := requests.get(rid)) is None or all(h.done() for h in state.handles)]
    for rid in done:
        finishing.discard(rid)
        requests.pop(rid, None)
    return done
