"""Fakes shared by tests (``tests/`` is on sys.path)."""

from __future__ import annotations


class FakeClock:
    """Monotonic seconds that move only when the test says so (``advance``): lease timeouts
    expire exactly when a test decides, never by the machine's load."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
