"""``kvdepot bench cluster``: N engine nodes sharing one Redis Cluster, routed two ways.

    kvdepot bench cluster [--nodes 4] [--model small] [--device cpu] [--netns] [--json P] [--plot P]

Starts a Redis Cluster of three masters and ``--nodes`` node processes (``cluster_node``: the
reference runtime with an in-process kvdepot engine each: its own host tier, the shared Redis
Cluster behind it, KV events on), then serves the same multi-turn workload (``cluster_workload``)
four times, each over empty caches:

    no cache               one node without kvdepot (the engine's own pool only)
    1 node                 one node with kvdepot
    N nodes round-robin    every request to the next node
    N nodes routed         by ``PrefixRouter``, fed only by the nodes' KV events

Requests go one at a time (the next after the last one's stores have landed), so TTFT holds no
queueing and the runs differ only in where the KV was found. The figures (``cluster_report``):
hit %, kvdepot %, recompute %, Redis reads and TTFT p50/p90. With ``--netns`` every node runs in its own
network namespace behind a veth pair and reaches Redis over it (root and ``ip netns`` needed).
The 8B shape is for a GPU: ``--device cuda --model llama-8b``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvdepot.bench import cluster_report
from kvdepot.bench.cluster_node import TOKENS_PER_BLOCK, NodeProcess
from kvdepot.bench.cluster_redis import RedisCluster
from kvdepot.bench.cluster_router import Policy, RoundRobin, Routed, Single
from kvdepot.bench.cluster_workload import Ledger, Request, Shape, requests
from kvdepot.bench.report import Report, add_output_arguments
from kvdepot.errors import KVDepotError

MODEL_ID = "kvdepot-bench-cluster"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Shape()
    parser.add_argument("--nodes", type=int, default=4, help="engine nodes of the multi-node rows")
    parser.add_argument("--model", default="small", help="runtime preset (tiny, small, llama-1b, llama-8b); random weights")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (every node on the same GPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload")
    parser.add_argument("--sessions", type=int, default=d.sessions, help="chat sessions")
    parser.add_argument("--turns", type=int, default=d.turns, help="turns per session")
    parser.add_argument("--systems", type=int, default=d.systems, help="shared system prompts")
    parser.add_argument("--system-tokens", type=int, default=d.system_tokens, help="tokens of each system prompt")
    parser.add_argument("--documents", type=int, default=d.documents, help="shared documents")
    parser.add_argument("--document-tokens", type=int, default=d.document_tokens, help="tokens of each document")
    parser.add_argument("--user-tokens", type=int, default=d.user_tokens, help="tokens of each user message")
    parser.add_argument("--reply-tokens", type=int, default=d.reply_tokens, help="tokens of each earlier reply")
    parser.add_argument("--pool-tokens", type=int, default=None,
                        help="the engine's own KV pool per node (default: twice the longest prompt, like a GPU "
                             "that holds a couple of requests, not the whole workload)")
    parser.add_argument("--chunk-size", type=int, default=256, help="kvdepot chunk size (a multiple of 32)")
    parser.add_argument("--host-gb", type=float, default=None,
                        help="kvdepot host tier per node, GB (default: 1.25x the workload's distinct prompt blocks: "
                             "no evictions, the rows differ by where KV is, not by capacity)")
    parser.add_argument("--netns", action="store_true", help="run each node in its own network namespace (root, ip netns)")
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.nodes < 1:
        raise KVDepotError(f"--nodes {args.nodes}: need at least 1 node")
    if args.chunk_size % TOKENS_PER_BLOCK:
        raise KVDepotError(f"--chunk-size {args.chunk_size}: must be a multiple of the engine's {TOKENS_PER_BLOCK}-token blocks")
    shape = Shape(args.systems, args.system_tokens, args.documents, args.document_tokens, Shape().doc_share,
                  args.sessions, args.turns, args.user_tokens, args.reply_tokens)
    from kvdepot.runtime import PRESETS

    if args.model not in PRESETS:
        raise KVDepotError(f"--model {args.model!r}: not a runtime preset; allowed: {', '.join(sorted(PRESETS))}")
    work = requests(shape, PRESETS[args.model].vocab_size, args.seed)
    pool = args.pool_tokens or 2 * max(len(r.tokens) for r in work) + 2 * TOKENS_PER_BLOCK
    if args.host_gb is None:
        blocks = len({h for r in work for h in Ledger(TOKENS_PER_BLOCK).hashes(r.tokens)})
        args.host_gb = round(max(0.01, 1.25 * blocks * TOKENS_PER_BLOCK * PRESETS[args.model].kv_bytes_per_token / 1e9), 3)
    workdir = Path(tempfile.mkdtemp(prefix="kvd-cluster-", dir="/tmp"))  # short: ipc:// paths are limited
    report = Report(args, steps=4 * len(work), device=args.device, name="cluster")
    report.table(f"bench cluster: {len(work)} requests ({args.sessions} sessions x {args.turns} turns, {args.systems} "
                 f"system prompts, {args.documents} documents), model {args.model} on {args.device}, "
                 f"pool {pool} tokens and host tier {args.host_gb} GB per node, chunk {args.chunk_size}" + (", netns" if args.netns else ", loopback"),
                 config=len(f"{args.nodes} nodes round-robin"))
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(_network(args.netns, args.nodes))
        redis = RedisCluster(workdir, host=net.redis_host)
        stack.callback(redis.stop)
        redis.start()
        nodes = [NodeProcess(i, args.model, args.device, workdir / f"node{i}.log", net.prefix(i)) for i in range(args.nodes)]
        for node in nodes:
            stack.callback(node.stop)
        for node in nodes:  # all started (torch imported) before any row: a starting node steals CPU
            node.call({"op": "reset", "connected": False, "pool_tokens": pool, "env": {}})
        configs: list[tuple[str, int, bool]] = [("no cache", 1, False), ("1 node", 1, True),
                                                 (f"{args.nodes} nodes round-robin", args.nodes, True),
                                                 (f"{args.nodes} nodes routed", args.nodes, True)]
        for n, (name, count, connected) in enumerate(configs):
            redis.flush()
            endpoints = [(f"ipc://{workdir}/ev{n}-{i}", f"ipc://{workdir}/rp{n}-{i}") for i in range(count)]
            for i, node in enumerate(nodes[:count]):
                node.call({"op": "reset", "connected": connected, "pool_tokens": pool,
                           "env": _node_env(args, redis.url, endpoints[i]) if connected else {}})
                node.call({"op": "run", "tokens": _warm_prompt(work, 1000 + i)})  # one-time costs out of the rows
            policy: Policy = Single() if count == 1 else (
                RoundRobin(count) if name.endswith("round-robin") else Routed(MODEL_ID, TOKENS_PER_BLOCK, endpoints))
            try:
                report.add(cluster_report.row(name, count, _serve(work, nodes, policy, report)))
            finally:
                policy.close()
    rows = report.finish({"workload": vars(shape), "pool_tokens": pool})
    if args.plot:
        cluster_report.plot(rows, args.plot, report.tables[0].title)
    _verdict(report, rows)
    if not os.environ.get("KVD_CLUSTER_KEEP"):  # KVD_CLUSTER_KEEP=1 keeps the nodes' logs
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def _serve(work: list[Request], nodes: list[NodeProcess], policy: Policy, report: Report) -> list[cluster_report.Served]:
    ledger = Ledger(TOKENS_PER_BLOCK)
    served = []
    for req in work:
        with report.step(policy.name):
            tokens = list(req.tokens)
            got = nodes[policy.pick(tokens)].call({"op": "run", "tokens": tokens})
            cached = got["pool"] + got["kvdepot"]
            served.append(cluster_report.Served(len(tokens), got["pool"], got["kvdepot"], got["ttft_ms"],
                                                ledger.account(tokens, cached), got["redis_reads"]))
            policy.settle()
    return served


def _node_env(args: argparse.Namespace, redis_url: str, endpoints: tuple[str, str]) -> dict[str, str]:
    return {"KVDEPOT_MODEL_ID": MODEL_ID, "KVDEPOT_CHUNK_SIZE": str(args.chunk_size),
            "KVDEPOT_HOST_CAPACITY_GB": str(args.host_gb), "KVDEPOT_REMOTE_URL": redis_url,
            "KVDEPOT_REMOTE_CLUSTER": "true", "KVDEPOT_KV_EVENTS_ENDPOINT": endpoints[0],
            "KVDEPOT_KV_EVENTS_REPLAY_ENDPOINT": endpoints[1], "KVDEPOT_LOG_LEVEL": "WARNING"}


def _warm_prompt(work: list[Request], seed: int) -> list[int]:
    """Unrelated tokens as long as the workload's first prompt (kernels, allocator, first store)."""
    rng = random.Random(seed)
    top = max(max(r.tokens) for r in work) + 1
    return [rng.randrange(top) for _ in range(len(work[0].tokens))]


def _verdict(report: Report, rows: list[dict[str, Any]]) -> None:
    one, rr, routed = rows[1]["hit %"], rows[2]["hit %"], rows[3]["hit %"]
    report.note(f"round-robin vs 1 node: {rr - one:+.1f} points of hit rate ({'within' if rr >= one - 5 else 'not within'} 5); "
                f"routed vs 1 node: {routed - one:+.1f} points ({'>=' if routed >= one else '<'} 1 node); "
                f"load average {os.getloadavg()[0]:.1f} (TTFT moves with it; hit and recompute shares do not)")


def _network(netns: bool, nodes: int) -> contextlib.AbstractContextManager[Any]:
    if not netns:
        return contextlib.nullcontext(_Loopback())
    from kvdepot.bench.cluster_netns import Namespaces

    return Namespaces(nodes)


class _Loopback:
    redis_host = "127.0.0.1"

    def prefix(self, index: int) -> tuple[str, ...]:
        return ()
