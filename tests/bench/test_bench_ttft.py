"""``kvdepot bench ttft`` on CPU with the tiny model: both modes load from kvdepot and stay exact."""

from __future__ import annotations

import pytest

from kvdepot.bench.ttft import add_arguments, run
from kvdepot.config import DepotConfig

pytestmark = pytest.mark.timeout(300)


def test_ttft_bench_in_process_and_through_a_server(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--model", "tiny", "--lengths", "256,512", "--miss-prompts", "2",
                              "--miss-length", "256", "--decode-tokens", "3", "--modes", "in-process,whole,mp",
                              "--repeats", "3", "--json", str(tmp_path / "ttft.json")])
    result = run(args)
    hits = result["hits"]
    assert [(r["mode"], r["prompt"]) for r in hits] == [(m, n) for m in ("in-process", "whole", "mp") for n in (256, 512)]
    for row in hits:  # every hit is served by kvdepot (all but the last block) and exact
        assert row["tokens loaded"] == row["prompt"] - 32
        assert row["hit==device bitwise"] and row["tokens==recompute"]
        assert row["by layer"] is False  # a CPU pool always loads whole
        assert row["+64 partial hit ms"] > 0 and row["suffix only ms"] > 0  # (the bench checks what each loaded)
        for kind, ttft in (("hit", "kvdepot hit ms"), ("device", "device hit ms")):  # each TTFT's split
            before, forward = row[f"{kind}: before ms"], row[f"{kind}: forward ms"]
            assert before > 0 and forward > 0 and before + forward <= row[ttft]
        assert 0 <= row["hit: to layer 0 ms"] <= row["hit: forward ms"]
        assert row["repeats"] == 3 and row["hit ms min"] <= row["kvdepot hit ms"] <= row["hit ms max"]  # the median try
    versus = result["versus"]  # mp against in-process per length (not against ``whole``)
    assert [r["prompt"] for r in versus] == [256, 512]
    for r in versus:
        local, mp = ({h["mode"]: h for h in hits if h["prompt"] == r["prompt"]}[m] for m in ("in-process", "mp"))
        assert r["mp/in-process"] == pytest.approx(mp["kvdepot hit ms"] / local["kvdepot hit ms"])
        assert r["mp hit/device"] == pytest.approx(mp["kvdepot hit ms"] / mp["device ms median"])
    assert [r["connector"] for r in result["misses"]] == [False, True]
    assert 0 < result["misses"][1]["connector host share"] < 1  # the connector's calls were timed
    assert (tmp_path / "ttft.json").exists()


def test_rounds_alternate_in_process_and_mp_with_one_server_and_new_prompts_each_round(monkeypatch):
    """``--rounds 3`` over in-process and mp: the modes in turn, every other round reversed, one
    server for all of them (each round's prompts new to it: a prompt it still held would load
    where the bench times a miss, and the bench refuses such a row), and the MP comparison over
    the rounds' medians."""
    import argparse

    from kvdepot.bench import server_proc

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--model", "tiny", "--lengths", "512", "--miss-prompts", "1",
                              "--miss-length", "64", "--decode-tokens", "2", "--modes", "in-process,mp", "--rounds", "3",
                              "--suffix", "256"])  # a partial prompt of whole chunks: held from a past round, it would load
    started = []
    real = server_proc.running_server
    monkeypatch.setattr(server_proc, "running_server", lambda *a, **k: started.append(a) or real(*a, **k))
    result = run(args)
    hits = result["hits"]
    assert [r["mode"] for r in hits] == ["in-process", "mp", "mp", "in-process", "in-process", "mp"]
    assert len(started) == 1
    assert all(r["tokens loaded"] == 480 and r["hit==device bitwise"] for r in hits)
    (versus,) = result["versus"]
    assert versus["rounds"] == 3
    mp = sorted(r["kvdepot hit ms"] for r in hits if r["mode"] == "mp")
    local = sorted(r["kvdepot hit ms"] for r in hits if r["mode"] == "in-process")
    assert versus["mp/in-process"] == pytest.approx(mp[1] / local[1])


@pytest.mark.parametrize("option", ["--repeats", "--rounds"])
def test_repeats_and_rounds_must_be_positive(option, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([option, "0"])
    assert f"{option}: '0' is not a whole number >= 1" in capsys.readouterr().err


def test_unknown_mode_is_refused():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit, match="allowed: in-process, whole, mp, first-redis"):
        run(parser.parse_args(["--device", "cpu", "--model", "tiny", "--modes", "gpu"]))


def test_layers_ahead_reaches_the_engine_as_a_parameter(tmp_path):
    """``--layers-ahead`` sets config ``load_layers_ahead`` for the engine the connector makes
    (no module constant is overwritten), and each row says which value it ran with."""
    import argparse

    from kvdepot.integrations.tensorrt_llm.providers import current_engine
    from kvdepot.transfer import layered

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    seen = []
    args = parser.parse_args(["--device", "cpu", "--model", "tiny", "--lengths", "256", "--layers-ahead", "2,64",
                              "--miss-prompts", "2", "--miss-length", "256", "--decode-tokens", "2"])
    from kvdepot.bench import ttft

    def add_spy(row):
        seen.append((row["layers ahead"], current_engine().config.load_layers_ahead))

    rows = []
    for ahead in (2, 64):
        rows += ttft._hits(args, [256], 10.0, "in-process", add=lambda row, a=ahead: add_spy({"layers ahead": a, **row}),
                           layers_ahead=ahead)
    assert seen == [(2, 2), (64, 64)]
    assert layered.LAYERS_AHEAD == 4  # the default stays what it was
    assert all(r["tokens loaded"] == 224 for r in rows)


def test_layer_thread_reaches_the_engine_s_transfers_and_its_values_alternate_round_by_round(monkeypatch):
    """``--layer-thread on,off`` sets config ``load_layer_thread`` for the engine the connector
    makes, down to its transfers; with ``--rounds`` the two alternate, in turn reversed, so that a
    drift of the host lands on both; a word other than on/off is refused in one line."""
    import argparse

    from kvdepot.bench import ttft
    from kvdepot.integrations.tensorrt_llm.providers import current_engine

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--model", "tiny", "--lengths", "256", "--layer-thread", "on,off",
                              "--rounds", "3", "--miss-prompts", "1", "--miss-length", "64", "--decode-tokens", "2"])
    assert args.layer_thread == [True, False]
    seen = []
    for thread in (True, False):
        ttft._hits(args, [256], 10.0, "in-process", layer_thread=thread,
                   add=lambda row: seen.append((current_engine().config.load_layer_thread,
                                                current_engine()._transfers.layer_thread)))
    assert seen == [(True, True), (False, False)]

    calls = []
    monkeypatch.setattr(ttft, "_hits", lambda a, lengths, h2d, mode, add=None, layer_thread=None, **more:
                        calls.append(layer_thread) or [add({"mode": mode, "prompt": 256})])
    out = run(args)
    assert calls == [True, False, False, True, True, False]
    assert [row["layer thread"] for row in out["hits"]] == calls
    with pytest.raises(SystemExit):
        parser.parse_args(["--layer-thread", "yes"])


@pytest.mark.parametrize("cluster", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["server", "cluster"])
def test_first_redis_mode_serves_a_fresh_engines_first_request(redis_server, cluster: bool):
    """The first-redis rows: a fresh engine's first request of each prompt is served from Redis
    (parked, then loaded), exact. The bench starts its own redis-server (the fixture's binary), or
    a 3-master cluster with --redis-cluster."""
    import argparse
    import shutil

    from redis_server import REDIS_SERVER

    if cluster and shutil.which("redis-cli") is None:
        pytest.skip("redis-cli not found: apt-get install redis-server (brings redis-tools)")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--model", "tiny", "--lengths", "600", "--miss-prompts", "1",
                              "--miss-length", "64", "--decode-tokens", "2", "--modes", "first-redis",
                              "--first-prompts", "2", "--redis-server", REDIS_SERVER, *(["--redis-cluster"] * cluster)])
    (row,) = run(args)["first_hits"]
    assert (row["prompt"], row["prompts"], row["tokens loaded"], row["errors"], row["leases live"]) == (600, 2, 512, 0, 0)
    assert not row["async load"] and row["tokens==recompute"]  # read before the promise: a synchronous load
    assert row["redis"] == ("3-master cluster" if cluster else "1 server") and row["streams"] == DepotConfig().promote_streams
    assert row["loaded"] == 2 and row["gate"] == "unmeasured"
    assert row["hit/recompute"] == row["first hit ms"] / row["recompute ms"]
