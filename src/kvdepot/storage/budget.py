"""``Budget`` and ``HostBudget``: host memory several arenas share, each entitled to a fair share of it.

    join(arena, weight, reclaim=None, wake=None)   idempotent; a later call sets the callbacks
    leave(arena)                                   gives back what the arena still holds
    share(arena) -> int       its fair share now: ``total * weight / sum of weights`` (at most ``weight``)
    take(arena, want, unit) -> int    up to ``want`` bytes in whole units; 0 when none may be had
    give(arena, nbytes)
    reclaim_for(arena) -> int         arenas above their share give back whole segments for it

Why shares: the kvdepot server has one host budget for every model group it serves. A pinned
(CUDA) arena is allocated ahead of use on a helper thread (``storage/pinner.py``), so the first
group to register would otherwise take the whole budget before a second one stored anything, and
the second would never store. Weights are arena capacities: a group's shards split the server's
capacity among themselves (``server/shard.py``), so every group gets an equal part, divided among
its ranks' shards. Registering late does not matter:

* An arena *below* its share may take up to it from whatever is free.
* An arena at or above its share takes only memory no starving arena needs (growth on demand).
* An arena is *starving* when a take left it short of what it asked while another whole unit
  (slot) fits in its share; then ``reclaim_for`` asks the arenas above their share, most above
  first, to give back what it lacks in whole segments (evicting the chunks in them); a giver
  never ends a whole segment below its own share, so it does not starve in turn for want of it
  (no ping-pong). ``give`` wakes the starving arenas to take it.

Shares are met to within a segment (``HostTier`` cuts segments to 1/16 of the budget at most).
Callbacks run outside the budget's lock. ``reclaim`` must never block (it only *tries* its
arena's owner lock), so no lock order between arenas exists: an arena may reclaim while its own
owner lock is held. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol


class Budget(Protocol):
    """What an arena (``HostTier``) needs of the memory it shares: the primitives above."""

    total: int

    def join(self, arena: Hashable, weight: int, reclaim: Callable[[int], int] | None = None,
             wake: Callable[[], None] | None = None) -> None: ...

    def leave(self, arena: Hashable) -> None: ...

    def share(self, arena: Hashable) -> int: ...

    def held(self, arena: Hashable) -> int: ...

    def take(self, arena: Hashable, want: int, unit: int) -> int:
        """Up to ``want`` bytes in whole ``unit``s; 0 when not one unit may be had."""
        ...

    def give(self, arena: Hashable, nbytes: int) -> None: ...

    def reclaim_for(self, arena: Hashable) -> int:
        """Ask arenas above their share to give back for ``arena``; the bytes given back."""
        ...


@dataclass
class _Member:
    weight: int
    held: int = 0
    unit: int = 1  # of its last take (a slot)
    starving: bool = False
    reclaim: Callable[[int], int] | None = None  # give back >= n bytes (whole segments) if it can; returns bytes given
    wake: Callable[[], None] | None = None  # memory came free (the arena may grow now)


class HostBudget:
    """Bytes of host memory shared fairly by several arenas (``Budget``)."""

    def __init__(self, total_bytes: int) -> None:
        self.total = total_bytes
        self.used = 0
        self._members: dict[Hashable, _Member] = {}
        self._lock = threading.Lock()

    # ---- membership ----------------------------------------------------------------------------
    def join(self, arena: Hashable, weight: int, reclaim: Callable[[int], int] | None = None,
             wake: Callable[[], None] | None = None) -> None:
        with self._lock:
            member = self._members.setdefault(arena, _Member(weight))
            member.weight = weight
            member.reclaim = reclaim or member.reclaim
            member.wake = wake or member.wake

    def leave(self, arena: Hashable) -> None:
        """``arena`` is closed: what it holds is free again, and every other arena's share grew."""
        with self._lock:
            member = self._members.pop(arena, None)
            if member is not None:
                self.used -= member.held
            wakes = [m.wake for m in self._members.values() if m.wake is not None]
        for wake in wakes:
            wake()

    # ---- shares --------------------------------------------------------------------------------
    def share(self, arena: Hashable) -> int:
        """0 for an arena that has left (a reclaim may reach one that is closing)."""
        with self._lock:
            member = self._members.get(arena)
            return self._share(member) if member is not None else 0

    def held(self, arena: Hashable) -> int:
        with self._lock:
            member = self._members.get(arena)
            return member.held if member is not None else 0

    def _share(self, member: _Member) -> int:
        weights = sum(m.weight for m in self._members.values())
        return min(member.weight, self.total * member.weight // weights) if weights else 0

    def take(self, arena: Hashable, want: int, unit: int) -> int:
        """Up to ``want`` bytes in whole ``unit``s: up to its share from what is free, beyond it
        only what no starving arena needs. An arena left short with a unit's room in its share starves."""
        with self._lock:
            member = self._members[arena]
            free = self.total - self.used
            owed = sum(max(0, self._share(m) - m.held) for m in self._members.values() if m.starving and m is not member)
            room = max(0, self._share(member) - member.held) + max(0, free - owed)
            granted = max(0, min(want, free, room)) // unit * unit
            self.used += granted
            member.held += granted
            member.unit = unit
            member.starving = granted < want and member.held + unit <= self._share(member)
            return granted

    def give(self, arena: Hashable, nbytes: int) -> None:
        """``arena`` freed ``nbytes``; starving arenas are woken to take them."""
        with self._lock:
            member = self._members.get(arena)
            if member is not None:
                member.held -= nbytes
                self.used -= nbytes
            wakes = [m.wake for m in self._members.values() if m.starving and m is not member and m.wake is not None]
        for wake in wakes:
            wake()

    def reclaim_for(self, arena: Hashable) -> int:
        """Ask the arenas above their share to give back, for ``arena`` starving below its own:
        the bytes given back (a busy arena gives nothing now; ask again later)."""
        with self._lock:
            member = self._members[arena]
            need = self._share(member) - member.held
            if need <= 0 or not member.starving:
                return 0
            donors = sorted(((m.held - self._share(m), m.reclaim) for m in self._members.values()
                             if m is not member and m.reclaim is not None and m.held > self._share(m)),
                            key=lambda d: -d[0])
        given = 0
        for _excess, reclaim in donors:  # outside the lock: a donor's reclaim calls give()
            given += reclaim(need - given)
            if given >= need:
                break
        return given
