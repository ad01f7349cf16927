"""``kvdepot bench soak`` in miniature: 2 clients, a few seconds, every kind of fault once."""

from __future__ import annotations

import argparse
import shutil

import pytest

from kvdepot.bench import soak

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow,  # process start-ups dominate (2 min on the busy dev machine)
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")]


def test_short_soak_checks_every_byte_and_leaves_nothing(capsys):
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)  # the bench's own options, so the test's args cannot drift from the CLI's
    args = parser.parse_args(["--seconds", "4", "--clients", "2", "--fault-every", "1", "--seed", "1"])
    figures = soak.run(args)  # raises on a wrong byte or on anything left at the end
    assert all(figures[f"faults: {name}"] >= 1 for name in soak.FAULTS)
    assert figures["loads"] > 0 and figures["stores"] > 0 and figures["checked_bytes"] > 0
    assert figures["wrong_bytes"] == 0
    for held in ("sessions", "mappings", "prefetches", "leases", "pinned chunks", "shm files left"):
        assert figures[held] == 0, held
    assert figures["incarnations"] >= 3  # a killed client was replaced
    out = capsys.readouterr().out
    assert "wrong_bytes" in out and "short_loads" in out
