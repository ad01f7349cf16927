"""Every message survives the wire; malformed frames and other protocol versions get clear errors."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from kvdepot.config import load_config
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.service import DepotService

pytestmark = pytest.mark.timeout(30)

KEYS = bytes(range(32))
SAMPLES: list[msgspec.Struct] = [
    p.Hello(p.PROTOCOL_VERSION, "engine", 42),
    p.HelloReply(1, 7, 123, 99),
    p.Register("llama", 1, 2, 32, 100, 4, 2, 4096, "bfloat16", 65536,
               p.CudaIpcPool(b"h" * 64, 128, 1 << 20, "GPU-1", b"e" * 64, b"f" * 64), "salt"),
    p.Register("llama", 0, 1, 32, 100, 4, 2, 4096, "bfloat16", 65536,
               p.CudaIpcPool(b"h" * 64, 0, 1 << 20, "GPU-1", b"e" * 64, b"f" * 64, (b"1" * 64, b"2" * 64))),
    p.Register("llama", 0, 1, 32, 100, 4, 2, 4096, "float16", 65536, p.ShmPool("/dev/shm/x", 8)),
    p.Register("llama", 0, 1, 32, 100, 4, 2, 4096, "float8_e4m3fn", 32768, p.BytesPool()),
    p.RegisterReply(256, "blake3", 1000, 0, b"d" * 16, "llama"),
    p.Lookup(5, KEYS, [], 32),
    p.Lookup(6, b"", [1, 2, 3]),
    p.QueryPrefetch(5),
    p.PrefetchStatus(False, 512, 256),
    p.Store(KEYS, [3, 4, 5, 6], 123456789, True),
    p.StoreReply(2),
    p.Retrieve(KEYS, [1, 2, 3, 4], 1, 2, 9, 5, 77, True),
    p.Retrieve(KEYS, [1, 2]),
    p.Retrieve(KEYS, [1, 2], 0, None, 0, 3, 0, True, True),
    p.RetrieveReply(64, 2),
    p.RetrieveReply(64, 2, True),
    p.Retrieve(KEYS, [1, 2], by_layer=True, early=True),
    p.RetrieveReply(64, 2, True, 7, 1),
    p.Layers(7, 3),
    p.LayersReply(4),
    p.LayersReply(2, "TransferFailed: gone"),
    p.Release(5),
    p.Empty(),
    p.EndSession(),
    p.Ping(),
    p.Pong(123, 456),
    p.GetStats(),
    p.StatsReply(1, 2, "ipc:///x", 3.5, 1, 1, 0, [p.ShardStats("llama", 0, {"hits": 3.0})]),
    p.ErrorReply(p.ErrorCode.BAD_REQUEST, "nope"),
]


def test_operation_ids_are_frozen():
    assert {op.name: int(op) for op in p.Op} == {
        "HELLO": 1, "REGISTER": 2, "LOOKUP": 3, "QUERY_PREFETCH_STATUS": 4, "STORE": 5,
        "RETRIEVE": 6, "RELEASE": 7, "END_SESSION": 8, "PING": 9, "STATS": 10, "LAYERS": 11,
    }
    assert set(p.OPS) == set(p.Op)


def test_every_message_type_is_sampled():
    kinds = {spec.request for spec in p.OPS.values()} | {spec.reply for spec in p.OPS.values()}
    assert kinds <= {type(m) for m in SAMPLES}


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert w.decode(w.encode(msg), type(msg)) == msg
    if type(msg) in p.OP_OF:
        frames = w.request_frames(p.OP_OF[type(msg)], 17, msg, [b"payload"])
        header, spec, body, payloads = w.parse_request(frames)
        assert (header.req_id, body, [bytes(x) for x in payloads]) == (17, msg, [b"payload"])
        assert spec.request is type(msg)


def test_reply_frames_round_trip():
    frames = w.reply_frames(9, p.StoreReply(3), [b"x"])
    assert w.parse_reply_header(frames[0]) == p.ReplyHeader(9, 0)
    assert w.decode(frames[1], p.StoreReply) == p.StoreReply(3)
    err = w.error_frames(9, p.ErrorCode.UNKNOWN_OP, "what")
    assert w.parse_reply_header(err[0]).status == p.ErrorCode.UNKNOWN_OP
    assert w.decode(err[1], p.ErrorReply).message == "what"


@pytest.mark.parametrize("frames, code", [
    ([b"only one frame"], p.ErrorCode.BAD_MESSAGE),
    ([b"\xc1garbage", b""], p.ErrorCode.BAD_MESSAGE),
    ([w.encode(p.RequestHeader(999, 1)), b"\x90"], p.ErrorCode.UNKNOWN_OP),
    ([w.encode(p.RequestHeader(p.Op.LOOKUP, 1)), b"\x93\x01"], p.ErrorCode.BAD_MESSAGE),
    ([w.encode(p.RequestHeader(p.Op.LOOKUP, 1)), w.encode(p.Hello(1))], p.ErrorCode.BAD_MESSAGE),
])
def test_malformed_requests_are_protocol_errors(frames, code):
    with pytest.raises(p.ProtocolError) as info:
        w.parse_request(frames)
    assert info.value.code == code


def test_keys_must_be_whole():
    assert w.split_keys(KEYS) == [KEYS[:16], KEYS[16:]]
    with pytest.raises(p.ProtocolError, match="multiple of 16"):
        w.split_keys(b"x" * 17)


def test_hello_version_mismatch_is_refused_clearly():
    service = DepotService(load_config(chunk_size=16, host_capacity_gb=0.01))
    reply = service.handle(b"peer", w.request_frames(p.Op.HELLO, 3, p.Hello(p.PROTOCOL_VERSION + 1, "future")))
    header = w.parse_reply_header(reply[0])
    error = w.decode(reply[1], p.ErrorReply)
    assert (header.req_id, header.status) == (3, p.ErrorCode.VERSION_MISMATCH)
    assert f"v{p.PROTOCOL_VERSION + 1}" in error.message and f"v{p.PROTOCOL_VERSION}" in error.message
    # No session was opened: anything else still needs a HELLO.
    reply = service.handle(b"peer", w.request_frames(p.Op.PING, 4, p.Ping()))
    assert w.parse_reply_header(reply[0]).status == p.ErrorCode.NO_SESSION


def test_hello_opens_a_session():
    service = DepotService(load_config(chunk_size=16, host_capacity_gb=0.01))
    reply = service.handle(b"peer", w.request_frames(p.Op.HELLO, 1, p.Hello(p.PROTOCOL_VERSION)))
    hello = w.decode(reply[1], p.HelloReply)
    assert hello.session_id > 0 and hello.server_id == service.server_id
    pong = service.handle(b"peer", w.request_frames(p.Op.PING, 2, p.Ping()))
    assert w.decode(pong[1], p.Pong).server_id == service.server_id


def test_a_retrieve_from_before_loads_by_layer_still_decodes():
    """Fields added since (``by_layer``) trail with defaults: an older peer's message decodes."""
    old = msgspec.msgpack.encode([KEYS, [1, 2], 0, None, 0, 3, 0, True])
    assert w.decode(old, p.Retrieve).by_layer is False
    assert w.decode(msgspec.msgpack.encode([64, 2]), p.RetrieveReply).by_layer is False



def test_the_service_binds_every_operation_of_the_protocol_once():
    """One ``DepotProtocol`` method per op id, implemented by the service with the op's request
    type; the TRY_INLINE ones take ``wait`` (the loop's non-blocking attempt), the others do not."""
    import inspect
    import typing

    declared = {name for name, value in vars(p.DepotProtocol).items() if inspect.isfunction(value) and not name.startswith("_")}
    assert sorted(spec.handler for spec in p.OPS.values()) == sorted(declared)  # a bijection with the op ids
    service = DepotService(load_config(chunk_size=16, host_capacity_gb=0.01))
    try:
        table = p.bind(service)
        assert set(table) == set(p.Op)
        for op, bound in table.items():
            spec = p.OPS[op]
            assert bound.spec is spec and spec.op == op
            impl = getattr(DepotService, spec.handler)
            assert bound.run.__func__ is impl
            for owner in (p.DepotProtocol, DepotService):
                hints = typing.get_type_hints(getattr(owner, spec.handler), vars(p) | {"p": p})
                assert hints["msg"] is spec.request, (owner.__name__, spec.handler)
            takes_wait = "wait" in inspect.signature(impl).parameters
            assert takes_wait == (spec.mode is p.Exec.TRY_INLINE), spec.handler
            assert (bound.now is None) == (spec.mode is p.Exec.POOL), spec.handler
    finally:
        service.close()

    class Partial:
        def hello(self, peer, msg, payloads):  # noqa: ANN001, ANN202
            return p.Empty(), []

    with pytest.raises(TypeError, match="lacks DepotProtocol.register"):
        p.bind(Partial())  # type: ignore[arg-type]


def test_every_body_bound_fits_the_largest_legal_message():
    """``max_body`` is derived from the op's limits: the legal maximum passes, a byte more does not."""
    biggest = {
        p.Op.LOOKUP: p.Lookup((1 << 63) - 1, b"k" * 16 * p.MAX_KEYS, [(1 << 32) - 1] * p.MAX_TOKENS, (1 << 63) - 1),
        p.Op.STORE: p.Store(b"k" * 16 * p.MAX_KEYS, [(1 << 31) - 1] * p.MAX_BLOCKS, (1 << 63) - 1, True),
        p.Op.RETRIEVE: p.Retrieve(b"k" * 16 * p.MAX_KEYS, [(1 << 31) - 1] * p.MAX_BLOCKS, (1 << 63) - 1, (1 << 63) - 1,
                                  (1 << 63) - 1, (1 << 63) - 1, (1 << 63) - 1, True, True),
        p.Op.QUERY_PREFETCH_STATUS: p.QueryPrefetch((1 << 63) - 1),
        p.Op.RELEASE: p.Release((1 << 63) - 1),
        p.Op.REGISTER: p.Register("m" * 1024, 4095, 4096, 1 << 20, 1 << 31, 4096, 2, 1 << 31, "float8_e4m3fn", 1 << 36,
                                  p.CudaIpcPool(b"h" * 64, 1 << 40, 1 << 40, "GPU-" + "f" * 36, b"e" * 64, b"f" * 64,
                                                tuple([b"l" * 64] * 1024)), "s" * 1024),
    }
    for op, msg in biggest.items():
        body = w.encode(msg)
        assert len(body) <= p.OPS[op].max_body, op.name
        w.parse_header([w.encode(p.RequestHeader(op, 1)), body])
        with pytest.raises(p.ProtocolError) as info:
            w.parse_header([w.encode(p.RequestHeader(op, 1)), b"\0" * (p.OPS[op].max_body + 1)])
        assert info.value.code == p.ErrorCode.BAD_REQUEST and op.name in info.value.message
        del body, msg


def test_an_oversized_body_is_refused_before_it_is_decoded(monkeypatch):
    decoded = []
    real = w._decoders[p.Lookup]
    monkeypatch.setitem(w._decoders, p.Lookup, type("Spy", (), {"decode": lambda self, f: decoded.append(len(f)) or real.decode(f)})())
    spec = p.OPS[p.Op.LOOKUP]
    monkeypatch.setitem(p.OPS, p.Op.LOOKUP, dataclasses.replace(spec, max_body=1000))
    small = w.request_frames(p.Op.LOOKUP, 3, p.Lookup(1, b"", [7] * 900))
    assert w.parse_request(small)[2].tokens == [7] * 900
    big = w.request_frames(p.Op.LOOKUP, 4, p.Lookup(1, b"", [7] * 2000))
    with pytest.raises(p.ProtocolError) as info:
        w.parse_request(big)
    assert (info.value.code, info.value.req_id) == (p.ErrorCode.BAD_REQUEST, 4)
    assert "LOOKUP: body of" in info.value.message and "limit of 1000" in info.value.message
    assert decoded == [len(small[1])]  # the big one was never decoded


@pytest.mark.parametrize("op, msg, words", [
    (p.Op.LOOKUP, p.Lookup(1, b"", [1] * (p.MAX_TOKENS + 1)), f"{p.MAX_TOKENS + 1} tokens"),
    (p.Op.LOOKUP, p.Lookup(1, b"k" * (16 * p.MAX_KEYS + 16)), f"{16 * p.MAX_KEYS + 16} key bytes"),
    (p.Op.STORE, p.Store(b"k" * 32, [0] * (p.MAX_BLOCKS + 1)), f"{p.MAX_BLOCKS + 1} block ids"),
    (p.Op.RETRIEVE, p.Retrieve(b"k" * 32, [7] * (p.MAX_BLOCKS + 1), 3), f"{p.MAX_BLOCKS + 1} block ids"),
], ids=["tokens", "keys", "store-ids", "retrieve-ids"])
def test_a_list_longer_than_its_limit_is_refused_from_its_header(op, msg, words, monkeypatch):
    """One-byte items fit the byte bound many times over: the item count, read from the msgpack
    header before decoding, is what refuses them (a LOOKUP of 100M tokens of 1 byte each)."""
    body = w.encode(msg)
    assert len(body) <= p.OPS[op].max_body
    monkeypatch.setitem(w._decoders, type(msg), None)  # any decoding attempt would fail loudly
    with pytest.raises(p.ProtocolError) as info:
        w.parse_header([w.encode(p.RequestHeader(op, 5)), body])
    assert (info.value.code, info.value.req_id) == (p.ErrorCode.BAD_REQUEST, 5)
    assert words in info.value.message


def test_peeking_at_lengths_never_raises():
    """The header peek reads prefixes of anything: junk, truncation, maps, strings."""
    import random

    rng = random.Random(3)
    good = w.encode(p.Store(b"k" * 32, [1, 2, 3], 9, True))
    assert w._peek_lengths(memoryview(good), 2) == [32, 3]
    assert w._peek_lengths(memoryview(w.encode(p.Lookup(1, b"k" * 16, [4, 5]))), 3) == [None, 16, 2]
    for _ in range(3000):
        blob = rng.choice([rng.randbytes(rng.randrange(12)), good[: rng.randrange(len(good))]])
        assert isinstance(w._peek_lengths(memoryview(blob), 3), list)
