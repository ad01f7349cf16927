"""One engine node of ``kvdepot bench cluster``: a process with its own reference runtime and,
when connected, its own in-process kvdepot engine (host tier, Redis Cluster tier, KV events).

    python -m kvdepot.bench.cluster_node MODEL DEVICE

``NodeProcess`` is the bench's side: it starts one (optionally inside a network namespace) and
talks to it. The node reads one JSON object per line on stdin and answers one per line on stdout:

    {"op": "reset", "connected": bool, "pool_tokens": N, "env": {KVDEPOT_*: ...}}
        drop the engine (and its kvdepot engine: host tier, publisher) and build a fresh one with
        that config; answers {"ok": true}
    {"op": "run", "tokens": [...]}
        serve one prompt (one new token); answers {"ttft_ms", "pool", "kvdepot", "redis_reads"}:
        TTFT measured here, prompt tokens reused from the engine's own pool and loaded by kvdepot,
        chunks read from Redis meanwhile (for this request or promoted for later ones)
    {"op": "quit"}

After each request the node waits until what the request started has landed — its stores in host
memory, write-behind to Redis, promotions from Redis — before it answers, so the next request
(on whichever node) sees the same cache state in every run. That wait is outside the TTFT.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvdepot.bench.subprocs import wait_or_kill
from kvdepot.errors import KVDepotError

TOKENS_PER_BLOCK = 32


class Node:
    def __init__(self, model: str, device: str) -> None:
        self.model, self.device = model, device
        self.engine: Any = None

    def reset(self, connected: bool, pool_tokens: int, env: dict[str, str]) -> None:
        from kvdepot.integrations.tensorrt_llm.providers import destroy_engine
        from kvdepot.runtime import Engine, KvCacheConfig, KvCacheConnectorConfig, TorchLlmArgs

        self.engine = None
        destroy_engine()  # closes the publisher: its AllBlocksCleared ends the last configuration
        for name in [k for k in os.environ if k.startswith("KVDEPOT_")]:
            del os.environ[name]
        os.environ.update(env)  # the connector's engine reads its config from here when it is made
        connector = KvCacheConnectorConfig(
            connector_module="kvdepot.integrations.tensorrt_llm.adapter",
            connector_scheduler_class="KvDepotConnectorScheduler", connector_worker_class="KvDepotConnectorWorker")
        llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK, max_tokens=pool_tokens),
                                kv_connector_config=connector if connected else None)
        self.engine = Engine(self.model, device=self.device, llm_args=llm_args, seed=0)
        depot = _depot()
        if depot is not None:
            depot.wait_arena()

    def run(self, tokens: list[int]) -> dict[str, Any]:
        before = _lower_reads()
        result = self.engine.generate([tokens], 1, keep_all_logits=False)[0]
        depot = _depot()
        if depot is not None:  # let everything this request started land (see the module docstring)
            depot.wait_all()
            depot.wait_promotions()
            if depot.lower is not None:
                depot.lower.flush()
        return {"ttft_ms": result.ttft_s * 1e3, "pool": result.num_device_reused_tokens,
                "kvdepot": result.num_connector_matched_tokens, "redis_reads": _lower_reads() - before}

    def close(self) -> None:
        from kvdepot.integrations.tensorrt_llm.providers import destroy_engine

        self.engine = None
        destroy_engine()


class NodeProcess:
    """A node process and its pipes; ``prefix``: a command to run it under (``ip netns exec NS``)."""

    def __init__(self, index: int, model: str, device: str, log: Path, prefix: Sequence[str] = ()) -> None:
        self.index, self.log = index, log
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVDEPOT_")}  # its config is the bench's
        # NOTE: OpenMP threads spin for a while after each forward; on one machine an idle node's
        # spinning then slows the node that serves the next request (a real cluster has a host each)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        with open(log, "wb") as sink:
            self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "kvdepot.bench.cluster_node", model, device],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink, env=env, text=True)

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.proc.wait(timeout=30)
            raise KVDepotError(f"cluster node {self.index} exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
        answer = json.loads(line)
        if "error" in answer:
            raise KVDepotError(f"cluster node {self.index}: {answer['error']}")
        return answer

    def stop(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):  # the node reads quit, or has died already
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
        wait_or_kill(self.proc, 30)


def _lower_reads() -> int:
    """Chunks read from the tiers below host memory so far (here: the Redis Cluster)."""
    depot = _depot()
    return sum(tier.hits for tier in depot.stats().lower) if depot is not None else 0


def _depot() -> Any:
    from kvdepot.integrations.tensorrt_llm.providers import current_engine

    return current_engine()


def main(argv: list[str]) -> int:
    model, device = argv
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the answers
    node = Node(model, device)
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg["op"] == "reset":
                node.reset(msg["connected"], msg["pool_tokens"], msg["env"])
                answer: dict[str, Any] = {"ok": True}
            elif msg["op"] == "run":
                answer = node.run(msg["tokens"])
            elif msg["op"] == "quit":
                break
            else:
                answer = {"error": f"unknown op {msg['op']!r}; allowed: reset, run, quit"}
            out.write(json.dumps(answer) + "\n")
    finally:
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
