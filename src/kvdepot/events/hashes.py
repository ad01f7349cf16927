"""The block hashes kvdepot's KV events carry: one per engine block, chained, from tokens alone.

    seed = xxh3_64(b"kvdepot-kv-events-v1\\0" ‖ utf8(model_id) ‖ b"\\0" ‖ utf8(cache_salt))
    h_0  = xxh3_64(be_u64(seed)    ‖ le_u32(tokens[0:B]))
    h_j  = xxh3_64(be_u64(h_{j-1}) ‖ le_u32(tokens[j*B:(j+1)*B]))

``B`` is the engine's ``tokens_per_block``; hashes are unsigned 64-bit integers. A router computes
the same list from a prompt with ``BlockHasher(model_id, cache_salt).hashes(tokens, B)`` (or the
three lines above in any language) and needs nothing of kvdepot's internal key namespace (KV
dtype, geometry, TP rank): that namespace, hashed to 128 bits, still decides every load, so a
64-bit collision here can misroute a request but never load wrong KV.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from kvdepot.keys import token_bytes

_DOMAIN = b"kvdepot-kv-events-v1\0"


class BlockHasher:
    """Chained per-block hashes for one (model, salt)."""

    def __init__(self, model_id: str, cache_salt: str = "") -> None:
        self.seed = xxhash.xxh3_64_intdigest(_DOMAIN + model_id.encode() + b"\0" + cache_salt.encode())

    def hashes(
        self, tokens: Sequence[int] | np.ndarray | bytes, block_size: int, parent: int | None = None, limit: int | None = None
    ) -> list[int]:
        """Hashes of the full blocks of ``tokens`` (``bytes``: already little-endian u32), chained
        from ``parent`` (None: ``tokens`` start the prompt); at most ``limit`` of them."""
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} must be positive")
        raw = memoryview(tokens if isinstance(tokens, bytes) else token_bytes(tokens))
        count = len(raw) // (4 * block_size)
        if limit is not None:
            count = min(count, limit)
        step = 4 * block_size
        prev = self.seed if parent is None else parent
        digest = xxhash.xxh3_64_intdigest
        out = []
        for j in range(count):
            prev = digest(prev.to_bytes(8, "big") + raw[j * step : (j + 1) * step])
            out.append(prev)
        return out
