"""The vLLM worker's asynchronous loads: hits found on disk or in Redis, served to the request
that found them (``lower_tier_hits: load``).

    AsyncLoads.add(load)          start_load_kv: a load the scheduler promised with load_kv_async
    AsyncLoads.advance(engine)    each step: send what may go, take what was answered
    AsyncLoad.errors(end, B)      the blocks an answered load could not fill

Why a separate path: the scheduler's probe under the request's lease starts promoting the
lower-tier chunks into host slots, which takes disk or network time that vLLM's step loop must
never wait for. vLLM parks the request (``WAITING_FOR_REMOTE_KVS``) and keeps stepping; each
step ``advance`` sends the load once the engine may take it without waiting — at once to an
engine that holds a load until its promotion is done (``capabilities.async_loads``: server
mode), else once ``promotion_done`` (in-process) — and returns the loads that were answered.
The worker reports those in ``finished_recving`` and, in the same pass, the blocks they could
not fill as load errors (vLLM reads both from one ``get_finished`` / ``get_block_ids_with_load_errors``
pair). A chunk that vanished, failed its checksum or could not be read is never loaded: the
load stops before it, so those blocks and every later one are reported, and vLLM recomputes
from the first of them (``kv_load_failure_policy: recompute``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.engine_api import Engine, Lease, PendingLoad


@dataclass
class AsyncLoad:
    """One promised load: blocks ``[skip, skip + num)`` of the request's blocks, under its lease."""

    request_id: str
    keys: list[bytes]
    block_ids: list[int]
    skip: int
    num: int
    lease: Lease
    pending: PendingLoad | None = None  # sent

    def errors(self, end_tokens: int, tokens_per_block: int) -> list[int]:
        """Blocks of the promise that the answer (valid tokens from 0) does not cover."""
        got = max(self.skip, end_tokens // tokens_per_block)
        return self.block_ids[got : self.skip + self.num]


class AsyncLoads:
    """The worker's promised loads, by request id, until each is answered."""

    def __init__(self) -> None:
        self._loads: dict[str, AsyncLoad] = {}

    def add(self, load: AsyncLoad) -> None:
        self._loads[load.request_id] = load

    def advance(self, engine: Engine) -> list[tuple[AsyncLoad, int]]:
        """Send the loads that may go now; take the answered ones with their answers (valid tokens
        from 0). Never waits: ``promotion_done`` and ``done`` are non-blocking, and a load is sent
        only when the engine will not wait on disk or Redis in the call."""
        if not self._loads:
            return []
        bpc = engine.layout.blocks_per_chunk
        for load in self._loads.values():
            if load.pending is None and (engine.capabilities.async_loads or engine.promotion_done(load.lease)):
                end = load.skip + load.num
                # Keys only as far as the load reaches (the engine checks keys against blocks).
                chunks = min(-(-end // bpc), len(load.keys), len(load.block_ids) // bpc)
                load.pending = engine.retrieve_async(
                    load.keys[:chunks], load.block_ids[: chunks * bpc], skip_blocks=load.skip,
                    num_blocks=max(0, min(load.num, chunks * bpc - load.skip)), lease=load.lease,
                )
        answered = []
        for rid, load in list(self._loads.items()):
            if load.pending is not None and load.pending.done():
                del self._loads[rid]
                answered.append((load, load.pending.result()))
        return answered
