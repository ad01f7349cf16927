"""``kvdepot bench cluster``: a tiny run of two nodes over a real Redis Cluster, and its parts."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from kvdepot.bench.cluster import add_arguments, run
from kvdepot.bench.cluster_workload import Ledger, Shape, requests
from kvdepot.errors import KVDepotError

pytestmark = pytest.mark.timeout(300)
needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
                                 reason="needs redis-server and redis-cli")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_workload_is_seeded_and_each_turn_extends_the_last():
    shape = Shape(systems=2, system_tokens=64, documents=2, document_tokens=64, sessions=3, turns=3,
                  user_tokens=8, reply_tokens=8)
    work = requests(shape, 100, seed=5)
    assert work == requests(shape, 100, seed=5) and work != requests(shape, 100, seed=6)
    assert [r.turn for r in work] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for r in work:
        if r.turn:
            before = next(p for p in work if p.session == r.session and p.turn == r.turn - 1)
            assert r.tokens[:len(before.tokens)] == before.tokens and len(r.tokens) == len(before.tokens) + 16


def test_ledger_counts_only_blocks_computed_before():
    ledger = Ledger(4)
    a = list(range(12))
    assert ledger.account(a, 0) == 0  # first time: computed, not recomputed
    assert ledger.account(a, 8) == 4  # the last block computed again
    assert ledger.account(a + [99] * 4, 12) == 0  # a new block


@needs_redis
def test_tiny_cluster_run_routed_beats_round_robin(tmp_path):
    rows = run(_args("--model", "tiny", "--nodes", "2", "--sessions", "4", "--turns", "2", "--systems", "2",
                     "--system-tokens", "256", "--documents", "2", "--document-tokens", "256", "--user-tokens", "32",
                     "--reply-tokens", "32", "--pool-tokens", "704", "--json", str(tmp_path / "c.json")))
    assert [r["config"] for r in rows] == ["no cache", "1 node", "2 nodes round-robin", "2 nodes routed"]
    assert len({r["prompt tokens"] for r in rows}) == 1 and all(r["requests"] == 8 for r in rows)
    none, one, rr, routed = rows
    assert none["kvdepot %"] == 0 and one["kvdepot %"] > 0  # kvdepot serves what the small pool lost
    assert one["hit %"] > none["hit %"] and one["recompute %"] < none["recompute %"]
    # The router sees only the nodes' KV events; it must send later turns where their prefix is in
    # host memory: a single node's hit rate at least, with fewer reads from the shared tier than
    # round-robin (with events off it routes round-robin and fails here).
    assert routed["hit %"] >= one["hit %"] and routed["Redis reads"] < rr["Redis reads"]
    assert none["Redis reads"] == 0 and rr["Redis reads"] > 0
    assert all(r["TTFT p90 ms"] >= r["TTFT p50 ms"] > 0 for r in rows)
    assert json.loads((tmp_path / "c.json").read_text())["tables"][0]["rows"] == rows


def test_bad_arguments_fail_clearly():
    with pytest.raises(KVDepotError, match="--chunk-size 100: must be a multiple"):
        run(_args("--chunk-size", "100"))
    with pytest.raises(KVDepotError, match="allowed: .*llama-8b.*tiny"):
        run(_args("--model", "huge"))


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root and ip")
def test_netns_nodes_reach_the_bridge_and_leave_nothing():
    from kvdepot.bench.cluster_netns import Namespaces

    with socket.socket() as listener:
        with Namespaces(2) as net:
            listener.bind((net.redis_host, 0))
            listener.listen()
            port = listener.getsockname()[1]
            for i in range(2):
                probe = f"import socket; socket.create_connection(({net.redis_host!r}, {port}), timeout=5).close()"
                subprocess.run([*net.prefix(i), sys.executable, "-c", probe], check=True, timeout=60)
            names, bridge = net.names, net.bridge
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(name in left for name in names)
        assert subprocess.run(["ip", "link", "show", bridge], capture_output=True).returncode != 0


def test_cli_names_the_bench():
    from kvdepot.cli import build_parser

    argv = ["bench", "cluster", "--nodes", "3", "--netns"]
    args = build_parser(argv).parse_args(argv)
    assert args.bench == "cluster" and args.nodes == 3 and args.netns and args.model == "small"
