"""``kvdepot bench ttft --modes first-redis``: a fresh engine's first request, served from Redis.

Per prompt length L: a writer engine computes ``--first-prompts`` prompts (the recompute TTFT, a
miss each) and stores them through Redis; it is closed (its write-behind drained, like a process
exit). A fresh engine — empty host tier, the same Redis — then serves each prompt once: with
``lower_tier_hits: load`` its first request is promised the whole hit, parked while the chunks are
read from Redis into host memory, and loaded (the first-hit TTFT). The row gives both medians, their
ratio (the issue's target: <= 0.3 at 8K tokens), the tokens loaded and whether the outputs equal
the recompute's. A warm-up prompt runs first in each engine (kernels, allocator, tier threads).

Redis: a ``redis-server`` started here on a free loopback port, persistence off: the binary named
by ``--redis-server``, else the one on PATH (on a machine without it, carry Debian's package). Not
a ``KVDEPOT_*`` variable: every such variable is a configuration key, and an unknown one an error.
With ``--redis-cluster``: a 3-master Redis Cluster on loopback (``bench cluster``'s), the engines
configured with ``remote_cluster``; each row says which, and how many chunks a promotion reads at
once (config ``promote_streams``). The fresh engine's load gate (``lower_tier_gate``) has not seen
a prefill by default (its warm-up is short), so every hit is loaded: the rows measure the load path.
With ``--first-gate`` its warm-up is a full-length miss: from the second prompt on (once a
promotion was measured too) the gate decides, and ``loaded`` counts the prompts it let load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock


def add_first_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--first-prompts", type=int, default=3, help="first-redis: prompts per length")
    parser.add_argument("--redis-server", default=None, metavar="PATH",
                        help="first-redis: the redis-server binary (default: the one on PATH)")
    parser.add_argument("--first-gate", action="store_true",
                        help="first-redis: the fresh engine computes a full-length prompt first, so its load gate "
                             "(lower_tier_gate) has measured prefill and decides once a promotion has been measured "
                             "too (default: a 512-token warm-up, the gate stays unmeasured, every hit is loaded)")
    parser.add_argument("--redis-cluster", action="store_true",
                        help="first-redis: a 3-master Redis Cluster on loopback instead of one server (redis-server "
                             "and redis-cli on PATH); the promotions' streams spread over its masters")


@contextmanager
def redis_cluster() -> Iterator[str]:
    """A throwaway 3-master Redis Cluster on loopback (``bench cluster``'s); its seed node's URL."""
    from kvdepot.bench.cluster_redis import RedisCluster

    workdir = tempfile.mkdtemp(prefix="kvdepot-bench-cluster-")
    cluster = RedisCluster(Path(workdir))
    try:
        cluster.start()
        yield cluster.url
    finally:
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@contextmanager
def redis_server(binary: str | None) -> Iterator[str]:
    """A throwaway redis-server on loopback (no persistence, no memory limit); its URL."""
    binary = binary or shutil.which("redis-server")
    if not binary:
        raise SystemExit("--modes first-redis: no redis-server on PATH; install it or pass --redis-server PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kvdepot-bench-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir, "--proto-max-bulk-len", "1gb"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"redis-server ({binary}) did not start on port {port}") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def first_hit_rows(args: argparse.Namespace, lengths: list[int], engine: Callable[..., object],
                   ready: Callable[[None], None], kv_bytes_per_token: int, free: Callable[[], None],
                   add: Callable[[dict], object]) -> list[dict]:
    """The first-redis rows, each passed to ``add`` once measured (``engine``/``ready``/``free``:
    bench ttft's own helpers, so the engines are the other rows' engines)."""
    from kvdepot.bench.ttft import _prompt
    from kvdepot.integrations.tensorrt_llm.providers import current_engine, destroy_engine

    rows = []
    cluster = bool(args.redis_cluster)
    with redis_cluster() if cluster else redis_server(args.redis_server) as url:
        for i, n in enumerate(lengths):
            kv_gb = 2.5 * (n + 64) * kv_bytes_per_token / 1e9  # the prompt and the warm-up, with room
            env = {"KVDEPOT_REMOTE_URL": url, "KVDEPOT_LOWER_TIER_HITS": "load", "KVDEPOT_REMOTE_CLUSTER": str(cluster).lower(),
                   "KVDEPOT_CACHE_SALT": f"bench-first-{uuid.uuid4().hex}", "KVDEPOT_HOST_CAPACITY_GB": f"{max(kv_gb, 0.05):.3f}"}
            with mock.patch.dict(os.environ, env):
                results = []
                for role in ("writer", "reader"):
                    destroy_engine()  # the writer's: its write-behind drains to Redis first
                    eng = engine(args, n + 64, connected=True)
                    ready(None)
                    vocab = eng.model.config.vocab_size
                    warm = n if args.first_gate and role == "reader" else min(512, n)
                    eng.generate([_prompt(warm, 7 + len(results), vocab)], 1)  # warm-up (a miss)
                    results.append([eng.generate([_prompt(n, 600 + 10 * i + k, vocab)], 1)[0]
                                    for k in range(args.first_prompts)])
                    if role == "reader":
                        # Promotions the gate left running as prefetches hold their lease until
                        # they finish: wait for them, so that a lease still live is a leak.
                        current_engine().wait_promotions(timeout=60)
                        stats, streams = current_engine().stats(), current_engine().config.promote_streams
                    del eng
                    free()
                destroy_engine()
            miss, hit = results
            ms = [r.ttft_s * 1e3 for r in hit]
            base = statistics.median(r.ttft_s * 1e3 for r in miss)
            rows.append({
                "mode": "first-redis", "redis": "3-master cluster" if cluster else "1 server", "streams": streams,
                "prompt": n, "prompts": len(hit),
                "recompute ms": base, "first hit ms": statistics.median(ms), "min": min(ms), "max": max(ms),
                "hit/recompute": statistics.median(ms) / base,
                "gate": "measured prefill" if args.first_gate else "unmeasured",
                "loaded": sum(r.num_connector_matched_tokens > 0 for r in hit),
                "tokens loaded": min(r.num_connector_matched_tokens for r in hit),
                "async load": all(r.connector_async_load for r in hit),
                "errors": sum(r.error is not None for r in hit),
                "tokens==recompute": all(h.output_ids == m.output_ids for h, m in zip(hit, miss, strict=True)),
                "leases live": stats.live_leases,
            })
            add(rows[-1])
    return rows
