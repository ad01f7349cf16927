"""The chunk-key namespace of multi-process mode (shared by the server's shards and ``RemoteEngine``)."""

from __future__ import annotations

from collections.abc import Sequence

from kvdepot.keys import Namespace


def mp_namespace(
    model_id: str, kv_dtype: str, geometry: Sequence[int], chunk_size: int, tp_size: int, cache_salt: str
) -> Namespace:
    """The key namespace in multi-process mode: rank-free, so every TP rank computes the same keys.

    The server keeps one copy of a chunk per rank (one engine per rank), so object identity is
    (key, rank); a lookup hits only where every rank holds the chunk. A group registered
    ``one_copy`` (KV the same on every rank) keeps one copy for all ranks instead.
    """
    return Namespace(
        model_id=model_id, kv_dtype=kv_dtype, geometry=tuple(geometry), chunk_size=chunk_size,
        tp_rank=0, tp_size=tp_size, cache_salt=cache_salt,
    )
