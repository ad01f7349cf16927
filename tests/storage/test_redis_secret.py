"""Authenticated Redis values (``remote_secret``): whoever can write to Redis but lacks the secret
cannot make a value the tier serves; every chunk's value is bound to its own key."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from kvdepot.keys import ChunkKey
from kvdepot.storage import codec
from kvdepot.storage.redis_tier import RedisTier

if TYPE_CHECKING:
    from redis_server import RedisServer

NS = bytes(range(16))


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def payload(i: int, n: int = 3000) -> bytes:
    return bytes((i * 13 + j) % 251 for j in range(n))


def test_tagged_round_trip(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, NS, secret="s3cret")
    assert tier.put(key(1), payload(1)) and tier.get(key(1)) == payload(1)
    raw = redis_server.client().get(tier.redis_key(key(1)))
    assert isinstance(raw, bytes) and struct.unpack_from("<H", raw, 6)[0] == codec.FLAG_KEYED
    assert raw[48:64] != codec.encode(NS, key(1), payload(1))[48:64]  # a tag, not the plain checksum
    s = tier.stats()
    assert (s.hits, s.forged, s.corrupt, s.bytes_read, s.bytes_written) == (1, 0, 0, 3000, 3000)
    tier.close()


def test_a_value_forged_without_the_secret_is_a_miss(redis_server: RedisServer) -> None:
    """The poisoning of issue 17 item 8: a well-formed value with a valid checksum, written by
    someone with write access to Redis, for a chunk the victim will look up."""
    plain, tagged = RedisTier(redis_server.url, NS), RedisTier(redis_server.url, NS, secret="s3cret")
    client, name = redis_server.client(), tagged.redis_key(key(2))
    poison = codec.encode(NS, key(2), payload(99))  # anyone can compute an xxh3
    client.set(name, poison)
    assert plain.get(key(2)) == payload(99)  # without a secret this is served: the checksum is no MAC
    client.set(name, poison)
    assert tagged.get(key(2)) is None and client.exists(name) == 0  # refused and removed
    s = tagged.stats()
    assert (s.forged, s.corrupt, s.misses, s.hits) == (1, 0, 1, 0)
    plain.close()
    tagged.close()


def test_tampered_or_other_secret_values_are_refused(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, NS, secret="s3cret")
    other = RedisTier(redis_server.url, NS, secret="another")
    client = redis_server.client()
    assert tier.put(key(1), payload(1))
    good = client.get(tier.redis_key(key(1)))
    assert isinstance(good, bytes)
    renamed = bytearray(good)  # the same bytes relabelled for chunk 2: its tag covers the key
    renamed[24:40] = key(2)
    client.set(tier.redis_key(key(2)), bytes(renamed))
    assert tier.get(key(2)) is None
    assert other.get(key(1)) is None and other.stats().forged == 1  # another deployment's secret
    flipped = bytearray(good)  # one payload bit, under its own name
    flipped[codec.HEADER_BYTES + 7] ^= 1
    client.set(tier.redis_key(key(1)), bytes(flipped))
    assert tier.get(key(1)) is None
    downgraded = bytearray(good)  # the tag bit cleared: the value claims to be a plain one
    struct.pack_into("<H", downgraded, 6, 0)
    client.set(tier.redis_key(key(1)), bytes(downgraded))
    assert tier.get(key(1)) is None
    s = tier.stats()
    assert (s.forged, s.corrupt, s.hits) == (3, 0, 0)
    assert tier.put(key(1), payload(1)) and tier.get(key(1)) == payload(1)
    tier.close()
    other.close()


def test_another_chunks_value_copied_under_a_key_is_a_miss(redis_server: RedisServer) -> None:
    """With or without a secret: the header binds a value to its chunk key, so chunk 1's valid
    bytes stored under chunk 2's name are never served as chunk 2."""
    for secret in (None, "s3cret"):
        tier = RedisTier(redis_server.url, NS, secret=secret)
        client = redis_server.client()
        assert tier.put(key(1), payload(1))
        client.set(tier.redis_key(key(2)), client.get(tier.redis_key(key(1))))
        assert tier.get(key(2)) is None and tier.get(key(1)) == payload(1)
        assert tier.stats().corrupt == 1
        client.flushall()
        tier.close()


def test_a_reader_without_the_secret_refuses_tagged_values(redis_server: RedisServer) -> None:
    writer, reader = RedisTier(redis_server.url, NS, secret="s3cret"), RedisTier(redis_server.url, NS)
    assert writer.put(key(1), payload(1))
    assert reader.get(key(1)) is None and reader.stats().corrupt == 1
    writer.close()
    reader.close()
