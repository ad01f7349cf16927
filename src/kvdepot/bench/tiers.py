"""``kvdepot bench tiers``: the tiers below host memory against raw I/O of the same bytes, same run.

    disk   DiskTier put/get of chunk-sized payloads vs os.write/os.read of the same sizes in the
           same directory, with the tier's O_DIRECT choice and fsync setting (a ``dd``).
    redis  RedisTier put/get vs redis-py SET/GET of the same sizes on the same server (one is
           started on a free loopback port, persistence off, unless --remote-url is given).
    ttft   reference runtime: recompute vs hits served from host memory, disk and Redis (fresh
           engines with an empty host tier; ``lower_tier_hits=async``: the first request is
           parked and served from the lower tier).

Tier and raw runs alternate within each repetition (the order flips every repetition) so a noisy
neighbour hits both; GB/s are medians over repetitions. Reads read back what the repetition
wrote: with O_DIRECT the page cache is bypassed; buffered files are fdatasync'ed and dropped
with POSIX_FADV_DONTNEED first (no effect on tmpfs: there "reads from" says memory).
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvdepot.bench.common import median_seconds, print_table
from kvdepot.config import load_config
from kvdepot.keys import ChunkKey
from kvdepot.storage import codec
from kvdepot.storage.disk import ALIGN, O_DIRECT, DiskTier
from kvdepot.storage.redis_tier import RedisTier

NS = bytes(range(16))
CPU = torch.device("cpu")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default="disk,redis,ttft", help="comma-separated subset of disk,redis,ttft")
    parser.add_argument("--chunk-mib", type=float, default=32.0, help="payload per chunk (Llama-3-8B bf16, 256 tokens: 32)")
    parser.add_argument("--chunks", type=int, default=8, help="chunks per timed batch")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (after one warm-up)")
    parser.add_argument("--disk-path", default=None, help="directory to test (default: a temp dir under /tmp)")
    parser.add_argument("--o-direct", choices=("auto", "true", "false"), default=load_config().disk_o_direct)
    parser.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=load_config().disk_fsync)
    parser.add_argument("--remote-url", default=None, help="Redis URL (default: start a redis-server here)")
    parser.add_argument("--redis-timeout", type=float, default=5.0, help="socket timeout of both Redis clients (s)")
    parser.add_argument("--model", default="small", help="runtime preset or checkpoint dir for the TTFT part")
    parser.add_argument("--prompt-tokens", type=int, default=2100)
    parser.add_argument("--prompts", type=int, default=3, help="distinct prompts per TTFT phase (median)")


def run(args: argparse.Namespace) -> list[dict]:
    parts = set(args.parts.split(","))
    size = int(args.chunk_mib * 2**20)
    payload = os.urandom(size)
    own_dir = args.disk_path is None
    root = Path(tempfile.mkdtemp(prefix="kvdepot-bench-tiers-", dir=None if own_dir else args.disk_path))
    server, url = (None, args.remote_url) if args.remote_url or not parts & {"redis", "ttft"} else _start_redis(root, size, args.chunks)
    cost = _cpu_costs(payload, max(3, args.reps))
    tiers: list[dict] = []
    ttft: list[dict] = []
    try:
        if "disk" in parts:
            tiers += _disk(args, root, payload, cost)
        if "redis" in parts:
            tiers += _redis(args, url, payload, cost)
        title = (f"kvdepot bench tiers — {args.chunks} x {size / 2**20:g} MiB chunks, median of {args.reps}; disk {root}: "
                 f"{_fs_type(root)}; per chunk: xxh3 {cost['xxh3']:.2f} ms, memcpy {cost['memcpy']:.2f} ms, "
                 f"copy to fresh memory {cost['copy']:.2f} ms")
        print_table(title, tiers)
        if "ttft" in parts:
            ttft = _ttft(args, root / "ttft", url)
            print_table(f"TTFT, {args.model} on CPU, {args.prompt_tokens}-token prompts, median of {args.prompts} "
                        "(lower_tier_hits=async: the first request after a restart is served from the tier)", ttft)
    finally:
        if server is not None:
            server.kill()
            server.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)
    return tiers + ttft


# ---- shared ------------------------------------------------------------------------------------
def _key() -> ChunkKey:
    return ChunkKey(uuid.uuid4().bytes)


def _cpu_costs(payload: bytes, reps: int) -> dict[str, float]:
    """ms per chunk of CPU work the tiers add: checksum, a copy into a reused buffer, a copy into
    fresh memory (malloc + page faults: what ``bytes()``, ``b"".join`` and ``pread`` pay)."""
    key, dst = _key(), bytearray(len(payload))
    ms = {"xxh3": lambda: codec.encode_header(NS, key, payload), "copy": lambda: bytes(memoryview(payload)),
          "memcpy": lambda: memoryview(dst).__setitem__(slice(None), payload)}
    return {name: 1e3 * median_seconds(fn, CPU, reps) for name, fn in ms.items()}


def _compare(ops: list[tuple[str, Callable[[int, int], None], Callable[[int, int], None]]], reps: int, chunks: int,
             size: int, between: Callable[[int], None], cleanup: Callable[[int], None]) -> list[tuple[str, float, float]]:
    """(op, tier GB/s, raw GB/s) per op from the median time per chunk. Tier and raw alternate
    chunk by chunk (order flipped every chunk), so a noisy neighbour's burst hits both; ``between``
    runs untimed after the first op's chunks, ``cleanup`` after the last; rep 0 warms up."""
    times: dict[str, list[list[float]]] = {name: [[], []] for name, _, _ in ops}
    for rep in range(reps + 1):
        for j, (name, tier, raw) in enumerate(ops):
            for i in range(chunks):
                for slot, fn in [(0, tier), (1, raw)][:: 1 if (rep + i) % 2 else -1]:
                    start = time.perf_counter()
                    fn(rep, i)
                    if rep:
                        times[name][slot].append(time.perf_counter() - start)
            (between if j == 0 else cleanup)(rep)
    return [(name, size / statistics.median(t) / 1e9, size / statistics.median(r) / 1e9) for name, (t, r) in times.items()]


def _rows(kind: str, results: list[tuple[str, float, float]], size: int, chunks: int, extra_ms: list[float], **more) -> list[dict]:
    """``cpu ms``: what the tier does beyond the raw path per chunk (checksum, copies), measured here."""
    return [{"tier": kind, "op": op, "MiB/chunk": size / 2**20, "chunks": chunks, "tier GB/s": tier, "raw GB/s": raw,
             "ratio": tier / raw, "gap ms/chunk": size / tier / 1e6 - size / raw / 1e6, "cpu ms/chunk": cpu, **more}
            for (op, tier, raw), cpu in zip(results, extra_ms, strict=True)]


# ---- disk --------------------------------------------------------------------------------------
def _fs_type(path: Path) -> str:
    real, best = os.path.realpath(path), ("", "?", "?")
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                dev, mnt, fstype = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, fstype, dev)
    except OSError:
        return "filesystem unknown (no /proc/mounts)"
    return f"{best[1]} ({best[2]} on {best[0]})"


def _raw_write(path: Path, buf: memoryview, direct: bool, fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | (O_DIRECT if direct else 0), 0o600)
    try:
        done = 0
        while done < buf.nbytes:
            done += os.write(fd, buf[done:])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _raw_read(path: Path, buf: memoryview, direct: bool) -> int:
    fd = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
    try:
        got = 0
        while got < buf.nbytes and (n := os.preadv(fd, [buf[got:]], got)):
            got += n
        return got
    finally:
        os.close(fd)


def _drop_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _disk(args: argparse.Namespace, root: Path, payload: bytes, cost: dict[str, float]) -> list[dict]:
    n, size, reps = args.chunks, len(payload), range(args.reps + 1)
    tier = DiskTier(root / "tier", 4 * n * (size + 2 * ALIGN), NS, fsync=args.fsync,
                    o_direct={"auto": None, "true": True, "false": False}[args.o_direct])
    direct = tier.o_direct
    span = -(-size // ALIGN) * ALIGN if direct else size  # an O_DIRECT write is whole blocks
    wbuf, rbuf = mmap.mmap(-1, span), mmap.mmap(-1, span)  # page-aligned, as O_DIRECT needs
    wbuf[:size] = payload
    (root / "raw").mkdir()
    keys = {rep: [_key() for _ in range(n)] for rep in reps}
    paths = {rep: [root / "raw" / f"{rep}.{i}" for i in range(n)] for rep in reps}

    def put(rep: int, i: int) -> None:
        if not tier.put(keys[rep][i], payload):
            raise RuntimeError(f"disk tier refused a put: {tier.stats()}")

    def get(rep: int, i: int) -> None:
        if tier.get(keys[rep][i]) is None:
            raise RuntimeError(f"disk tier missed a chunk it holds: {tier.stats()}")

    def write(rep: int, i: int) -> None:
        _raw_write(paths[rep][i], memoryview(wbuf)[:span], direct, args.fsync)

    def read(rep: int, i: int) -> None:
        if _raw_read(paths[rep][i], memoryview(rbuf)[:span], direct) < size:
            raise RuntimeError("short read")

    def cleanup(rep: int) -> None:
        for k, p in zip(keys[rep], paths[rep], strict=True):
            tier.delete(k)
            p.unlink()

    results = _compare([("put / write", put, write), ("get / read", get, read)], args.reps, n, size,
                       lambda rep: None if direct else _drop_cache(root), cleanup)
    tier.close()
    wbuf.close()
    rbuf.close()
    fs = _fs_type(root)
    source = "device (O_DIRECT)" if direct else "memory (tmpfs)" if fs.startswith("tmpfs") else "disk (fadvise DONTNEED)"
    # O_DIRECT: put checksums and copies into the aligned buffer, get checksums and copies out of it.
    # Buffered: put checksums; get checksums and pread returns fresh bytes (raw reads into one buffer).
    extra = [cost["xxh3"] + cost["memcpy"], cost["xxh3"] + cost["copy"]] if direct else [cost["xxh3"], cost["xxh3"] + cost["copy"]]
    return _rows("disk", results, size, n, extra, **{"O_DIRECT": direct, "fsync": args.fsync, "reads from": source})


# ---- redis -------------------------------------------------------------------------------------
def _start_redis(root: Path, size: int, chunks: int) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found: pass --remote-url or install it (Debian: redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bulk = max(512 << 20, 2 * (size + codec.HEADER_BYTES))  # the default 512 MB caps one value
    maxmemory = 4 * chunks * (size + codec.HEADER_BYTES) + (256 << 20)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(root),
         "--maxmemory", str(maxmemory), "--maxmemory-policy", "noeviction", "--proto-max-bulk-len", str(bulk),
         "--client-query-buffer-limit", str(max(1 << 30, 2 * bulk))],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, deadline = f"redis://127.0.0.1:{port}/0", time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if redis.Redis.from_url(url, socket_timeout=1).ping():
                return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server did not start on port {port}")


def _redis(args: argparse.Namespace, url: str, payload: bytes, cost: dict[str, float]) -> list[dict]:
    n, size, reps = args.chunks, len(payload), range(args.reps + 1)
    tier = RedisTier(url, NS, timeout_s=args.redis_timeout, prefix=f"kvdepot-bench-{uuid.uuid4().hex[:8]}")
    raw = redis.Redis.from_url(url, socket_timeout=args.redis_timeout, socket_connect_timeout=args.redis_timeout,
                               retry=Retry(NoBackoff(), 0))  # the tier's client settings
    keys = {rep: [_key() for _ in range(n)] for rep in reps}
    names = {rep: [f"kvdepot-bench-raw:{uuid.uuid4().hex}".encode() for _ in range(n)] for rep in reps}

    def put(rep: int, i: int) -> None:
        if not tier.put(keys[rep][i], payload):
            raise RuntimeError("redis tier refused a put (see the log: maxmemory? proto-max-bulk-len?)")

    def get(rep: int, i: int) -> None:
        if tier.get(keys[rep][i]) is None:
            raise RuntimeError("redis tier missed a chunk it holds")

    def set_(rep: int, i: int) -> None:
        raw.set(names[rep][i], payload)

    def get_(rep: int, i: int) -> None:
        if len(raw.get(names[rep][i]) or b"") != size:
            raise RuntimeError("raw GET missed a value")

    def cleanup(rep: int) -> None:
        raw.delete(*names[rep], *(tier.redis_key(k) for k in keys[rep]))

    results = _compare([("put / SET", put, set_), ("get / GET", get, get_)], args.reps, n, size, lambda rep: None, cleanup)
    tier.close()
    raw.close()
    # put: checksum + the header+payload join; get: checksum + bytes() of the verified slice.
    extra = [cost["xxh3"] + cost["copy"]] * 2
    return _rows("redis", results, size, n, extra, **{"O_DIRECT": None, "fsync": None, "reads from": "redis-server (memory)"})


# ---- TTFT in the reference runtime --------------------------------------------------------------
def _ttft(args: argparse.Namespace, disk_dir: Path, url: str | None) -> list[dict]:
    from kvdepot.integrations.tensorrt_llm.adapter import (
        KvDepotConnectorScheduler,
        KvDepotConnectorWorker,
    )
    from kvdepot.integrations.tensorrt_llm.utils import destroy_engine
    from kvdepot.runtime import Engine, KvCacheConfig, TorchLlmArgs

    saved = {k: v for k, v in os.environ.items() if k.startswith("KVDEPOT_")}
    base = {"KVDEPOT_LOWER_TIER_HITS": "async", "KVDEPOT_CACHE_SALT": f"bench-tiers-{uuid.uuid4().hex}"}
    llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(tokens_per_block=32, max_tokens=args.prompt_tokens + 64))
    results: dict[str, list] = {}

    def engine(**env: str | None) -> Engine:
        destroy_engine()
        for k in ("KVDEPOT_DISK_PATH", "KVDEPOT_REMOTE_URL"):
            os.environ.pop(k, None)
        os.environ.update({**base, **{k: v for k, v in env.items() if v}})
        eng = Engine(args.model, llm_args=llm_args, connector=(KvDepotConnectorScheduler, KvDepotConnectorWorker), seed=0)
        eng.generate([prompt(512, 7)], 1)  # warm-up: kernels, allocator, the tiers' threads
        return eng

    def prompt(n: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(512) for _ in range(n)]  # 512: the smallest preset's vocabulary

    try:
        prompts = [prompt(args.prompt_tokens, 1000 + i) for i in range(args.prompts)]
        eng = engine(KVDEPOT_DISK_PATH=str(disk_dir), KVDEPOT_REMOTE_URL=url)  # writes host, disk and Redis
        results["recompute"] = [eng.generate([p], 1)[0] for p in prompts]
        eng.generate([prompt(eng.num_blocks * eng.tokens_per_block - 1, 99)], 1)  # evicts them from the device pool
        results["host-memory hit"] = [eng.generate([p], 1)[0] for p in prompts]
        eng = engine(KVDEPOT_DISK_PATH=str(disk_dir))  # destroy_engine drained write-behind to both tiers
        results["disk hit (async)"] = [eng.generate([p], 1)[0] for p in prompts]
        if url:
            eng = engine(KVDEPOT_REMOTE_URL=url)
            results["redis hit (async)"] = [eng.generate([p], 1)[0] for p in prompts]
    finally:
        destroy_engine()
        for k in [k for k in os.environ if k.startswith("KVDEPOT_")]:
            del os.environ[k]
        os.environ.update(saved)
    recompute = statistics.median(r.ttft_s for r in results["recompute"])
    rows = []
    for name, res in results.items():
        ttft = statistics.median(r.ttft_s for r in res)
        if name != "recompute" and any(r.num_device_reused_tokens or not r.num_connector_matched_tokens for r in res):
            raise RuntimeError(f"{name}: not served by kvdepot ({[(r.num_device_reused_tokens, r.num_connector_matched_tokens) for r in res]})")
        rows.append({"phase": name, "TTFT ms": ttft * 1e3, "min ms": min(r.ttft_s for r in res) * 1e3,
                     "max ms": max(r.ttft_s for r in res) * 1e3, "tokens from kvdepot": min(r.num_connector_matched_tokens for r in res),
                     "async load": any(r.connector_async_load for r in res), "speed-up": recompute / ttft,
                     "tokens==recompute": all(r.output_ids == c.output_ids for r, c in zip(res, results["recompute"], strict=True))})
    return rows
