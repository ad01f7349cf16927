"""``kvdepot.storage.budget.HostBudget``: fair shares by weight, starving arenas served first,
reclaim asked of the arenas above their share, callbacks outside the lock. Scripted, with fake
arenas (plain names and recording callbacks)."""

from __future__ import annotations

from kvdepot.storage.budget import HostBudget

UNIT = 10


class Donor:
    """An arena's reclaim callback: gives back whole segments of ``segment`` bytes, at most ``can``."""

    def __init__(self, budget: HostBudget, name: str, segment: int, can: int) -> None:
        self.budget, self.name, self.segment, self.can = budget, name, segment, can
        self.asked: list[int] = []

    def __call__(self, nbytes: int) -> int:
        self.asked.append(nbytes)
        given = 0
        while given < nbytes and given + self.segment <= self.can:
            given += self.segment
        self.can -= given
        if given:
            self.budget.give(self.name, given)
        return given


def test_shares_follow_the_weights_and_never_exceed_an_arena_s_capacity():
    budget = HostBudget(1000)
    budget.join("one", 1000)  # a one-copy group's single shard: the whole capacity
    assert budget.share("one") == 1000
    budget.join("r0", 500)  # a per-rank group's shards split the capacity
    budget.join("r1", 500)
    assert [budget.share(a) for a in ("one", "r0", "r1")] == [500, 250, 250]  # an equal part per group
    budget.join("small", 10)
    assert budget.share("small") == 10 * 1000 // 2010
    budget.leave("one")
    assert budget.share("r0") == 500 * 1000 // 1010


def test_below_its_share_an_arena_takes_from_what_is_free_in_whole_units():
    budget = HostBudget(100)
    budget.join("a", 100)
    budget.join("b", 100)
    assert budget.take("a", 95, UNIT) == 90  # alone nobody starves: beyond its share of 50 too
    assert budget.take("b", 50, UNIT) == 10  # all that is left; b is left short: it starves
    assert budget.used == 100 and budget.held("a") == 90 and budget.held("b") == 10


def test_while_one_starves_the_others_take_nothing_beyond_their_share():
    budget = HostBudget(100)
    for arena in ("a", "b"):
        budget.join(arena, 100)
    assert budget.take("a", 40, UNIT) == 40
    assert budget.take("b", 80, UNIT) == 60  # short of its 80, but past its share of 50: not starving
    budget.give("b", 30)
    assert budget.take("a", 30, UNIT) == 30  # a's share has room: 10 of it, plus 20 nobody needs
    budget.join("c", 100)  # shares 33 each: a holds 70, b 30, c nothing
    assert budget.take("c", 40, UNIT) == 0  # nothing free: c starves
    budget.give("a", 20)
    assert budget.take("b", 20, UNIT) == 0  # b is 3 short of its share, less than a unit: the rest is c's
    assert budget.take("c", 40, UNIT) == 20


def test_reclaim_asks_the_arenas_above_their_share_for_what_the_starving_one_lacks():
    budget = HostBudget(100)
    woken: list[str] = []
    budget.join("a", 100)
    assert budget.take("a", 100, UNIT) == 100  # alone: all of it
    donor = Donor(budget, "a", 20, can=100)
    budget.join("a", 100, reclaim=donor)
    budget.join("b", 100, wake=lambda: woken.append("b"))
    assert budget.reclaim_for("b") == 0  # b has not asked yet: not starving
    assert budget.take("b", 50, UNIT) == 0
    assert budget.reclaim_for("b") == 60  # three segments of 20 for the 50 b lacks
    assert donor.asked == [50] and woken  # the freed bytes woke b
    assert budget.take("b", 50, UNIT) == 50
    assert budget.reclaim_for("b") == 0  # at its share: nothing more asked
    assert donor.asked == [50]


def test_a_busy_or_empty_donor_gives_nothing_and_the_asker_keeps_starving():
    budget = HostBudget(100)
    budget.join("a", 100, reclaim=lambda n: 0)  # its lock was busy
    budget.take("a", 100, UNIT)
    budget.join("b", 100)
    assert budget.take("b", 10, UNIT) == 0 and budget.reclaim_for("b") == 0
    assert budget.take("b", 10, UNIT) == 0  # asks again later


def test_leaving_frees_what_an_arena_held_and_wakes_the_others():
    budget = HostBudget(100)
    woken: list[str] = []
    budget.join("a", 100)
    budget.join("b", 100, wake=lambda: woken.append("b"))
    budget.take("a", 50, UNIT)
    budget.leave("a")
    assert budget.used == 0 and woken == ["b"] and budget.share("b") == 100
    budget.leave("a")  # idempotent
