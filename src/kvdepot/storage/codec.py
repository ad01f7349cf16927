"""Chunk objects: the self-describing byte form of one chunk, shared by the disk and Redis tiers.

An object is a 64-byte header followed by the payload (the chunk's exact block bytes)::

    offset  size  field
    0       4     magic b"KVDC"
    4       2     format version (3)
    6       2     flags: FLAG_ALIGNED and/or FLAG_KEYED (any other bit is rejected)
    8       16    namespace digest (``keys.Namespace.digest``: model, dtype, geometry, salt …)
    24      16    chunk key
    40      8     payload length
    48      16    checksum: xxh3_128 over header bytes [0, 48) followed by the xxh3_128 digest of
                  each HASH_BLOCK of the payload in order (the last block may be short), or
                  with FLAG_KEYED a tag: keyed BLAKE3 (first 16 bytes) over header bytes
                  [0, 48) followed by the payload
    64      n     payload                               (flags 0: Redis values)
    64      4032  zeros, then at 4096: the payload      (FLAG_ALIGNED: disk files)

Integers are little-endian. The checksum covers the identity fields and the flags as well as the
payload, so a header whose key, namespace or layout was altered fails like a flipped payload byte;
the padding of an aligned object must be zeros. An aligned object keeps its payload on a 4 KiB file
offset, so O_DIRECT moves it straight between the file and an aligned buffer. An object is served
only when magic, version, flags, namespace, key, length, padding and checksum all agree; anything
else is *corrupt* (a miss that the tier removes and counts). Objects of earlier versions (1: no
aligned layout; 2: one xxh3 pass over the payload) read as corrupt and age out.

Why a checksum of block digests: each block's digest can be computed on its own, so a reader
checks the blocks of a long read on several threads as they land, and only the last piece's blocks
are left after the read (the disk tier: ``block_digests``, ``verify_digests``). One xxh3 pass over
the payload kept a single thread hashing in order, which left 1.4 ms of hashing after a 32 MiB
read on the GPU hosts (issue 19). The final hash covers 16 bytes of digest per 512 KiB block.

Authenticated values (``FLAG_KEYED``; the Redis tier with ``remote_secret``): a checksum detects
damage, not forgery — anyone who can write to the store can compute an xxh3 over a header naming
any chunk. A keyed tag can only be made with the tag key (``tag_key(secret)``: BLAKE3's
key-derivation mode over the secret), and it covers the namespace, the chunk key, the length and
the flags, so bytes made for one chunk cannot pass for another's and a tagged value cannot be
downgraded to an untagged one. A reader with a tag key serves only tagged values whose tag holds
(anything else is *forged*); a reader without one refuses tagged values (it cannot check them).

Primitives:
    encode_header(namespace, key, payload, aligned=False) -> bytes  what precedes the payload
                                                        (64 bytes, or 4096 when aligned)
    encode(namespace, key, payload) -> memoryview       header + payload as one buffer (Redis)
    read_header(head, namespace, key) -> Header | None  parse and check identity; None if foreign/garbage
    verify(header, payload) -> bool                     length and checksum of a payload
    decode(obj, namespace, key) -> memoryview | None    the verified payload of a whole object
    check(obj, namespace, key, tag_key) -> (payload, fault)  decode, saying why not: CORRUPT / FORGED
    check_head(head, namespace, key, tag_key, size) -> (Header, fault)  ``check`` of the first
                                                        bytes of an object of ``size`` bytes, before
                                                        its payload is read (then ``verify`` it)
    tag_key(secret) -> bytes                            the 32-byte tag key of a secret
    block_digests(part) -> bytes                        the digests of the blocks of a part of a payload
                                                        that starts on a block boundary
    verify_digests(header, digests, length) -> bool     verify a payload by its blocks' digests in order
"""

from __future__ import annotations

import hmac
import struct
from typing import NamedTuple

import blake3
import numpy as np
import xxhash

from kvdepot.keys import KEY_BYTES, ChunkKey

Payload = bytes | bytearray | memoryview
"""What tiers accept as a payload: any contiguous bytes-like object (never copied to hash it)."""

MAGIC = b"KVDC"
FORMAT_VERSION = 3
HASH_BLOCK = 512 << 10  # the payload's checksum unit: each block's digest is computed on its own
NAMESPACE_BYTES = 16
FLAG_ALIGNED = 1  # the payload starts at ALIGNED_OFFSET; the bytes between are zeros
FLAG_KEYED = 2  # the checksum field is a keyed BLAKE3 tag (see the module docstring)
_FLAGS = FLAG_ALIGNED | FLAG_KEYED
CORRUPT, FORGED = "corrupt", "forged"  # why ``check`` found no payload
_TAG_CONTEXT = "kvdepot 2026-12 chunk value tag v1"  # BLAKE3 derive-key context: never reuse
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
    tag_key: bytes | None = None  # set when the checksum is a keyed tag (FLAG_KEYED)


def tag_key(secret: str | bytes) -> bytes:
    """The 32-byte BLAKE3 key that tags values, derived from a shared secret (any length)."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise ValueError("the tag secret must not be empty")
    return blake3.blake3(raw, derive_key_context=_TAG_CONTEXT).digest()


def check_namespace(namespace: bytes) -> bytes:
    """Tiers are built for one namespace digest; refuse anything that is not 16 bytes."""
    if not isinstance(namespace, bytes) or len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"namespace must be a {NAMESPACE_BYTES}-byte digest, got {namespace!r}")
    return namespace


def _tag(signed: bytes, payload: Payload, key: bytes) -> bytes:
    """A keyed object's tag: keyed BLAKE3 over the signed header bytes and the payload (BLAKE3 runs
    a long payload on several threads itself)."""
    digest = blake3.blake3(signed, key=key, max_threads=blake3.blake3.AUTO)
    digest.update(payload)
    return digest.digest(16)


def block_digests(part: Payload) -> bytes:
    """The xxh3_128 digests of ``part``'s ``HASH_BLOCK``-byte blocks, in order (the last may be
    short). ``part`` must start on a block boundary of its payload; the digests of consecutive
    parts, joined, are those of the whole. xxhash releases the GIL while it hashes."""
    view = memoryview(part).cast("B")
    return b"".join(xxhash.xxh3_128(view[lo : lo + HASH_BLOCK]).digest() for lo in range(0, view.nbytes, HASH_BLOCK))


def _checksum(signed: bytes, digests: bytes) -> bytes:
    return xxhash.xxh3_128(signed + digests).digest()


def encode_header(namespace: bytes, key: ChunkKey, payload: Payload, aligned: bool = False,
                  tag_key: bytes | None = None) -> bytes:
    """What precedes ``payload`` stored under ``key`` in ``namespace``: the 64-byte header, padded
    with zeros to ``ALIGNED_OFFSET`` bytes when ``aligned``; tagged with ``tag_key`` if given."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"chunk key must be {KEY_BYTES} bytes, got {len(key)}")
    length = memoryview(payload).nbytes
    flags = (FLAG_ALIGNED if aligned else 0) | (FLAG_KEYED if tag_key is not None else 0)
    signed = _HEADER.pack(MAGIC, FORMAT_VERSION, flags, namespace, key, length, b"")[:_SIGNED]
    seal = _checksum(signed, block_digests(payload)) if tag_key is None else _tag(signed, payload, tag_key)
    head = signed + seal
    return head + _PADDING if aligned else head


def encode(namespace: bytes, key: ChunkKey, payload: Payload, tag_key: bytes | None = None) -> memoryview:
    """Header and payload in one buffer (one payload copy: a Redis value must be contiguous), as a
    bytes-like view. numpy makes the copy with the GIL released; a ``bytes`` join holds it for
    the whole memcpy, and in-process the engine's step loop waits that long (~5 ms per 32 MiB
    chunk on a GPU host; ``kvdepot bench tiers --parts stall``)."""
    data = np.frombuffer(payload, dtype=np.uint8)
    header = encode_header(namespace, key, payload, tag_key=tag_key)  # xxhash and blake3 release the GIL too
    value = np.empty(len(header) + data.size, dtype=np.uint8)
    value[: len(header)] = np.frombuffer(header, dtype=np.uint8)
    np.copyto(value[len(header) :], data)
    return memoryview(value)


def _parse(head: memoryview, namespace: bytes, key: ChunkKey) -> tuple[Header, int] | None:
    """(header, flags) of an object that is ``key``'s in ``namespace`` in today's format."""
    if head.nbytes < HEADER_BYTES:
        return None
    magic, version, flags, ns, stored_key, length, checksum = _HEADER.unpack(head[:HEADER_BYTES])
    if magic != MAGIC or version != FORMAT_VERSION or flags & ~_FLAGS or ns != namespace or stored_key != key:
        return None
    offset = HEADER_BYTES
    if flags & FLAG_ALIGNED:
        if head.nbytes < ALIGNED_OFFSET or bytes(head[HEADER_BYTES:ALIGNED_OFFSET]) != _PADDING:
            return None
        offset = ALIGNED_OFFSET
    return Header(length, checksum, bytes(head[:_SIGNED]), offset), flags


def read_header(head: Payload, namespace: bytes, key: ChunkKey, tag_key: bytes | None = None) -> Header | None:
    """Parse an object's bytes up to its payload (``ALIGNED_OFFSET`` of them cover either layout;
    more are ignored); None unless it is ``key``'s, in ``namespace``, with zeros as padding, and
    tagged exactly when ``tag_key`` is given."""
    parsed = _parse(memoryview(head).cast("B"), namespace, key)
    if parsed is None or bool(parsed[1] & FLAG_KEYED) != (tag_key is not None):
        return None
    return parsed[0]._replace(tag_key=tag_key)


def verify(header: Header, payload: Payload) -> bool:
    """Whether ``payload`` is the one ``header`` describes: its length, and its checksum or tag."""
    if memoryview(payload).nbytes != header.length:
        return False
    if header.tag_key is not None:
        return hmac.compare_digest(_tag(header.signed, payload, header.tag_key), header.checksum)
    return verify_digests(header, block_digests(payload), header.length)


def verify_digests(header: Header, digests: bytes, length: int) -> bool:
    """``verify`` of an untagged payload of ``length`` bytes from its blocks' digests, in order
    (``block_digests`` of consecutive parts, computed wherever they landed). A tagged header never
    passes: its tag covers the payload itself."""
    return (header.tag_key is None and length == header.length and len(digests) == 16 * -(-length // HASH_BLOCK)
            and hmac.compare_digest(_checksum(header.signed, digests), header.checksum))


def decode(obj: Payload, namespace: bytes, key: ChunkKey) -> memoryview | None:
    """The payload of a whole untagged object (a view, not a copy), or None if it is not a valid one."""
    return check(obj, namespace, key)[0]


def check(obj: Payload, namespace: bytes, key: ChunkKey, tag_key: bytes | None = None) -> tuple[memoryview | None, str | None]:
    """(the verified payload of a whole object as a view, None), or (None, why): ``FORGED`` when a
    ``tag_key`` is given and the object is ``key``'s by its header but untagged or its tag fails;
    ``CORRUPT`` for anything else (damage, another chunk's or namespace's object, garbage)."""
    view = memoryview(obj).cast("B")
    header, fault = check_head(view, namespace, key, tag_key, view.nbytes)
    if header is None:
        return None, fault
    payload = view[header.offset :]
    if verify(header, payload):
        return payload, None
    return None, refusal(tag_key)


def check_head(head: Payload, namespace: bytes, key: ChunkKey, tag_key: bytes | None, size: int) -> tuple[Header | None, str | None]:
    """``check`` of an object's first bytes, before its payload is read: (its header, None) when
    they are ``key``'s in ``namespace``, tagged exactly when ``tag_key`` is given, and the object's
    ``size`` (all of it, header included) is the header's plus its payload's; else (None, why) as
    ``check`` says. The payload must still pass ``verify``."""
    parsed = _parse(memoryview(head).cast("B"), namespace, key)
    if parsed is None:
        return None, CORRUPT
    header, flags = parsed
    if bool(flags & FLAG_KEYED) != (tag_key is not None) or size != header.offset + header.length:
        return None, refusal(tag_key)  # no tag to check / none we can check / a cut or padded object
    return header._replace(tag_key=tag_key), None


def refusal(tag_key: bytes | None) -> str:
    """Why a value that names the right chunk was refused: a reader with a tag key cannot tell
    damage from forgery (``FORGED``); one without calls it ``CORRUPT``."""
    return FORGED if tag_key is not None else CORRUPT
