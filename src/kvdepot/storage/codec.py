"""Chunk objects: the self-describing byte form of one chunk, shared by the disk and Redis tiers.

An object is a 64-byte header followed by the payload (the chunk's exact block bytes)::

    offset  size  field
    0       4     magic b"KVDC"
    4       2     format version (1)
    6       2     flags (0; any other value is rejected)
    8       16    namespace digest (``keys.Namespace.digest``: model, dtype, geometry, salt …)
    24      16    chunk key
    40      8     payload length
    48      16    checksum: xxh3_128 over header bytes [0, 48) followed by the payload
    64      n     payload

Integers are little-endian. The checksum covers the identity fields as well as the payload, so
a header whose key or namespace was altered fails like a flipped payload byte. An object is
served only when magic, version, flags, namespace, key, length and checksum all agree; anything
else is *corrupt* (a miss that the tier removes and counts).

Primitives:
    encode_header(namespace, key, payload) -> bytes     the 64 header bytes of an object
    encode(namespace, key, payload) -> bytes            header + payload as one buffer (Redis)
    read_header(head, namespace, key) -> Header | None  parse and check identity; None if foreign/garbage
    verify(header, payload) -> bool                     length and checksum of a payload
    decode(obj, namespace, key) -> memoryview | None    the verified payload of a whole object
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from kvdepot.keys import KEY_BYTES, ChunkKey

Payload = bytes | bytearray | memoryview
"""What tiers accept as a payload: any contiguous bytes-like object (never copied to hash it)."""

MAGIC = b"KVDC"
FORMAT_VERSION = 1
NAMESPACE_BYTES = 16
_HEADER = struct.Struct("<4sHH16s16sQ16s")
HEADER_BYTES = _HEADER.size
_SIGNED = HEADER_BYTES - 16  # the checksum covers every header byte before itself


class Header(NamedTuple):
    length: int  # payload bytes
    checksum: bytes
    signed: bytes  # header bytes [0, 48), the checksum's prefix


def check_namespace(namespace: bytes) -> bytes:
    """Tiers are built for one namespace digest; refuse anything that is not 16 bytes."""
    if not isinstance(namespace, bytes) or len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"namespace must be a {NAMESPACE_BYTES}-byte digest, got {namespace!r}")
    return namespace


def _checksum(signed: bytes, payload: Payload) -> bytes:
    digest = xxhash.xxh3_128(signed)
    digest.update(payload)
    return digest.digest()


def encode_header(namespace: bytes, key: ChunkKey, payload: Payload) -> bytes:
    """The header of ``payload`` stored under ``key`` in ``namespace``."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"chunk key must be {KEY_BYTES} bytes, got {len(key)}")
    length = memoryview(payload).nbytes
    signed = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, namespace, key, length, b"")[:_SIGNED]
    return signed + _checksum(signed, payload)


def encode(namespace: bytes, key: ChunkKey, payload: Payload) -> bytes:
    """Header and payload in one buffer (one payload copy: a Redis value must be contiguous)."""
    return b"".join((encode_header(namespace, key, payload), payload))


def read_header(head: Payload, namespace: bytes, key: ChunkKey) -> Header | None:
    """Parse the first ``HEADER_BYTES`` of an object; None unless it is ``key``'s, in ``namespace``."""
    head = memoryview(head)[:HEADER_BYTES]
    if head.nbytes < HEADER_BYTES:
        return None
    magic, version, flags, ns, stored_key, length, checksum = _HEADER.unpack(head)
    if magic != MAGIC or version != FORMAT_VERSION or flags or ns != namespace or stored_key != key:
        return None
    return Header(length, checksum, bytes(head[:_SIGNED]))


def verify(header: Header, payload: Payload) -> bool:
    return memoryview(payload).nbytes == header.length and _checksum(header.signed, payload) == header.checksum


def decode(obj: Payload, namespace: bytes, key: ChunkKey) -> memoryview | None:
    """The payload of a whole object (a view, not a copy), or None if it is not a valid one."""
    view = memoryview(obj)
    header = read_header(view, namespace, key)
    if header is None or view.nbytes != HEADER_BYTES + header.length:
        return None
    payload = view[HEADER_BYTES:]
    return payload if verify(header, payload) else None
