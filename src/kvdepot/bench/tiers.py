"""``kvdepot bench tiers``: the tiers below host memory against raw I/O of the same bytes, same run.

disk: DiskTier put/get_into of chunk-sized payloads from/into reused page-aligned buffers vs a ``dd``
(os.pwrite/os.preadv of the same buffers, sizes and directory, the tier's O_DIRECT choice and fsync
setting); also get (new memory per call) and put of ``bytes`` (unaligned), labelled. redis (``tiers_redis.py``): RedisTier
put/get vs redis-py SET/GET, and get_into / promote, one stream and several, vs the raw floor (RESP GET, ``recv_into``)
of the same bytes on the same server (started on a free loopback port unless --remote-url is given).
ttft: recompute vs hits from host memory, disk and Redis in the reference runtime; the lower-tier hits
in fresh engines (empty host tier) with ``lower_tier_hits=load``. Tier and raw calls alternate chunk
by chunk so a noisy neighbour's burst lands on both; GB/s come from the median time per chunk. Reads
read back what the repetition wrote: O_DIRECT bypasses the page cache; buffered files are dropped from
it first (POSIX_FADV_DONTNEED, which tmpfs ignores: the table then says the reads come from memory).
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
from typing import Any

import redis
import torch

from kvdepot.bench.common import median_seconds
from kvdepot.bench.report import Bars, Report, add_output_arguments
from kvdepot.config import load_config
from kvdepot.keys import ChunkKey
from kvdepot.storage import codec
from kvdepot.storage.disk import ALIGN, O_DIRECT, DiskTier
from kvdepot.storage.redis_tier import RedisTier

NS = bytes(range(16))
Op = Callable[[int, int], object]  # called with (repetition, chunk index)
PARTS = ("disk", "redis", "ttft", "stall")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config = load_config()
    parser.add_argument("--parts", default="disk,redis,ttft", help=f"comma-separated subset of {','.join(PARTS)} (stall: "
                        "the step loop beside write-behind, write_stall.py)")
    parser.add_argument("--chunk-mib", type=float, default=32.0, help="payload per chunk (Llama-3-8B bf16, 256 tokens: 32)")
    parser.add_argument("--chunks", type=int, default=8, help="chunks per repetition")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (after one warm-up)")
    parser.add_argument("--disk-path", default=None, help="directory to test (default: a temp dir under /tmp)")
    parser.add_argument("--o-direct", choices=("auto", "true", "false"), default=config.disk_o_direct,
                        help="O_DIRECT for the tier and the raw calls alike (default: config disk_o_direct)")
    parser.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=config.disk_fsync,
                        help="fsync each object (tier) and file (raw) before it counts (default: config disk_fsync)")
    parser.add_argument("--read-settings", default=None, metavar="MiB:DEPTH[,...]",
                        help="disk: also get_into under each read setting (piece MiB : pieces in flight), one tier each, "
                             "interleaved chunk by chunk with raw reads in this process (bench/disk_reads.py)")
    parser.add_argument("--remote-url", default=None, help="Redis URL (default: start a redis-server here); every key the "
                        "bench writes there is deleted when it ends")
    parser.add_argument("--redis-timeout", type=float, default=5.0, help="socket timeout of both Redis clients (s)")
    parser.add_argument("--streams", default=f"2,{config.promote_streams}",
                        help="redis: stream counts of the batch rows; the largest is the promote row's (default: 2 and "
                             "config promote_streams)")
    parser.add_argument("--model", default="small", help="runtime preset or checkpoint dir (TTFT part)")
    parser.add_argument("--prompt-tokens", type=int, default=2100, help="prompt length of the TTFT part")
    parser.add_argument("--prompts", type=int, default=5, help="distinct prompts per TTFT phase")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the TTFT part (0: torch's "
                        "default); 1 keeps TTFT stable when other jobs share the cores")
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> list[dict]:
    parts, size = set(args.parts.split(",")), int(args.chunk_mib * 2**20)
    if parts - set(PARTS):
        raise SystemExit(f"--parts: unknown {sorted(parts - set(PARTS))}; allowed: {', '.join(PARTS)}")
    # NOTE: imported here, as tiers_redis below: disk_reads imports this module's helpers
    from kvdepot.bench.disk_reads import parse_settings, read_settings_rows

    settings = parse_settings(args.read_settings) if getattr(args, "read_settings", None) else []
    payload = os.urandom(size)
    root = Path(tempfile.mkdtemp(prefix="kvdepot-bench-tiers-", dir=args.disk_path))
    server, url = None, args.remote_url
    redis_steps = 3 + len(set(args.streams.split(",")))  # put/get, get_into, each batch of streams, promote
    # stall times Redis too where one is given or redis-server is installed (GPU hosts have none: disk only there)
    stall_tiers = ("stall" in parts) * (1 + bool(url or shutil.which("redis-server")))
    steps = ((args.reps + 1) * ((2 + bool(settings)) * ("disk" in parts) + redis_steps * ("redis" in parts) + stall_tiers)
             + 4 * ("ttft" in parts))
    report = Report(args, steps=steps, device=torch.device("cpu") if "ttft" in parts else None, name="bench tiers",
                    bars=Bars(("tier", "op"), ("tier GB/s", "raw GB/s"), "GB/s"))
    try:
        if url is None and (parts & {"redis", "ttft"} or stall_tiers == 2):
            server, url = _start_redis(root, size, args.chunks)
        cost = {name: 1e3 * median_seconds(fn, torch.device("cpu"), 3) for name, fn in _cpu_work(payload).items()}
        if parts & {"disk", "redis"}:
            report.table(f"kvdepot bench tiers — {args.chunks} x {size / 2**20:g} MiB x {args.reps} reps; {root} on {_fs_type(root)}; "
                         f"load avg {os.getloadavg()[0]:.1f}; CPU ms per chunk: xxh3 {cost['xxh3']:.1f}, memcpy "
                         f"{cost['memcpy']:.1f}, copy to fresh memory {cost['fresh']:.1f}", op=28, reads=25)
        if "disk" in parts:
            _disk(args, root, payload, cost, report)
            if settings:
                report.table(f"disk get_into by read setting (piece MiB : pieces in flight), {args.chunks} x "
                             f"{size / 2**20:g} MiB x {args.reps} reps, each read paired with a raw read", setting=7)
                read_settings_rows(args, root, payload, settings, report)
        if "redis" in parts:
            # NOTE: imported here: tiers_redis imports this module's helpers
            from kvdepot.bench.tiers_redis import redis_rows

            redis_rows(args, url, payload, cost, report)
        if "stall" in parts:
            from kvdepot.bench.write_stall import stall_rows

            report.table(f"the step loop beside write-behind — {args.chunks} x {size / 2**20:g} MiB per round x {args.reps} reps; "
                         f"load avg {os.getloadavg()[0]:.1f}", tier=5, provider=10)
            stall_rows(args, root, url, report)
        if "ttft" in parts:
            report.table(f"TTFT — {args.model} on CPU ({args.threads or torch.get_num_threads()} threads), {args.prompt_tokens}"
                         f"-token prompts x {args.prompts}, load avg {os.getloadavg()[0]:.1f}; disk/redis hits: fresh "
                         "engine, lower_tier_hits=load", phase=15)
            _ttft(args, root / "ttft", url, report)
    finally:
        if server is not None:
            server.kill()
            server.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)
    return report.finish()


def _key() -> ChunkKey:
    return ChunkKey(uuid.uuid4().bytes)


def _check(ok: object, what: str) -> None:
    if not ok:  # a failed call would time as a fast one
        raise RuntimeError(f"bench tiers: {what}")


def _cpu_work(payload: bytes) -> dict[str, Callable[[], object]]:
    """What the tiers do beyond the raw path: a checksum, a copy into a reused buffer, and a copy into
    fresh memory (malloc + first-touch page faults, as ``bytes()``, ``b"".join`` and ``pread`` pay)."""
    key, dst = _key(), bytearray(len(payload))
    return {"xxh3": lambda: codec.encode_header(NS, key, payload), "fresh": lambda: bytes(memoryview(payload)),
            "memcpy": lambda: memoryview(dst).__setitem__(slice(None), payload)}


def _compare(args: argparse.Namespace, size: int, ops: list[tuple[str, Op, Op, float]], between: Callable[[int], object],
             cleanup: Callable[[int], object], report: Report, **more: object) -> list[dict]:
    """Rows for ops (name, tier call, raw call, CPU ms per chunk the tier spends beyond the raw call,
    from the standalone costs measured in this run). ``between`` runs untimed after each op's chunks
    but the last's, ``cleanup`` after the last; repetition 0 is a warm-up."""
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, *_ in ops}
    for rep in range(args.reps + 1):
        with report.step(f"{ops[0][0]}: {'warm-up' if rep == 0 else f'repetition {rep}'}"):
            for j, (name, tier, raw, _) in enumerate(ops):
                for i in range(args.chunks):
                    for slot, fn in [(0, tier), (1, raw)][:: 1 if (rep + i) % 2 else -1]:
                        start = time.perf_counter()
                        fn(rep, i)
                        if rep:
                            times[name][slot].append(time.perf_counter() - start)
                (cleanup if j == len(ops) - 1 else between)(rep)
    rows = []
    for name, _, _, cpu in ops:
        tier_s, raw_s = (statistics.median(t) for t in times[name])
        # ratio: of the medians; paired ratio: the median of each chunk's raw/tier, the two calls
        # made back to back. A virtual disk that runs in phases can put the two medians in
        # different phases; a pair shares one.
        paired = statistics.median(r / t for t, r in zip(*times[name], strict=True))
        rows.append({"op": name, "tier GB/s": size / tier_s / 1e9, "raw GB/s": size / raw_s / 1e9, "ratio": raw_s / tier_s,
                     "paired ratio": paired,
                     "tier ms/chunk": tier_s * 1e3, "raw ms/chunk": raw_s * 1e3, "gap ms": (tier_s - raw_s) * 1e3,
                     "extra CPU ms": cpu, **more})
    return rows


def _fs_type(path: Path) -> str:
    """The filesystem of ``path``: the longest mount point above it in /proc/mounts."""
    mounts = [line.split()[:3] for line in Path("/proc/mounts").read_text().splitlines()] if os.path.exists("/proc/mounts") else []
    real = os.path.realpath(path) + "/"
    dev, mnt, fs = max((m for m in mounts if real.startswith(m[1].rstrip("/") + "/")), key=lambda m: len(m[1]),
                       default=("?", "?", "unknown filesystem"))
    return f"{fs} ({dev} at {mnt})"


def _o_direct(args: argparse.Namespace) -> bool | None:
    """``--o-direct`` as ``DiskTier`` takes it (None: probe the directory)."""
    return {"auto": None, "true": True, "false": False}[args.o_direct]


def _raw_io(path: Path, buf: memoryview, direct: bool, write: bool, fsync: bool = False) -> int:
    fd = os.open(path, (os.O_WRONLY | os.O_CREAT | os.O_EXCL if write else os.O_RDONLY) | (O_DIRECT if direct else 0), 0o600)
    try:
        done = 0
        while done < buf.nbytes and (n := os.pwrite(fd, buf[done:], done) if write else os.preadv(fd, [buf[done:]], done)):
            done += n
        if write and fsync:
            os.fsync(fd)
        return done
    finally:
        os.close(fd)


def _drop_cache(root: Path) -> None:
    for path in (p for p in root.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        os.fdatasync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def _disk(args: argparse.Namespace, root: Path, payload: bytes, cost: dict[str, float], report: Report) -> list[dict]:
    """put and get_into move the bytes as the raw calls do: from and into reused page-aligned buffers
    (in the engine: host-arena slots, which write-behind lends in place). Labelled extras: get (new
    memory each call) and put of a ``bytes`` object (unaligned: bounced through an aligned buffer,
    as the engine's old ``tobytes()`` copies of slots were)."""
    n, size, reps = args.chunks, len(payload), range(args.reps + 1)
    tier = DiskTier(root / "tier", 4 * n * (size + 2 * ALIGN), NS, fsync=args.fsync, o_direct=_o_direct(args))
    direct = tier.o_direct
    span = -(-size // ALIGN) * ALIGN if direct else size  # O_DIRECT moves whole blocks
    # page-aligned, as O_DIRECT needs. Tier and raw calls share them: in an A/A run of raw reads on
    # the dev VM, reads into one of two identical buffers took 1.9-2.7x as long as into the other
    wbuf, rbuf = mmap.mmap(-1, span), mmap.mmap(-1, span)
    wbuf[:size] = payload
    src, dst = memoryview(wbuf)[:size], memoryview(rbuf)[:size]
    (root / "raw").mkdir()
    fs = _fs_type(root)
    source = "memory (tmpfs)" if fs.startswith("tmpfs") else "device (O_DIRECT)" if direct else "disk (page cache dropped)"

    def put(data: memoryview | bytes) -> Callable[[ChunkKey], None]:
        return lambda key: _check(tier.put(key, data), "disk put refused")

    def get_into(key: ChunkKey) -> None:
        _check(tier.get_into(key, dst) == size, "disk get_into missed a chunk it holds")

    def get(key: ChunkKey) -> None:
        _check(tier.get(key) is not None, "disk get missed a chunk it holds")

    def write(path: Path) -> None:
        _raw_io(path, memoryview(wbuf), direct, True, args.fsync)

    def read(path: Path) -> None:
        _check(_raw_io(path, memoryview(rbuf), direct, False) >= size, "short read")

    def compare(tag: str, ops: list[tuple[str, Callable[[ChunkKey], None], Callable[[Path], None], float]]) -> list[dict]:
        keys = {rep: [_key() for _ in range(n)] for rep in reps}
        paths = {rep: [root / "raw" / f"{tag}.{rep}.{i}" for i in range(n)] for rep in reps}

        def cleanup(rep: int) -> None:
            for k, p in zip(keys[rep], paths[rep], strict=True):
                tier.delete(k)
                p.unlink()

        timed: list[tuple[str, Op, Op, float]] = [
            (name, lambda r, i, f=on_tier: f(keys[r][i]), lambda r, i, f=raw: f(paths[r][i]), cpu) for name, on_tier, raw, cpu in ops]
        rows = _compare(args, size, timed, lambda rep: direct or _drop_cache(root), cleanup, report, O_DIRECT=direct,
                        fsync=args.fsync, reads=source)
        return [report.add({"tier": "disk", **row}) for row in rows]

    rows = compare("a", [  # extra CPU ms: what the tier does beyond the raw call (standalone costs of this run)
        ("put / write", put(src), write, cost["xxh3"]),
        ("get_into / read", get_into, read, cost["xxh3"]),
        ("get, new memory / read", get, read, cost["xxh3"] + cost["fresh"] - cost["memcpy"]),  # + page faults
    ])
    rows += compare("b", [("put, bytes / write", put(payload), write, cost["xxh3"] + (cost["memcpy"] if direct else 0))])
    tier.close()
    return rows


def _start_redis(root: Path, size: int, chunks: int) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    _check(binary, "redis-server not found: pass --remote-url or install it (Debian: redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bulk = max(512 << 20, 2 * (size + codec.HEADER_BYTES))  # proto-max-bulk-len (default 512 MB) caps a value
    proc = subprocess.Popen(
        [str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(root),
         "--maxmemory", str(4 * chunks * bulk + (256 << 20)), "--maxmemory-policy", "noeviction",
         "--proto-max-bulk-len", str(bulk), "--client-query-buffer-limit", str(max(1 << 30, 2 * bulk))],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, deadline = f"redis://127.0.0.1:{port}/0", time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, url
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server did not start on port {port}")


def _ttft(args: argparse.Namespace, disk_dir: Path, url: str | None, report: Report) -> list[dict]:
    """Each phase's row is added as soon as the phase ends. Every prompt's chunks are deleted from
    Redis at the end (a ``--remote-url`` is the user's server): the keys are recomputed by the
    last engine, which has the same model, salt and namespace as the one that stored them."""
    from kvdepot.integrations.tensorrt_llm.adapter import KvDepotConnectorScheduler as Sched
    from kvdepot.integrations.tensorrt_llm.adapter import KvDepotConnectorWorker as Worker
    from kvdepot.integrations.tensorrt_llm.providers import current_engine, destroy_engine
    from kvdepot.runtime import Engine, KvCacheConfig, TorchLlmArgs

    saved, threads = {k: v for k, v in os.environ.items() if k.startswith("KVDEPOT_")}, torch.get_num_threads()
    salt = f"bench-tiers-{uuid.uuid4().hex}"  # never hit what an earlier run left on disk or in Redis
    llm_args = TorchLlmArgs(kv_cache_config=KvCacheConfig(tokens_per_block=32, max_tokens=args.prompt_tokens + 64))
    made: list[list[int]] = []  # every prompt served: their chunks are what the engines stored

    def set_env(env: dict[str, str | None]) -> None:
        for k in [k for k in os.environ if k.startswith("KVDEPOT_")]:
            del os.environ[k]
        os.environ.update({k: v for k, v in env.items() if v is not None})

    def prompt(n: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        made.append([rng.randrange(512) for _ in range(n)])  # 512: the smallest preset's vocabulary
        return made[-1]

    def engine(disk: Path | None = None, remote: str | None = None) -> Engine:
        destroy_engine()  # closes the previous engine, draining its write-behind to disk/Redis
        set_env({**saved, "KVDEPOT_LOWER_TIER_HITS": "load", "KVDEPOT_CACHE_SALT": salt,
                 "KVDEPOT_DISK_PATH": disk and str(disk), "KVDEPOT_REMOTE_URL": remote})
        eng = Engine(args.model, llm_args=llm_args, connector=(Sched, Worker), seed=0)
        eng.generate([prompt(min(512, args.prompt_tokens), 7)], 1)  # warm-up: kernels, allocator, tier threads
        return eng

    prompts = [prompt(args.prompt_tokens, 1000 + i) for i in range(args.prompts)]
    phases: dict[str, list] = {}
    rows: list[dict] = []

    def phase(name: str, eng: Engine) -> None:
        with report.step(f"TTFT: {name}"):
            phases[name] = [eng.generate([p], 1)[0] for p in prompts]
        rows.append(report.add(_ttft_row(name, phases[name], phases["recompute"])))

    torch.set_num_threads(args.threads or threads)
    stored_by: list = []  # the engine that writes to Redis (its hasher and Redis key prefix)
    try:
        eng = engine(disk_dir, url)  # stores to host memory, disk and Redis
        stored_by.append(current_engine())
        phase("recompute", eng)
        eng.generate([prompt(eng.num_blocks * eng.tokens_per_block - 1, 99)], 1)  # evicts them from the pool
        current_engine().lower.flush()  # write-behind done: the host hits do not share the CPU with it
        phase("host-memory hit", eng)
        for name, where in (("disk hit", {"disk": disk_dir}), ("redis hit", {"remote": url})):
            eng = engine(**where)  # fresh: empty host tier, one lower tier
            phase(name, eng)
    finally:
        destroy_engine()  # drains the write-behind: nothing lands after the delete
        if url is not None and stored_by:
            _delete_from_redis(url, made, stored_by[0], args)
        set_env(saved)
        torch.set_num_threads(threads)
    return rows


def _ttft_row(name: str, res: list, recompute: list) -> dict:
    ms, loaded = [r.ttft_s * 1e3 for r in res], [(r.num_device_reused_tokens, r.num_connector_matched_tokens) for r in res]
    _check(name == "recompute" or all(dev == 0 and kv for dev, kv in loaded), f"{name} not served by kvdepot: {loaded}")
    base = statistics.median(r.ttft_s * 1e3 for r in recompute)
    return {"phase": name, "TTFT ms (median)": statistics.median(ms), "min": min(ms), "max": max(ms),
            "speed-up": base / statistics.median(ms), "tokens loaded": min(kv for _, kv in loaded),
            "async load": None if name == "recompute" else all(r.connector_async_load for r in res),
            "tokens==recompute": all(r.output_ids == c.output_ids for r, c in zip(res, recompute, strict=True))}


def _delete_from_redis(url: str, prompts: list[list[int]], depot: Any, args: argparse.Namespace) -> int:
    """Delete the chunks of ``prompts`` that ``depot`` (a closed CacheEngine) stored in Redis."""
    tiers = [t for t in (depot.lower.tiers if depot.lower is not None else []) if isinstance(t, RedisTier)]
    if not tiers:
        return 0
    names = [tiers[0].redis_key(k) for p in prompts for k in depot.chunk_keys(p)]
    client = redis.Redis.from_url(url, socket_timeout=args.redis_timeout, socket_connect_timeout=args.redis_timeout)
    try:
        return sum(int(client.delete(*names[i:i + 512])) for i in range(0, len(names), 512))
    finally:
        client.close()
