"""Chunk objects: the self-describing byte form of one chunk, shared by the disk and Redis tiers.

An object is a 64-byte header followed by the payload (the chunk's exact block bytes)::

    offset  size  field
    0       4     magic b"KVDC"
    4       2     format version (2)
    6       2     flags: 0, or FLAG_ALIGNED (any other bit is rejected)
    8       16    namespace digest (``keys.Namespace.digest``: model, dtype, geometry, salt …)
    24      16    chunk key
    40      8     payload length
    48      16    checksum: xxh3_128 over header bytes [0, 48) followed by the payload
    64      n     payload                               (flags 0: Redis values)
    64      4032  zeros, then at 4096: the payload      (FLAG_ALIGNED: disk files)

Integers are little-endian. The checksum covers the identity fields and the flags as well as the
payload, so a header whose key, namespace or layout was altered fails like a flipped payload byte;
the padding of an aligned object must be zeros. An aligned object keeps its payload on a 4 KiB file
offset, so O_DIRECT moves it straight between the file and an aligned buffer. An object is served
only when magic, version, flags, namespace, key, length, padding and checksum all agree; anything
else is *corrupt* (a miss that the tier removes and counts). Version 1 objects (no aligned layout)
read as corrupt and age out.

Primitives:
    encode_header(namespace, key, payload, aligned=False) -> bytes  what precedes the payload
                                                        (64 bytes, or 4096 when aligned)
    encode(namespace, key, payload) -> bytes            header + payload as one buffer (Redis)
    read_header(head, namespace, key) -> Header | None  parse and check identity; None if foreign/garbage
    verify(header, payload) -> bool                     length and checksum of a payload
    decode(obj, namespace, key) -> memoryview | None    the verified payload of a whole object
    verify_pieces(header, pieces) -> bool               verify a payload read in consecutive pieces
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import NamedTuple

import xxhash

from kvdepot.keys import KEY_BYTES, ChunkKey

Payload = bytes | bytearray | memoryview
"""What tiers accept as a payload: any contiguous bytes-like object (never copied to hash it)."""

MAGIC = b"KVDC"
FORMAT_VERSION = 2
NAMESPACE_BYTES = 16
FLAG_ALIGNED = 1  # the payload starts at ALIGNED_OFFSET; the bytes between are zeros
ALIGNED_OFFSET = 4096  # a multiple of every logical block size O_DIRECT may ask for
_HEADER = struct.Struct("<4sHH16s16sQ16s")
HEADER_BYTES = _HEADER.size
_SIGNED = HEADER_BYTES - 16  # the checksum covers every header byte before itself
_PADDING = bytes(ALIGNED_OFFSET - HEADER_BYTES)


class Header(NamedTuple):
    length: int  # payload bytes
    checksum: bytes
    signed: bytes  # header bytes [0, 48), the checksum's prefix
    offset: int  # where the payload starts: HEADER_BYTES, or ALIGNED_OFFSET


def check_namespace(namespace: bytes) -> bytes:
    """Tiers are built for one namespace digest; refuse anything that is not 16 bytes."""
    if not isinstance(namespace, bytes) or len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"namespace must be a {NAMESPACE_BYTES}-byte digest, got {namespace!r}")
    return namespace


def _checksum(signed: bytes, payload: Payload) -> bytes:
    digest = xxhash.xxh3_128(signed)
    digest.update(payload)
    return digest.digest()


def encode_header(namespace: bytes, key: ChunkKey, payload: Payload, aligned: bool = False) -> bytes:
    """What precedes ``payload`` stored under ``key`` in ``namespace``: the 64-byte header, padded
    with zeros to ``ALIGNED_OFFSET`` bytes when ``aligned``."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"chunk key must be {KEY_BYTES} bytes, got {len(key)}")
    length = memoryview(payload).nbytes
    flags = FLAG_ALIGNED if aligned else 0
    signed = _HEADER.pack(MAGIC, FORMAT_VERSION, flags, namespace, key, length, b"")[:_SIGNED]
    head = signed + _checksum(signed, payload)
    return head + _PADDING if aligned else head


def encode(namespace: bytes, key: ChunkKey, payload: Payload) -> bytes:
    """Header and payload in one buffer (one payload copy: a Redis value must be contiguous)."""
    return b"".join((encode_header(namespace, key, payload), payload))


def read_header(head: Payload, namespace: bytes, key: ChunkKey) -> Header | None:
    """Parse an object's bytes up to its payload (``ALIGNED_OFFSET`` of them cover either layout;
    more are ignored); None unless it is ``key``'s, in ``namespace``, with zeros as padding."""
    head = memoryview(head).cast("B")
    if head.nbytes < HEADER_BYTES:
        return None
    magic, version, flags, ns, stored_key, length, checksum = _HEADER.unpack(head[:HEADER_BYTES])
    if magic != MAGIC or version != FORMAT_VERSION or flags & ~FLAG_ALIGNED or ns != namespace or stored_key != key:
        return None
    if flags & FLAG_ALIGNED:
        if head.nbytes < ALIGNED_OFFSET or bytes(head[HEADER_BYTES:ALIGNED_OFFSET]) != _PADDING:
            return None
        return Header(length, checksum, bytes(head[:_SIGNED]), ALIGNED_OFFSET)
    return Header(length, checksum, bytes(head[:_SIGNED]), HEADER_BYTES)


def verify(header: Header, payload: Payload) -> bool:
    return memoryview(payload).nbytes == header.length and verify_pieces(header, (payload,))


def verify_pieces(header: Header, pieces: Iterable[Payload]) -> bool:
    """``verify`` of a payload that arrives in consecutive pieces (checked while later pieces are
    still being read); the same checksum as over the whole."""
    digest, length = xxhash.xxh3_128(header.signed), 0
    for piece in pieces:
        digest.update(piece)
        length += memoryview(piece).nbytes
    return length == header.length and digest.digest() == header.checksum


def decode(obj: Payload, namespace: bytes, key: ChunkKey) -> memoryview | None:
    """The payload of a whole object (a view, not a copy), or None if it is not a valid one."""
    view = memoryview(obj).cast("B")
    header = read_header(view, namespace, key)
    if header is None or view.nbytes != header.offset + header.length:
        return None
    payload = view[header.offset :]
    return payload if verify(header, payload) else None
