"""``Rate``: units per second from samples, recent ones weighing more, large ones more than small."""

from __future__ import annotations

import pytest

from kvdepot.storage.rate import Rate


def test_rate_is_a_recent_weighted_ratio() -> None:
    rate = Rate(keep=0.5)
    assert rate.per_second is None
    rate.add(0, 1.0)  # nothing moved: no information
    rate.add(100, 0.0)  # a clock that did not advance: none either
    assert rate.per_second is None
    rate.add(100, 1.0)
    assert rate.per_second == 100
    rate.add(300, 1.0)  # (0.5 * 100 + 300) / (0.5 * 1 + 1)
    assert rate.per_second == pytest.approx(350 / 1.5)
    with pytest.raises(ValueError):
        Rate(keep=1.0)
