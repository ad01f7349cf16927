"""What ``CacheEngine``'s calls answer (``engine.py`` re-exports them):

    Hit           probe: where the cached run ends, and how much of it is in host memory now
                  (defined with the contract in ``engine_api.py``; ``RemoteEngine`` answers it too)
    StoreHandle   store: the copies in flight, ``done()`` / ``wait()``
    LayeredLoad   retrieve_by_layer: one event per layer, for the forward to wait on layer by layer
                  (defined with its mechanism in ``transfer/layered.py``)
    FinishedLoad  retrieve_async: a load done in the call (``engine_api.PendingLoad``)
    EngineStats   stats: counters and a snapshot of the tiers
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdepot.engine_api import Hit
from kvdepot.storage.base import TierStats
from kvdepot.transfer.inflight import InflightTransfers
from kvdepot.transfer.layered import LayeredLoad, LayerWaits

__all__ = ["EngineStats", "FinishedLoad", "Hit", "LayeredLoad", "StoreHandle"]


@dataclass
class EngineStats:
    hits: int = 0  # chunks found by lookups
    misses: int = 0  # lookups that stopped short of the prompt's last full chunk
    lookups: int = 0
    stored_chunks: int = 0
    loaded_chunks: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    store_seconds: float = 0.0  # host-side time to enqueue/perform stores
    load_seconds: float = 0.0
    evictions: int = 0
    dropped_stores: int = 0
    live_leases: int = 0
    pinned_chunks: int = 0
    inflight_transfers: int = 0
    host_chunks: int = 0
    host_capacity_chunks: int = 0
    host_pending_chunks: int = 0  # arena slots the background pinner has yet to allocate (0: all there)
    promoting: int = 0  # lookups whose lower-tier chunks are still being read into host memory
    short_loads: int = 0  # loads that found fewer chunks than their lookup promised (logged)
    refused_batches: int = 0  # batched copies the driver refused, each redone by per-run copies (logged)
    layered_loads: int = 0  # loads issued layer by layer (``retrieve_by_layer``)
    lower: list[TierStats] = field(default_factory=list)


class StoreHandle:
    """A store in flight. ``done()`` is true once every copied chunk is committed."""

    def __init__(self, transfers: InflightTransfers, chunks: int, token: int | None) -> None:
        self._transfers, self.chunks, self._token = transfers, chunks, token

    def done(self) -> bool:
        return self._token is None or self._transfers.is_complete(self._token)

    def wait(self) -> None:
        if self._token is not None:
            self._transfers.wait_for(self._token)


@dataclass
class FinishedLoad:
    """A load answered in the call (in-process ``retrieve_async``): ``PendingLoad``, already done."""

    end: int  # tokens from 0 valid once the stream waited (or ``layered`` was waited on)
    layered: LayerWaits | None = None

    def done(self) -> bool:
        return True

    def result(self) -> int:
        return self.end
