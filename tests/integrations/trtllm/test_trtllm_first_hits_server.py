"""First-request hits from disk and Redis in server mode: the TensorRT-LLM multi-process adapter
driven by the reference runtime against ``kvdepot server`` (``DepotServer``, started by the test
in this process so that its promotions can be gated; the engine talks to it over its ipc:// socket
with a bytes pool, as on CPU).

A server restarted with the same Redis or disk tier serves the first request of a fresh engine
(read into the server's host memory while the lookup waits, then promised synchronously); failures
injected between the lookup and the read end as a good load or a shorter promise with the rest
recomputed. The one failure after a promise that the server cannot rule out — the server itself
gone before the load — ends as a fail-stop: the engine's loop stops outside the forward, so
TensorRT-LLM neither computes from nor stores blocks that do not hold their KV.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from first_hits_rig import (
    HIT,
    Gate,
    Rig,
    Written,
    assert_first_hit_exact,
    assert_shorter_hit_right,
    engine,
    prompt_a,
    worker_of,
    write,
)

from kvdepot.config import load_config
from kvdepot.errors import PromisedLoadFailed
from kvdepot.integrations.tensorrt_llm import mp_adapter, providers
from kvdepot.server.server import DepotServer

pytestmark = pytest.mark.timeout(120)
MP = (mp_adapter.KvDepotMPConnectorScheduler, mp_adapter.KvDepotMPConnectorWorker)


class Servers:
    """``DepotServer``s on one ipc:// URL, one at a time, each over the same lower tiers."""

    def __init__(self, workdir: Path, **tiers: str) -> None:
        self.url, self.tiers = f"ipc://{workdir}/s.sock", tiers
        self.current: DepotServer | None = None

    def start(self) -> DepotServer:
        config = load_config(host_capacity_gb=0.003, remote_timeout_s=0.5, **self.tiers)
        self.current = DepotServer(self.url, config, session_timeout_s=5).start()
        return self.current

    def stop(self) -> None:
        """Stop serving (write-behind is drained into the lower tiers first, like a process exit)."""
        if self.current is not None:
            self.current.stop()
            self.current = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch, redis_factory) -> Iterator:
    workdir = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))  # short: an ipc:// path has 108 bytes at most
    made: list[Servers] = []

    def configure(*names: str) -> tuple[Servers, object]:
        monkeypatch.delenv("KVDEPOT_LOWER_TIER_HITS", raising=False)  # the default is under test
        tiers, redis = {}, None
        if "disk" in names:
            tiers["disk_path"] = str(workdir / "depot")
        if "redis" in names:
            redis = redis_factory()
            tiers["remote_url"] = redis.url
        made.append(Servers(workdir, **tiers))
        monkeypatch.setenv("KVDEPOT_SERVER_URL", made[-1].url)  # 1.2: not in kv_connector_config
        made[-1].start()
        return made[-1], redis

    yield configure
    providers.destroy_engine()
    for s in made:
        s.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def registered() -> None:
    """Wait for the worker's registration; then a lookup answers from LOOKUP alone (a fast
    promotion would otherwise count as a host hit and the load would not be parked)."""
    deadline = time.monotonic() + 20
    while providers.current_remote() is None:
        assert time.monotonic() < deadline, "the worker never registered with the server"
        time.sleep(0.01)
    providers.current_remote().prefetch_wait_s = 0


def write_then_restart(servers: Servers) -> Written:
    written = write(MP, registered)
    providers.destroy_engine()
    servers.restart()  # a fresh server: empty host tier, the same disk / Redis
    return written


@pytest.mark.parametrize("names", [("redis",), ("disk",)], ids=["redis", "disk"])
def test_restarted_server_first_request_hits(names, servers) -> None:
    s, _redis = servers(*names)
    written = write_then_restart(s)
    rig = Rig()
    eng = engine(rig, MP)
    registered()
    hit = eng.generate([prompt_a()], 4)[0]
    assert rig.promised[0] == (HIT, False)
    assert_first_hit_exact(eng, rig, hit, written)
    assert worker_of(eng).stats.failed_promises == 0


def _delete_all(redis) -> None:
    client = redis.client()
    names = client.keys("kvdepot:*")
    assert names and client.delete(*names) == len(names)


def _corrupt_disk(root: Path) -> None:
    files = [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".") and p.stat().st_size > 8192]
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))


# (case, tiers, tokens promised: HIT = a good load from another copy)
CASES = [("redis-values-deleted", ("redis",), 0), ("disk-corrupt-redis-has-it", ("disk", "redis"), HIT),
         ("redis-killed", ("redis",), 0)]


@pytest.mark.parametrize(("case", "names", "promised"), CASES, ids=[c[0] for c in CASES])
def test_server_mode_failure_between_lookup_and_read(case, names, promised, servers, monkeypatch) -> None:
    s, redis = servers(*names)
    written = write_then_restart(s)

    def inject() -> None:  # on the server's promotion thread, before it reads
        if case == "redis-values-deleted":
            _delete_all(redis)
        elif case == "disk-corrupt-redis-has-it":
            _corrupt_disk(Path(s.tiers["disk_path"]))
        else:
            redis.stop()

    Gate(monkeypatch, inject)
    rig = Rig()
    eng = engine(rig, MP)
    registered()
    first = eng.generate([prompt_a()], 4)[0]
    assert rig.promised[0] == (promised, False)
    if promised == HIT:
        assert_first_hit_exact(eng, rig, first, written)
    else:
        assert_shorter_hit_right(eng, rig, first, written, promised)
    assert worker_of(eng).stats.failed_promises == 0


def test_server_gone_after_the_promise_stops_the_loop_and_stores_nothing(servers) -> None:
    s, _redis = servers("redis")
    write_then_restart(s)
    rig = Rig()
    rig.after_promise = s.restart  # the promise's lease and host copy die with the old server
    eng = engine(rig, MP)
    registered()
    with pytest.raises(PromisedLoadFailed, match="promised tokens"):
        eng.generate([prompt_a()], 4)
    assert rig.promised[0] == (HIT, False)
    assert worker_of(eng).stats.failed_promises == 1
    assert eng.blocks.match(prompt_a())[0] == []  # TensorRT-LLM stored nothing for device reuse
    assert eng.results == {}  # and answered nobody with output computed over the missing KV
