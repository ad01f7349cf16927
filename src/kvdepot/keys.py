"""Tokens -> prefix-chained chunk keys. Pure, engine-free, identical in every process.

    key_0 = H(namespace ‖ le_u32(tokens[0:C]))
    key_i = H(key_{i-1} ‖ le_u32(tokens[i*C:(i+1)*C]))

``H`` is a 128-bit digest (xxh3-128 by default, blake3 on request) over explicit
little-endian bytes, so keys never depend on ``PYTHONHASHSEED``, the platform or the
process. Because each key folds in its parent, equal keys mean equal *whole prefixes*, and
a lookup can stop at the first missing chunk. The namespace digest folds in everything that
makes KV bytes differ for the same tokens: model, KV dtype, pool geometry, TP rank/size,
chunk size and a cache salt.
"""

from __future__ import annotations

import array
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import NewType

import blake3
import numpy as np
import xxhash

from kvdepot.errors import LayoutError

ChunkKey = NewType("ChunkKey", bytes)
"""16 bytes identifying a chunk *and the whole prefix before it*."""

KEY_BYTES = 16
_U32_MAX = 2**32 - 1


def _xxh3_128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def _blake3_128(data: bytes) -> bytes:
    return blake3.blake3(data).digest(KEY_BYTES)


DIGESTS: dict[str, Callable[[bytes], bytes]] = {"xxh3_128": _xxh3_128, "blake3": _blake3_128}


@dataclass(frozen=True)
class Namespace:
    """Everything besides the tokens that decides what the KV bytes of a chunk are."""

    model_id: str
    kv_dtype: str
    geometry: tuple[int | str, ...]
    chunk_size: int
    tp_rank: int = 0
    tp_size: int = 1
    cache_salt: str = ""

    def digest(self, algo: str = "xxh3_128") -> bytes:
        """A canonical (sorted-key JSON) encoding, hashed: stable across processes and hosts."""
        blob = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return DIGESTS[algo](b"kvdepot-ns-v1\0" + blob)


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Tokens as little-endian uint32 bytes; a token outside [0, 2**32) is an error, never wrapped."""
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu":  # NOTE: astype would truncate 1.5 to 1; a list raises
            raise LayoutError(f"token ids must be integers in [0, 2**32), got an array of {tokens.dtype}")
        if tokens.size and (tokens.min() < 0 or tokens.max() > _U32_MAX):
            raise LayoutError("token ids must lie in [0, 2**32)")
        return tokens.astype("<u4", copy=False).tobytes()
    try:
        packed = array.array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise LayoutError(f"token ids must be integers in [0, 2**32): {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte 'I'
        return np.asarray(tokens, dtype="<u4").tobytes()
    if sys.byteorder != "little":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


class ChunkHasher:
    """Computes the chained keys of a token sequence's full chunks for one namespace."""

    def __init__(self, namespace: Namespace, algo: str = "xxh3_128") -> None:
        if algo not in DIGESTS:
            raise LayoutError(f"hash_algo {algo!r} is not one of {sorted(DIGESTS)}")
        self.namespace = namespace
        self.chunk_size = namespace.chunk_size
        self.algo = algo  # a hasher for another namespace (a salted request) takes the same digest
        self._digest = DIGESTS[algo]
        self.seed = namespace.digest(algo)

    def chunk_keys(self, tokens: Sequence[int] | np.ndarray) -> list[ChunkKey]:
        """Keys of every *full* chunk of ``tokens`` (a trailing partial chunk has no key)."""
        return self.extend([], tokens)

    def extend(self, keys: list[ChunkKey], tokens: Sequence[int] | np.ndarray) -> list[ChunkKey]:
        """Keys of ``tokens``' full chunks, reusing ``keys`` already computed for its prefix.

        Used when a sequence grows (decode) so earlier chunks are never hashed twice.
        """
        size = self.chunk_size
        total = len(tokens) // size
        if len(keys) >= total:
            return list(keys[:total])
        start = len(keys)
        # Convert once, slice the bytes: slicing a long Python list first would copy it.
        raw = memoryview(token_bytes(tokens))[start * size * 4 : total * size * 4]
        out = list(keys)
        prev = keys[-1] if keys else self.seed
        step = size * 4
        digest = self._digest
        for i in range(total - start):
            prev = digest(prev + raw[i * step : (i + 1) * step])
            out.append(ChunkKey(prev))
        return out
