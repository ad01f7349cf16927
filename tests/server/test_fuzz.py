"""10,000 bad inputs against one server subprocess: each gets an error reply (or, for an oversized
frame, a dropped connection); the server never crashes or hangs and the cache is unchanged.

Besides random and truncated bytes the inputs know the protocol: bodies past their op's bound,
lists far longer than any request, every field of every request given a value of another type,
other sessions' ids (leases named without their token), and absurd geometries registered by a
session of their own. Meanwhile a bystander engine looks up its prompt without pause: it must
miss nothing, and the server's RSS must stay bounded."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
from client_proc import BLOCKS, prompt
from mp_helpers import (
    CHUNK,
    DTYPE,
    POOL_SHAPE,
    TOKENS_PER_BLOCK,
    make_pool,
    start_server,
    stats,
    stop_server,
)

from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.client import DepotClient
from kvdepot.server.remote import RemoteEngine

pytestmark = pytest.mark.timeout(120)

TOTAL = 10_000
OVERSIZED = 5
BATCH = 250
BPB = 2 * 2 * POOL_SHAPE[3] * 2  # bytes per block of the test geometry
FRAME_MB = 4  # the server's --max-frame-mb
ABSURD = 40  # REGISTERs of absurd geometry, each followed by a STORE and a RETRIEVE
FLOOD = 12  # model ids that each store more than the whole host budget (10.5 MB of 10)
RSS_GROWTH_MB = 128  # over the 10,000 inputs: frames in flight, decoded lists, allocator slack
FLOOD_GROWTH_MB = 48  # over the flood: the 10 MB host budget and slack; 12 full budgets would be 126


def _register(model: str, **changes) -> p.Register:
    fields = dict(model_id=model, tp_rank=0, tp_size=1, tokens_per_block=TOKENS_PER_BLOCK, num_blocks=POOL_SHAPE[0],
                  num_layers=2, kv_factor=2, block_elems=POOL_SHAPE[3], dtype="bfloat16", bytes_per_block=BPB,
                  pool=p.BytesPool())
    fields.update(changes)
    return p.Register(**fields)


def _frames(op: int, msg: msgspec.Struct, payloads=(), req_id: int = 1) -> list[bytes]:
    return [bytes(f) for f in w.request_frames(op, req_id, msg, payloads)]


class Fuzzer:
    """Seeded generators of bad requests, one kind after another."""

    def __init__(self, seed: int, victim_session: int = 1) -> None:
        self.rng = random.Random(seed)
        self.victim_session = victim_session
        self.kinds = [self.random_bytes, self.truncated, self.unknown_op, self.wrong_version,
                      self.bad_payload, self.unknown_request, self.bad_fields, self.bad_register,
                      self.oversized, self.wrong_types, self.other_sessions]

    def keys(self, n: int) -> bytes:
        return self.rng.randbytes(16 * n)

    def templates(self) -> list[list[bytes]]:
        r = self.rng
        return [
            _frames(p.Op.HELLO, p.Hello(p.PROTOCOL_VERSION, "x")),
            _frames(p.Op.LOOKUP, p.Lookup(r.randrange(1 << 40), self.keys(3))),
            _frames(p.Op.STORE, p.Store(self.keys(1), [0, 1]), [r.randbytes(2 * BPB)]),
            _frames(p.Op.RETRIEVE, p.Retrieve(self.keys(2), [0, 1, 2, 3], 1, 2)),
            _frames(p.Op.REGISTER, _register("fuzz")),
            _frames(p.Op.STATS, p.GetStats()),
        ]

    def random_bytes(self) -> list[bytes]:
        return [self.rng.randbytes(self.rng.randrange(0, 64)) for _ in range(self.rng.randrange(1, 5))]

    def truncated(self) -> list[bytes]:
        frames = self.rng.choice(self.templates())
        if len(frames) > 2 and self.rng.random() < 0.3:
            return frames[:-1]  # a STORE without its payload
        i = self.rng.randrange(min(len(frames), 2 if len(frames) == 2 else 3))
        frames[i] = frames[i][: self.rng.randrange(len(frames[i]))]
        return frames

    def unknown_op(self) -> list[bytes]:
        op = self.rng.choice([0, 11, 12, 99, 255, 1 << 20, (1 << 63) - 1])
        return [w.encode(p.RequestHeader(op, self.rng.randrange(1 << 30))), self.rng.randbytes(8)]

    def wrong_version(self) -> list[bytes]:
        version = self.rng.choice([0, 2, 3, 99, 1 << 31, -1])
        return _frames(p.Op.HELLO, p.Hello(version, "old-or-new"))

    def bad_payload(self) -> list[bytes]:
        n = self.rng.randrange(1, 4)
        size = self.rng.choice([0, 1, n * BPB - 1, n * BPB + 1, 900_000])
        payloads = [self.rng.randbytes(size)] * self.rng.choice([1, 1, 2])
        if self.rng.random() < 0.2:
            payloads = []
        return _frames(p.Op.STORE, p.Store(self.keys(n // 2 or 1), list(range(2 * n)) if n * BPB == size else list(range(n))), payloads)

    def unknown_request(self) -> list[bytes]:
        rid = self.rng.randrange(1 << 62)
        choice = self.rng.randrange(3)
        if choice == 0:
            return _frames(p.Op.QUERY_PREFETCH_STATUS, p.QueryPrefetch(rid))
        if choice == 1:
            return _frames(p.Op.RELEASE, p.Release(rid))
        return _frames(p.Op.RETRIEVE, p.Retrieve(self.keys(2), [0, 1, 2, 3], 0, None, rid, rid))

    def bad_fields(self) -> list[bytes]:
        r = self.rng
        junk = r.choice([[], {}, "x", -1, (1 << 64) - 1, -(1 << 63), [b"a", "b"], {"keys": 5}, [1.5, None], [[1] * 5]])
        choice = r.randrange(5)
        if choice == 0:
            op = r.choice([op for op in p.Op if op != p.Op.END_SESSION])  # [] is a valid END_SESSION
            return [w.encode(p.RequestHeader(op, r.randrange(1 << 30))), msgspec.msgpack.encode(junk)]
        if choice == 1:
            return _frames(p.Op.LOOKUP, p.Lookup(1, r.randbytes(r.choice([1, 15, 17, 33]))))
        if choice == 2:
            return [w.encode(p.RequestHeader(p.Op.LOOKUP, 1)), msgspec.msgpack.encode([1, b"", [-1, 1 << 40], 0])]
        if choice == 3:
            ids = r.choice([[-1, 0], [1 << 40], [0, 0], []])
            return _frames(p.Op.STORE, p.Store(self.keys(1), ids), [b"\0" * (len(ids) * BPB)])
        return _frames(p.Op.RETRIEVE, p.Retrieve(self.keys(2), [0, 1, 2, 3], r.choice([-5, 1 << 40]), r.choice([-1, None])))

    def bad_register(self) -> list[bytes]:
        r = self.rng
        change = r.choice([
            {"tp_rank": 3}, {"tp_size": 0}, {"dtype": "load"}, {"dtype": "complex64"}, {"num_blocks": -1},
            {"bytes_per_block": BPB + 1}, {"kv_factor": 3}, {"tokens_per_block": 7},
            {"pool": p.ShmPool(f"/nonexistent/{r.randrange(1 << 30)}")}, {"num_layers": 1 << 20},
            {"pool": p.CudaIpcPool(r.randbytes(64), 0, 1 << 20, "GPU-x")}, {"block_elems": POOL_SHAPE[3] * 2, "bytes_per_block": 2 * BPB},
        ])
        return _frames(p.Op.REGISTER, _register("fuzz", **change))  # "fuzz" exists: a new geometry is refused too

    def oversized(self) -> list[bytes]:
        """Bodies past their op's bound (refused undecoded), and legal ops with huge lists."""
        r = self.rng
        choice = r.choices(range(5), weights=[12, 4, 2, 1, 1])[0]  # huge lists are slow to build: rarer
        if choice == 0:  # a small op's body, a long list: past its 64-byte bound
            op = r.choice([p.Op.PING, p.Op.RELEASE, p.Op.QUERY_PREFETCH_STATUS, p.Op.END_SESSION, p.Op.STATS])
            return [w.encode(p.RequestHeader(op, r.randrange(1 << 30))), msgspec.msgpack.encode([0] * r.randrange(40, 20_000))]
        if choice == 1:  # a HELLO with a name of 100 KB
            return _frames(p.Op.HELLO, p.Hello(p.PROTOCOL_VERSION, "x" * 100_000))
        if choice == 2:  # 5,000 layer events: past REGISTER's bound
            pool = p.CudaIpcPool(b"h" * 64, 0, 1 << 20, "GPU-x", b"e" * 64, b"f" * 64, tuple([b"l" * 64] * 5000))
            return _frames(p.Op.REGISTER, _register("fuzz", pool=pool))
        if choice == 3:  # 600,000 tokens: legal, decoded on the pool, hashed there; 3M: refused by count
            return _frames(p.Op.LOOKUP, p.Lookup(r.randrange(1 << 40), b"", [r.randrange(1 << 7)] * r.choice([600_000, 3_000_000])))
        ids = [r.randrange(1 << 7)] * r.choice([300_000, 3_000_000])  # block ids for blocks never sent; too many
        return _frames(p.Op.RETRIEVE if r.random() < 0.5 else p.Op.STORE, p.Retrieve(self.keys(2), ids)
                       if r.random() < 0.5 else p.Store(self.keys(2), ids))[:2]

    def wrong_types(self) -> list[bytes]:
        """A valid request of any op with one field replaced by a value of another type."""
        r = self.rng
        valid = {
            p.Op.HELLO: p.Hello(p.PROTOCOL_VERSION, "x", 1), p.Op.REGISTER: _register("fuzz"),
            p.Op.LOOKUP: p.Lookup(1, self.keys(2), [1, 2], 0), p.Op.QUERY_PREFETCH_STATUS: p.QueryPrefetch(1),
            p.Op.STORE: p.Store(self.keys(1), [0, 1], 0, False), p.Op.RETRIEVE: p.Retrieve(self.keys(1), [0, 1], 0, 2, 0, 1),
            p.Op.RELEASE: p.Release(1),
        }
        op = r.choice(list(valid))
        msg = valid[op]
        fields = list(msgspec.structs.fields(type(msg)))
        values = {f.name: getattr(msg, f.name) for f in fields}
        victim = r.choice(fields).name
        values[victim] = r.choice(["str", b"bytes", 1.5, -1, (1 << 64) - 1, None, True, [1, "a"], {"k": 1}, [[0]], {}])
        values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in values.items()}
        if isinstance(msg, (p.Hello, p.Register)):  # map-encoded
            body = msgspec.msgpack.encode({k: (msgspec.to_builtins(v) if isinstance(v, msgspec.Struct) else v)
                                           for k, v in values.items()})
        else:
            body = msgspec.msgpack.encode([values[f.name] for f in fields])
        return [w.encode(p.RequestHeader(op, r.randrange(1 << 30))), body]

    def other_sessions(self) -> list[bytes]:
        """Another session's leases named without (or with a wrong) token: refused, nothing changes."""
        r = self.rng
        owner = r.choice([self.victim_session, self.victim_session + 1, 1, 2, r.randrange(1, 64)])
        rid = r.choice([1, 2, 3, r.randrange(1 << 62)])
        token = r.choice([b"", r.randbytes(16), b"\0" * 16])
        return _frames(p.Op.RETRIEVE, p.Retrieve(self.keys(5), list(range(10)), 0, None, owner, rid, lease_token=token))

    def __call__(self, i: int) -> list[bytes]:
        return self.kinds[i % len(self.kinds)]()


def _raw(ctx: zmq.Context, url: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(url)
    return sock


def _call(sock: zmq.Socket, frames: list[bytes], timeout_ms: int = 5000) -> list[bytes]:
    sock.send_multipart(frames)
    assert sock.poll(timeout_ms), "no reply"
    return sock.recv_multipart()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Bystander(threading.Thread):
    """An engine that looks up its stored prompt again and again: every lookup must hit in full."""

    def __init__(self, engine: RemoteEngine, keys: list[bytes], expected: int) -> None:
        super().__init__(name="bystander", daemon=True)
        self.engine, self.keys, self.expected = engine, keys, expected
        self.stop, self.hits, self.misses = threading.Event(), 0, 0

    def run(self) -> None:
        lease = 1 << 20
        while not self.stop.is_set():
            lease += 1
            if self.engine.lookup(self.keys, lease=lease) == self.expected:
                self.hits += 1
            else:
                self.misses += 1
            self.engine.release(lease)
            time.sleep(0.005)


def _absurd(sock: zmq.Socket, rng: random.Random, n: int) -> list[int]:
    """REGISTER an absurd (but self-consistent) geometry, then STORE and RETRIEVE in it."""
    layers, elems = rng.choice([(4096, 1 << 20), (1, 1 << 31), (4096, 1 << 31), (512, 1 << 16)])
    tpb = rng.choice([1, 8, 16])
    bpb = 2 * layers * elems * 2
    msg = _register(f"absurd-{n}", tokens_per_block=tpb, num_blocks=rng.choice([1, 1 << 31]), num_layers=layers,
                    block_elems=elems, bytes_per_block=bpb, tp_size=rng.choice([1, 4096]))
    statuses = [w.parse_reply_header(_call(sock, _frames(p.Op.REGISTER, msg))[0]).status]
    keys = rng.randbytes(16 * 2)
    for frames in (_frames(p.Op.STORE, p.Store(keys, [0, 1]), [b"\0" * 64]),
                   _frames(p.Op.RETRIEVE, p.Retrieve(keys, [0, 1, 2, 3]))):
        statuses.append(w.parse_reply_header(_call(sock, frames)[0]).status)
    return statuses


def _flood(sock: zmq.Socket, rng: random.Random, n: int) -> None:
    """A new model id that stores 21 chunks of 512 KiB: more than the server's whole host budget."""
    elems = 1 << 15  # blocks of 256 KiB, chunks of 2 blocks
    bpb = 2 * 2 * elems * 2
    msg = _register(f"flood-{n}", num_blocks=64, block_elems=elems, bytes_per_block=bpb)
    assert w.parse_reply_header(_call(sock, _frames(p.Op.REGISTER, msg))[0]).status == 0
    for _ in range(3):
        payload = rng.randbytes(14 * bpb)
        reply = _call(sock, _frames(p.Op.STORE, p.Store(rng.randbytes(16 * 7), list(range(14))), [payload]))
        assert w.parse_reply_header(reply[0]).status == 0


def test_ten_thousand_bad_inputs(workdir):
    url = f"ipc://{workdir}/fz.sock"
    proc = start_server(url, "--max-frame-mb", str(FRAME_MB), "--session-timeout-s", "60")
    ctx = zmq.Context()
    victim_client = DepotClient(url, timeout_s=5.0, heartbeat_s=0.5, name="victim")
    bystander = None
    try:
        pool = make_pool("shm", workdir, seed=5)
        victim = RemoteEngine(victim_client, pool, TOKENS_PER_BLOCK, model_id="victim", mode="shm")
        keys = victim.chunk_keys(prompt(5))
        victim.store(keys, list(range(BLOCKS))).wait()
        assert victim.lookup(keys, lease=7) == 5 * CHUNK  # a lease the fuzz names without its token
        before = next(s for s in stats(victim_client).shards if s.group == "victim").figures

        anon, session, churn = _raw(ctx, url), _raw(ctx, url), _raw(ctx, url)  # no HELLO / a bytes pool / absurd ones
        for sock in (session, churn):
            assert w.parse_reply_header(_call(sock, _frames(p.Op.HELLO, p.Hello(p.PROTOCOL_VERSION, "fuzz")))[0]).status == 0
        assert w.parse_reply_header(_call(session, _frames(p.Op.REGISTER, _register("fuzz")))[0]).status == 0
        rss_before = _rss_mb(proc.pid)
        # NOTE: a generous timeout: on a loaded 2-core CI machine a slow answer is not what this
        # checks; a lost one (an error, a dead or stalled loop, a dropped session) is.
        bystander = Bystander(RemoteEngine(DepotClient(url, timeout_s=20.0, heartbeat_s=0.5, name="bystander"),
                                           pool, TOKENS_PER_BLOCK, model_id="victim", mode="bytes"), keys, 5 * CHUNK)
        bystander.start()

        fuzzer, started = Fuzzer(20240601, victim_client.session_id), time.monotonic()
        statuses: dict[int, int] = {}
        sent = 0
        while sent < TOTAL - OVERSIZED:
            batch = min(BATCH, TOTAL - OVERSIZED - sent)
            counts = {anon: 0, session: 0}
            for frames in (_frames(p.Op.HELLO, p.Hello(p.PROTOCOL_VERSION, "fuzz")), _frames(p.Op.REGISTER, _register("fuzz"))):
                _call(session, frames)  # registered again: a fuzzed HELLO may have replaced its session
            for i in range(sent, sent + batch):
                sock = anon if i % 3 == 0 else session
                sock.send_multipart(fuzzer(i))
                counts[sock] += 1
            for sock, expected in counts.items():
                for _ in range(expected):
                    assert sock.poll(10_000), f"no reply within 10 s (case {sent}..{sent + batch})"
                    reply = sock.recv_multipart()
                    status = w.parse_reply_header(reply[0]).status
                    assert status == 0 or status in p.ErrorCode._value2member_map_
                    statuses[status] = statuses.get(status, 0) + 1
            sent += batch
            assert proc.poll() is None, "server died"
        # A fuzzed HELLO may have given the anonymous socket a session, and a valid REGISTER of another
        # model id (a wrong_types case) a group: end it, and leave the session on "fuzz", so only
        # groups the server should have freed can be left below.
        _call(anon, _frames(p.Op.END_SESSION, p.EndSession()))
        assert w.parse_reply_header(_call(session, _frames(p.Op.REGISTER, _register("fuzz")))[0]).status == 0
        for _ in range(OVERSIZED):  # a frame past --max-frame-mb: ZMQ drops the connection, no reply
            big = _raw(ctx, url)
            big.send_multipart(_frames(p.Op.STORE, p.Store(b"", [0]), [b"\0" * ((FRAME_MB + 1) << 20)]))
            assert not big.poll(300)
            big.close(0)
        absurd = [status for n in range(ABSURD) for status in _absurd(churn, fuzzer.rng, n)]
        rss_inputs = _rss_mb(proc.pid)
        for n in range(FLOOD):
            _flood(churn, fuzzer.rng, n)
        assert all(s == 0 or s in p.ErrorCode._value2member_map_ for s in absurd), absurd
        assert p.ErrorCode.INTERNAL not in absurd, absurd
        elapsed = time.monotonic() - started
        bystander.stop.set()
        bystander.join(10)
        rss_after = _rss_mb(proc.pid)
        print(f"bystander: {bystander.hits} hits, {bystander.misses} misses; server RSS {rss_before:.0f} MB, "
              f"{rss_inputs:.0f} after the inputs, {rss_after:.0f} after the flood")
        assert bystander.hits > 0 and bystander.misses == 0
        assert rss_inputs - rss_before < RSS_GROWTH_MB, (rss_before, rss_inputs)
        assert rss_after - rss_inputs < FLOOD_GROWTH_MB, (rss_inputs, rss_after)
        groups = {s.group for s in stats(victim_client).shards}
        # Idle groups are freed at the next new model: victim, fuzz, the churn session's group and
        # the one it left last (idle, until another model registers) stay; 50 others are gone.
        assert groups <= {"victim", "fuzz", f"flood-{FLOOD - 2}", f"flood-{FLOOD - 1}"}, groups
        print(f"{TOTAL} inputs in {elapsed:.1f} s; replies by status: {statuses}")
        assert elapsed < 60, f"{elapsed:.1f} s"
        assert sum(statuses.values()) == TOTAL - OVERSIZED
        assert statuses.get(0, 0) < TOTAL // 8, statuses  # the odd valid RELEASE/RETRIEVE only
        for code in (p.ErrorCode.BAD_MESSAGE, p.ErrorCode.UNKNOWN_OP, p.ErrorCode.VERSION_MISMATCH,
                     p.ErrorCode.BAD_PAYLOAD, p.ErrorCode.UNKNOWN_REQUEST, p.ErrorCode.NO_SESSION,
                     p.ErrorCode.BAD_REQUEST, p.ErrorCode.GEOMETRY_MISMATCH):
            assert statuses.get(code, 0) > 0, (code, statuses)
        assert statuses.get(p.ErrorCode.INTERNAL, 0) == 0, statuses  # every bad input is named as such

        # Still serving, and the victim's cache is exactly as it was.
        assert proc.poll() is None
        assert w.parse_reply_header(_call(session, _frames(p.Op.PING, p.Ping()))[0]).status == 0
        after = next(s for s in stats(victim_client).shards if s.group == "victim").figures
        for key in ("host_chunks", "stored_chunks", "bytes_stored", "evictions", "dropped_stores"):
            assert after[key] == before[key], key
        assert after["live_leases"] == before["live_leases"]  # lease 7 stands: nobody dropped it without the token
        expected = pool[:BLOCKS].clone()
        dst = list(range(16, 16 + BLOCKS))
        assert victim.lookup(keys, lease=1) == 5 * CHUNK
        assert victim.retrieve(keys, dst, lease=1) == 5 * CHUNK
        assert torch.equal(pool[dst], expected)
        assert pool.dtype == DTYPE
        anon.close(0)
        session.close(0)
    finally:
        if bystander is not None:
            bystander.stop.set()
            bystander.join(10)
            bystander.engine.client.close()
        victim_client.close()
        ctx.destroy(linger=0)
        stop_server(proc)
