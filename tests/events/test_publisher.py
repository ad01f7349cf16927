"""``KVEventPublisher`` on real sockets: vLLM decodes every batch, sequence numbers run from 0
without gaps, replay returns what a subscriber missed, and the bind/connect rule is vLLM's."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from event_helpers import all_events, replay, vllm_decode

from kvdepot.config import load_config
from kvdepot.errors import ConfigError
from kvdepot.events.base import EventSpace, Medium
from kvdepot.events.hashes import BlockHasher
from kvdepot.events.publisher import KVEventPublisher, is_bind_endpoint, publisher_from_config

SPACE = EventSpace("m", "", chunk_size=8, tokens_per_block=4)


def keys_for(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def announce(pub: KVEventPublisher, tag: int, n: int = 2, medium: Medium = Medium.HOST) -> list[int]:
    """Describe and store ``n`` chunks of fresh tokens; return the tokens."""
    tokens = [tag * 1000 + i for i in range(n * SPACE.chunk_size)]
    keys = keys_for(n, tag)
    pub.describe(keys, tokens, SPACE)
    pub.stored(medium, keys)
    assert pub.flush()
    return tokens


def recv(sub: zmq.Socket, timeout_ms: int = 200) -> tuple[bytes, int, bytes] | None:
    if not sub.poll(timeout_ms):
        return None
    topic, seq, payload = sub.recv_multipart()
    assert len(seq) == 8
    return topic, int.from_bytes(seq, "big"), payload


def test_subscriber_decodes_with_vllm_and_sequence_numbers_have_no_gaps(ctx, ipc_dir, no_thread_leak):
    pub = KVEventPublisher(f"ipc://{ipc_dir}/pub", topic="kv@node0", replay_endpoint="tcp://127.0.0.1:0")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    try:
        # A PUB socket drops what it sends before the subscription arrives: announce until one comes.
        tag, first = 0, None
        while first is None and tag < 50:
            tag += 1
            announce(pub, tag)
            first = recv(sub, 100)
        assert first is not None, "the subscriber never received a batch"
        seqs, batches = [first[1]], [first]
        for more in range(tag + 1, tag + 6):
            tokens = announce(pub, more)
            got = recv(sub, 2000)
            assert got is not None
            seqs.append(got[1])
            batches.append(got)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive
        topic, _seq, payload = batches[-1]
        assert topic == b"kv@node0"
        batch = vllm_decode(payload)
        assert batch.data_parallel_rank == 0 and batch.ts == pytest.approx(time.time(), abs=60)
        (stored,) = batch.events
        assert type(stored).__name__ == "BlockStored"
        assert stored.token_ids == tokens and stored.block_size == 4
        assert stored.block_hashes == BlockHasher("m").hashes(tokens, 4)  # a router recomputes them
        assert stored.parent_block_hash is None
        assert (stored.medium, stored.locality, stored.ownership) == ("CPU", "LOCAL", None)
        # Everything since 0 is still there for replay, the batches before the subscription too.
        assert [seq for _, seq, _ in replay(ctx, pub.replay_endpoint)] == list(range(seqs[-1] + 1))
        pub.close()  # the last batch says: forget what this publisher announced
        last = recv(sub, 2000)
        assert last is not None and last[1] == seqs[-1] + 1
        assert [type(e).__name__ for e in vllm_decode(last[2]).events] == ["AllBlocksCleared"]
    finally:
        sub.close(linger=0)
        pub.close()


def test_replay_returns_missed_batches_and_survives_a_malformed_request(ctx, no_thread_leak):
    pub = KVEventPublisher("inproc://kv-replay", replay_endpoint="tcp://127.0.0.1:0", buffer_batches=4)
    try:
        sent = [announce(pub, tag) for tag in range(1, 7)]  # nobody subscribed: PUB drops all six
        got = replay(ctx, pub.replay_endpoint, start=3)
        assert [seq for _, seq, _ in got] == [3, 4, 5]
        assert [vllm_decode(p).events[0].token_ids for _, _, p in got] == sent[3:]
        assert [seq for _, seq, _ in replay(ctx, pub.replay_endpoint)] == [2, 3, 4, 5]  # bounded buffer
        assert replay(ctx, pub.replay_endpoint, start=99) == []
        bad = ctx.socket(zmq.DEALER)
        bad.connect(pub.replay_endpoint)
        bad.send_multipart((b"", b"\x01\x02"))  # not 8 bytes: only the end marker comes back
        assert bad.poll(3000)
        assert bad.recv_multipart()[2] == (-1).to_bytes(8, "big", signed=True)
        bad.close(linger=0)
        assert [seq for _, seq, _ in replay(ctx, pub.replay_endpoint, start=5)] == [5]
        assert pub.stats().bad_replays == 1 and pub.stats().replays == 4
    finally:
        pub.close()


@pytest.mark.parametrize(("endpoint", "bind"), [
    ("tcp://*:5557", True), ("tcp://[::]:5557", True), ("ipc:///tmp/kv", True), ("inproc://kv", True),
    ("tcp://127.0.0.1:5557", False), ("tcp://router.example:5557", False),
])
def test_bind_or_connect_is_vllms_rule(endpoint, bind):
    assert is_bind_endpoint(endpoint) is bind


def test_a_connecting_publisher_reaches_a_bound_subscriber(ctx, no_thread_leak):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}")  # no wildcard: connects
    try:
        assert pub.endpoint == f"tcp://127.0.0.1:{port}"
        got, tag = None, 0
        while got is None and tag < 50:
            tag += 1
            announce(pub, tag)
            got = recv(sub, 100)
        assert got is not None and vllm_decode(got[2]).events[0].token_ids[0] == tag * 1000
    finally:
        sub.close(linger=0)
        pub.close()


def test_removal_clear_and_close(ctx, no_thread_leak):
    pub = KVEventPublisher("inproc://kv-close", replay_endpoint="tcp://127.0.0.1:0")
    try:
        tokens = announce(pub, 1, n=3, medium=Medium.DISK)
        pub.removed(Medium.DISK, keys_for(3, 1)[1:])
        pub.removed(Medium.HOST, keys_for(3, 1))  # never stored in host memory: nothing to say
        pub.cleared()
        events = all_events(ctx, pub)
        assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
        stored, removed, _ = events
        assert (stored.medium, stored.locality, stored.ownership) == ("STORAGE", "LOCAL", "disk")
        assert removed.block_hashes == BlockHasher("m").hashes(tokens, 4)[2:]
        assert (removed.medium, removed.locality, removed.ownership) == ("STORAGE", "LOCAL", "disk")
    finally:
        pub.close()
    pub.close()  # idempotent


def test_config_keys_and_errors(monkeypatch, ipc_dir):
    assert publisher_from_config(load_config()) is None  # off by default
    monkeypatch.setenv("KVDEPOT_KV_EVENTS_ENDPOINT", f"ipc://{ipc_dir}/env")
    monkeypatch.setenv("KVDEPOT_KV_EVENTS_TOPIC", "t")
    config = load_config()
    assert (config.kv_events_endpoint, config.kv_events_topic) == (f"ipc://{ipc_dir}/env", "t")
    pub = publisher_from_config(config)
    try:
        assert pub is not None and pub.endpoint == f"ipc://{ipc_dir}/env"
    finally:
        pub.close()
    blocker = zmq.Context.instance().socket(zmq.ROUTER)
    port = blocker.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ConfigError, match="kv_events_replay_endpoint.*cannot open"):  # address in use
            publisher_from_config(load_config(kv_events_replay_endpoint=f"tcp://127.0.0.1:{port}"))
    finally:
        blocker.close(linger=0)
    with pytest.raises(ConfigError, match="'kv_events_endpoint'.*'http://x'.*tcp://"):
        load_config(kv_events_endpoint="http://x")
    with pytest.raises(ConfigError, match="kv_events_replay_endpoint"):
        load_config(kv_events_replay_endpoint="localhost:5558")


def test_wire_structs_are_vllms(ctx):
    """Our structs and vLLM's encode to the same bytes (field order, tags, omitted defaults)."""
    from kvdepot.events import wire

    vllm = pytest.importorskip("vllm.distributed.kv_events")
    args = dict(block_hashes=[1, 2**64 - 1], parent_block_hash=7, token_ids=[1, 2], block_size=1, lora_id=None,
                medium="STORAGE", lora_name=None, locality="REMOTE", ownership="redis")
    ours = wire.KVEventBatch(1.5, [wire.BlockStored(**args), wire.BlockRemoved([3], "CPU"), wire.AllBlocksCleared()], 0)
    theirs = vllm.KVEventBatch(1.5, [vllm.BlockStored(**args), vllm.BlockRemoved([3], "CPU"), vllm.AllBlocksCleared()], 0)
    assert msgspec.msgpack.encode(ours) == msgspec.msgpack.encode(theirs)
    assert wire.decode_batch(msgspec.msgpack.encode(theirs)) == ours
