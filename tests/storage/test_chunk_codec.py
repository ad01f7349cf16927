"""The chunk object format: round trips, and any damage or foreign identity is rejected."""

from __future__ import annotations

import pytest
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


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=300), where=st.integers(min_value=0), bit=st.integers(0, 7))
def test_round_trip_and_any_flip_is_rejected(data: bytes, where: int, bit: int) -> None:
    obj = codec.encode(NS, KEY, data)
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
        codec.encode(NS, KEY, b"payload") + b"x",  # trailing bytes
        b"short",
    ],
)
def test_foreign_or_malformed_objects(obj: bytes) -> None:
    assert codec.decode(obj, NS, KEY) is None


def test_identity_checks() -> None:
    with pytest.raises(ValueError):
        codec.check_namespace(b"x" * 15)
    with pytest.raises(ValueError):
        codec.encode_header(NS, ChunkKey(b"k"), b"")
