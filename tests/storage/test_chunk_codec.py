"""The chunk object format: round trips, and any damage or foreign identity is rejected."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.keys import ChunkKey, Namespace
from kvdepot.storage import codec

NS = Namespace("m", "float16", (2, 2, 64, 2, 16), 32).digest()
KEY = ChunkKey(b"k" * 16)


def test_header_layout() -> None:
    head = codec.encode_header(NS, KEY, b"abc")
    assert len(head) == codec.HEADER_BYTES == 64
    assert head[:4] == codec.MAGIC and head[8:24] == NS and head[24:40] == KEY
    assert int.from_bytes(head[40:48], "little") == 3
    assert head[4:8] == bytes([3, 0, 0, 0])  # version 3, flags 0 (Redis values)


def test_aligned_header_layout() -> None:
    """Disk files: the same header with FLAG_ALIGNED, zeros to 4 KiB, the payload at 4096."""
    head = codec.encode_header(NS, KEY, b"abc", aligned=True)
    assert len(head) == codec.ALIGNED_OFFSET == 4096
    assert head[4:8] == bytes([3, 0, codec.FLAG_ALIGNED, 0]) and head[64:] == bytes(4096 - 64)
    header = codec.read_header(head, NS, KEY)
    assert header is not None and (header.offset, header.length) == (4096, 3)
    assert codec.read_header(head[:64], NS, KEY) is None  # the padding is part of the header block
    assert codec.decode(head + b"abc", NS, KEY) == b"abc"
    assert codec.encode_header(NS, KEY, b"abc") != head[:64]  # the flag is signed


def test_a_value_is_the_header_then_the_payload_whatever_its_buffer() -> None:
    """A Redis value from a lent host slot (any contiguous buffer, here 2-D uint16) is the same
    bytes as from ``bytes``, and decodes to them."""
    slot = np.arange(24, dtype=np.uint16).reshape(3, 8)
    data = slot.tobytes()
    value = codec.encode(NS, KEY, memoryview(slot))
    assert bytes(value) == codec.encode_header(NS, KEY, data) + data == bytes(codec.encode(NS, KEY, data))
    assert codec.decode(value, NS, KEY) == data
    assert bytes(codec.encode(NS, KEY, b"")) == codec.encode_header(NS, KEY, b"")


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=300), where=st.integers(min_value=0), bit=st.integers(0, 7), aligned=st.booleans())
def test_round_trip_and_any_flip_is_rejected(data: bytes, where: int, bit: int, aligned: bool) -> None:
    obj = codec.encode_header(NS, KEY, data, aligned) + data if aligned else codec.encode(NS, KEY, data)
    assert codec.decode(obj, NS, KEY) == data
    damaged = bytearray(obj)
    damaged[where % len(obj)] ^= 1 << bit
    assert codec.decode(bytes(damaged), NS, KEY) is None


@pytest.mark.parametrize(
    "obj",
    [
        codec.encode(bytes(16), KEY, b"payload"),  # another namespace
        codec.encode(NS, ChunkKey(b"j" * 16), b"payload"),  # another key
        codec.encode(NS, KEY, b"payload")[:-1],  # truncated
        bytes(codec.encode(NS, KEY, b"payload")) + b"x",  # trailing bytes
        b"short",
    ],
)
def test_foreign_or_malformed_objects(obj: bytes) -> None:
    assert codec.decode(obj, NS, KEY) is None


def _with(obj: bytes, version: int | None = None, flags: int | None = None) -> bytes:
    raw = bytearray(obj)
    if version is not None:
        struct.pack_into("<H", raw, 4, version)
    if flags is not None:
        struct.pack_into("<H", raw, 6, flags)
    return bytes(raw)


def test_other_versions_and_flags_are_refused_before_the_checksum() -> None:
    """An object of another format version (v1: before the aligned layout; v2: one xxh3 pass over
    the payload) or with an unknown flag is foreign: refused by ``read_header`` itself, never
    parsed with today's layout."""
    obj = codec.encode(NS, KEY, b"payload")
    aligned = codec.encode_header(NS, KEY, b"payload", aligned=True) + b"payload"
    for bad in (_with(obj, version=1), _with(obj, version=2), _with(obj, version=4), _with(obj, flags=2),
                _with(aligned, flags=3)):
        assert codec.read_header(bad, NS, KEY) is None and codec.decode(bad, NS, KEY) is None


def test_a_version_2_object_is_refused_though_its_checksum_holds() -> None:
    """What version 2 wrote (xxh3_128 over the signed bytes and the payload in one pass) does not
    pass for version 3 with its version field rewritten: the two checksums differ."""
    data = bytes(range(256)) * 9
    obj = bytearray(codec.encode(NS, KEY, data))
    struct.pack_into("<H", obj, 4, 2)
    obj[48:64] = xxhash.xxh3_128(bytes(obj[:48]) + data).digest()  # a valid v2 object
    assert codec.decode(bytes(obj), NS, KEY) is None
    struct.pack_into("<H", obj, 4, 3)
    obj[48:64] = xxhash.xxh3_128(bytes(obj[:48]) + data).digest()
    assert codec.decode(bytes(obj), NS, KEY) is None  # v3's field over a v2 checksum


def test_the_checksum_is_over_the_digests_of_the_payloads_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The format's definition, computed here independently: xxh3_128 over the signed header bytes
    and each ``HASH_BLOCK`` of the payload's xxh3_128 digest, the last block short."""
    monkeypatch.setattr(codec, "HASH_BLOCK", 64)
    data = bytes(range(200))
    head = codec.encode_header(NS, KEY, data)
    blocks = [data[0:64], data[64:128], data[128:192], data[192:200]]
    assert head[48:64] == xxhash.xxh3_128(head[:48] + b"".join(xxhash.xxh3_128(b).digest() for b in blocks)).digest()
    assert codec.block_digests(data) == codec.block_digests(data[:128]) + codec.block_digests(data[128:])
    header = codec.read_header(head, NS, KEY)
    assert header is not None
    digests = codec.block_digests(data)
    assert codec.verify_digests(header, digests, 200)
    assert not codec.verify_digests(header, digests[:-16], 200)  # a block missing
    assert not codec.verify_digests(header, digests[:-16], 192)  # ... and the length short with it
    assert not codec.verify_digests(header, digests[16:] + digests[:16], 200)  # blocks out of order
    tagged = codec.read_header(codec.encode_header(NS, KEY, data, tag_key=codec.tag_key("s")), NS, KEY, codec.tag_key("s"))
    assert tagged is not None and not codec.verify_digests(tagged, digests, 200)  # a tag covers the payload itself


def test_identity_checks() -> None:
    with pytest.raises(ValueError):
        codec.check_namespace(b"x" * 15)
    with pytest.raises(ValueError):
        codec.encode_header(NS, ChunkKey(b"k"), b"")
