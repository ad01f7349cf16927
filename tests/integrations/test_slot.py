"""``EngineSlot``: the process's one engine per integration, in either mode (fake engines here;
the connectors' use of it is the adapter tests')."""

from __future__ import annotations

from kvdepot.integrations.slot import EngineSlot


class FakeEngine:
    """What the slot reads of an engine: whether it is ready, and close()."""

    def __init__(self, name: str, ready: bool = True) -> None:
        self.name, self.ready, self.closed = name, ready, 0

    def close(self) -> None:
        self.closed += 1


def test_first_attach_creates_and_a_kept_engine_serves_later_registrations() -> None:
    slot: EngineSlot = EngineSlot()
    a = FakeEngine("a")
    assert slot.attach(lambda: a, lambda old: True) == (a, True)
    kept = []
    assert slot.attach(lambda: FakeEngine("b"), lambda old: kept.append(old) or True) == (a, False)
    assert kept == [a] and a.closed == 0 and slot.current() is a


def test_an_engine_that_cannot_serve_the_new_memory_is_closed_and_replaced() -> None:
    slot: EngineSlot = EngineSlot()
    a, b = FakeEngine("a"), FakeEngine("b")
    slot.attach(lambda: a, lambda old: True)
    assert slot.attach(lambda: b, lambda old: False) == (b, True)
    assert a.closed == 1 and slot.current() is b


def test_current_answers_only_a_ready_engine_and_never_creates_one() -> None:
    slot: EngineSlot = EngineSlot()
    assert slot.current() is None
    remote = FakeEngine("remote", ready=False)  # registered, server not answering yet
    slot.attach(lambda: remote, lambda old: True)
    assert slot.current() is None
    remote.ready = True
    assert slot.current() is remote


def test_destroy_closes_once_and_is_safe_when_empty() -> None:
    slot: EngineSlot = EngineSlot()
    slot.destroy()
    a = FakeEngine("a")
    slot.attach(lambda: a, lambda old: True)
    slot.destroy()
    slot.destroy()
    assert a.closed == 1 and slot.current() is None
