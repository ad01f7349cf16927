"""``RemoteEngine``: ``engine_api.Engine`` served by a kvdepot server (see that module for the
primitives' pre- and post-conditions; both engines pass ``tests/test_engine_contract.py``).

    RemoteEngine(client, pool, tokens_per_block, model_id=, cache_salt=, tp_rank=, tp_size=, mode=)
    RemoteEngine.for_views(client, views | None, layout, model_id=, ...)   per-layer block views
      ready                                 registered with a live server
      chunk_keys(tokens) / hasher / layout  rank-free keys with the server's chunk size
      probe(keys, skip_tokens=, lease=) -> Hit          LOOKUP (+ QUERY_PREFETCH_STATUS polling)
      lookup(...) -> int                    probe(...).tokens
      release(lease)                        fire-and-forget RELEASE
      lease_token                           the secret this session's LOOKUP replies carry
      handover(rid) -> Lease                a lease another process's retrieve(lease=) may name (with the token)
      promotion_done(lease) -> bool         QUERY_PREFETCH_STATUS
      store(keys, block_ids, stream=) -> handle (.done(), .wait(), .chunks)
      retrieve(keys, block_ids, skip_blocks=, num_blocks=, lease=, stream=) -> int
      retrieve_by_layer(...) -> (int, LayerWaits | None)
      retrieve_async(..., by_layer=) -> handle (.done(), .result(), .layered)

Leases are ``engine_api.Lease``s (an int ``request_id``): a probe and a release name the caller's
own session's lease; a load may name another session's (``Lease(rid, session=..., token=...)``: the
worker loading under its scheduler's lease; without the token the server refuses the load). The older forms (an int rid, a ``(session, rid)`` pair) are
still taken until the connectors have moved to ``Lease``.

Per-layer block views (``transfer.base``: block ``b`` is ``views[0][b] ‖ views[1][b] ‖ …``, e.g.
vLLM's caches) register the geometry of ``PoolLayout.from_views``; their blocks always travel
over the socket, gathered in that order. ``views=None`` registers the geometry alone, for a
scheduler that looks chunks up in another process than the workers that copy them. Protocol v1's
REGISTER has no layout tag, so a tagged layout's tag travels in the cache salt: the server keeps
its chunks in a group and key namespace of their own, apart from TensorRT-LLM pools of the same
geometry.

Failures never raise: a lookup answers 0, a store is skipped (its handle is done at once), a
retrieve returns ``skip_blocks * tokens_per_block`` (nothing loaded). The client logs one
warning per outage and re-registers this pool by itself once the server is back.

Ordering on CUDA (see ``ipc``): before each copy the client records ``to_server`` on the
caller's stream, so the server copies only after the forward pass's work on those blocks; a
load's reply arrives once the copy is *enqueued*, and the caller's stream then waits on
``to_client`` — the forward pass reads after the load without the host waiting for the copy.
A load by layer is answered once its first layer is enqueued (``layer_progress``): the forward's
wait for layer ``l`` first learns that the server recorded layer ``l``'s event for it — from the
registration's progress page (``progress_page``: created per REGISTER, unlinked once answered),
else by LAYERS.
A store's reply arrives once the copy has *completed*, and only then is the store done, so
blocks handed back to the engine are never read by the server afterwards. Mapped-pool copies
carry a deadline at half the call timeout: the server refuses to start a copy the client may
have stopped waiting for. They also carry a ticket of the registration's ``copy_fence``: a copy
that times out is not over for the engine until the server is past it or has refused it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch

from kvdepot.config import DepotConfig, load_config
from kvdepot.engine_api import Capabilities, Hit, Lease
from kvdepot.errors import Irrecoverable, KVDepotError
from kvdepot.keys import ChunkHasher, ChunkKey
from kvdepot.layout import PoolLayout
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.client import DepotClient, ServerError, ServerUnavailable
from kvdepot.server.copies import AnyLease, CopyHandle, gather_rows, scatter_rows, wire_lease
from kvdepot.server.copy_fence import SUPPORTED as FENCE_SUPPORTED
from kvdepot.server.copy_fence import FenceFile, Ticket
from kvdepot.server.ipc import ExportedPool, export_pool
from kvdepot.server.layer_follow import WATCH_GRACE_NS, FollowStats, RemoteProgress, Watch
from kvdepot.server.namespace import mp_namespace
from kvdepot.server.progress_page import PAGE_SUPPORTED, ProgressPage
from kvdepot.server.recent_prompts import RecentPrompts
from kvdepot.server.shared_file import SharedFileError
from kvdepot.transfer.layered import LayerWaits

logger = logging.getLogger("kvdepot")

REGISTER_TIMEOUT_S = 60.0


def one_copy(tp_kv_copies: str, kv_factor: int, tp_size: int) -> bool:
    """Whether the server should keep one copy of a chunk for every TP rank (``tp_kv_copies``):
    ``auto`` says so for kv_factor 1, the pools TensorRT-LLM gives MLA models, whose latent is the
    same on every rank; K/V pools hold each rank's own heads."""
    if tp_size <= 1:
        return False
    return tp_kv_copies == "one" or (tp_kv_copies == "auto" and kv_factor == 1)


class RemoteEngine:
    """One worker's pool registered with a kvdepot server; thread-safe like the client."""

    def __init__(
        self, client: DepotClient, pool: torch.Tensor | None, tokens_per_block: int, *, model_id: str = "",
        cache_salt: str = "", tp_rank: int = 0, tp_size: int = 1, mode: str = "auto",
        config: DepotConfig | None = None, prefetch_wait_s: float = 0.005,
        views: Sequence[torch.Tensor] | None = None, layout: PoolLayout | None = None,
    ) -> None:
        self.client, self.pool = client, pool
        self.config = config or load_config()
        self.model_id, self.cache_salt, self.tp_rank, self.tp_size = model_id, cache_salt, tp_rank, tp_size
        self.prefetch_wait_s = prefetch_wait_s
        if pool is not None:
            self._base = PoolLayout.from_pool(pool, tokens_per_block, tokens_per_block)
            self._views = [pool.view(pool.shape[0], -1).view(torch.uint8)]
            self.exported = export_pool(pool, mode, layers=self._base.num_layers)
        elif layout is not None:
            self._base = layout
            self._views = list(views or [])
            self.exported = ExportedPool(self._views[0] if self._views else torch.empty(0), p.BytesPool())
        else:
            raise ValueError("RemoteEngine needs a pool, or a layout (and optionally its block views)")
        self._layout: PoolLayout | None = None
        self._hasher: ChunkHasher | None = None
        self.granted: p.RegisterReply | None = None
        self.lease_token = b""  # the server's token for this session's leases (from the last LOOKUP)
        self._page: ProgressPage | None = None  # this registration's progress page, if the server writes it
        self._fence: FenceFile | None = None  # this registration's copy fence, if the server opened it
        self.layer_stats = FollowStats()  # what following loads answered early cost (LAYERS calls)
        # KV events (server with kv_events_endpoint): the tokens of recent prompts, by last key, so
        # a lookup by keys can carry them to the server (docs/events.md).
        self._recent = RecentPrompts()
        client.on_connect(self._register)

    @classmethod
    def for_views(cls, client: DepotClient, views: Sequence[torch.Tensor] | None, layout: PoolLayout,
                  **kwargs: Any) -> RemoteEngine:
        """Per-layer block views of ``layout`` (bytes over the socket); ``None``: lookups only."""
        return cls(client, None, layout.tokens_per_block, views=views, layout=layout, **kwargs)

    @property
    def ready(self) -> bool:
        return self._layout is not None and self.client.ready

    @property
    def layout(self) -> PoolLayout:
        """The pool's layout with the server's chunk size; raises before the first registration."""
        if self._layout is None:
            raise Irrecoverable("not registered with a kvdepot server yet")
        return self._layout

    @property
    def hasher(self) -> ChunkHasher:
        """Rank-free chunk keys as the server derives them; raises before the first registration."""
        if self._hasher is None:
            raise Irrecoverable("not registered with a kvdepot server yet")
        return self._hasher

    @property
    def capabilities(self) -> Capabilities:
        """Loads by layer where the pool exported layer events (the server may still answer whole)."""
        return Capabilities(layered_loads=self.exported.layered, async_loads=True)

    @property
    def tokens_per_block(self) -> int:
        return self._base.tokens_per_block

    @property
    def _wire_salt(self) -> str:
        """The salt REGISTER carries: a tagged layout's tag rides in it (protocol v1 has no tag field)."""
        tag = self._base.tag
        return self.cache_salt if tag == "trtllm" else f"{self.cache_salt}\0tag={tag}"

    def _register(self) -> None:
        try:
            reply = self._send_register()
        except ServerError as exc:
            if exc.code != p.ErrorCode.UNSUPPORTED or self.exported.kind == "bytes":
                raise
            logger.warning("kvdepot: the server cannot map this %s pool (%s); its blocks travel over the socket",
                           self.exported.kind, exc.message)
            self.exported.close()
            self.exported = ExportedPool(self.exported.pool, p.BytesPool())
            reply = self._send_register()
        layout = dataclasses.replace(self._base, chunk_size=reply.chunk_size)
        geometry = dataclasses.replace(layout, tag="trtllm").geometry  # the server's (untagged) view of it
        ns = mp_namespace(self.model_id, layout.dtype_name, geometry, reply.chunk_size, self.tp_size, self._wire_salt)
        hasher = ChunkHasher(ns, reply.hash_algo)
        if hasher.seed != reply.namespace_digest:
            raise Irrecoverable("the server derives chunk keys differently (another kvdepot version?)")
        if self._hasher is not None and self._hasher.seed != hasher.seed:
            raise Irrecoverable("the server's chunk_size/hash_algo changed since this engine started; restart the engine")
        self._layout, self._hasher, self.granted = layout, hasher, reply
        logger.info("kvdepot: registered %s pool rank %d/%d with %s: chunk %d tokens, %d host blocks granted",
                    self.exported.kind, self.tp_rank, self.tp_size, self.client.url, reply.chunk_size, reply.host_blocks)

    def _send_register(self) -> p.RegisterReply:
        base = self._base
        page, fence = self._new_page(), self._new_fence()
        files: dict[str, Any] = {"progress_page": page.path} if page is not None else {}
        if fence is not None:
            files.update(fence=fence.path, fence_epoch=fence.epoch)
        desc = msgspec.structs.replace(self.exported.desc, **files)
        msg = p.Register(
            model_id=self.model_id, tp_rank=self.tp_rank, tp_size=self.tp_size, tokens_per_block=base.tokens_per_block,
            num_blocks=base.num_blocks, num_layers=base.num_layers, kv_factor=base.kv_factor,
            block_elems=base.block_elems, dtype=base.dtype_name, bytes_per_block=base.bytes_per_block,
            pool=desc, cache_salt=self._wire_salt,
            one_copy=one_copy(self.config.tp_kv_copies, base.kv_factor, self.tp_size),
        )
        try:
            # NOTE: once per start-up, and slow on a cold server (CUDA init, opening the IPC handle,
            # measured > 2 s on the H200): give it more than an ordinary call's timeout.
            reply, _ = self.client.call(msg, handshake=True, timeout=max(self.client.timeout_s, REGISTER_TIMEOUT_S))
        except BaseException:
            if fence is not None:
                fence.close()
            raise
        finally:
            for made in (page, fence):
                if made is not None:
                    made.unlink()  # opened by the server by now, or never: its descriptors outlive the name
        assert isinstance(reply, p.RegisterReply)
        if page is not None and not reply.progress_page:
            page.close()  # a server that does not write it (older, over TCP, another CPU): LAYERS
        self._page = page if page is not None and reply.progress_page else None  # older loads keep theirs
        if fence is not None and not reply.fence:
            fence.close()  # a server that does not lock it (older, over TCP): copies go with their deadline
        self._fence = fence if fence is not None and reply.fence else None  # older copies keep theirs
        return reply

    def _new_fence(self) -> FenceFile | None:
        """A fresh copy fence for this registration, where the server maps the pool."""
        return _made(self.exported.kind != "bytes" and FENCE_SUPPORTED, FenceFile.create,
                     "copies into the pool are stopped by their deadline alone")

    def _ticket(self, on_abandoned: Callable[[], None] | None = None) -> Ticket | None:
        fence = self._fence
        return fence.ticket(on_abandoned) if fence is not None else None

    def _new_page(self) -> ProgressPage | None:
        """A fresh progress page for this registration, where loads can go by layer and it is safe."""
        wanted = (isinstance(self.exported.desc, p.CudaIpcPool) and self.exported.layered and PAGE_SUPPORTED
                  and self.config.layer_progress == "auto")
        return _made(wanted, ProgressPage.create, "loads by layer follow the server by LAYERS")

    # ---- keys and lookups -----------------------------------------------------------------------
    def chunk_keys(self, tokens: Sequence[int]) -> list[ChunkKey]:
        keys = self.hasher.chunk_keys(tokens)
        self.describe(keys, tokens)
        return keys

    def describe(self, keys: Sequence[ChunkKey], tokens: Sequence[int]) -> None:
        """``keys[i]`` holds ``tokens[i*C:(i+1)*C]``: remembered when the server publishes KV
        events, so a LOOKUP by ``keys`` carries them (``recent_prompts``)."""
        if self.granted is not None and self.granted.wants_tokens:
            self._recent.remember(keys, tokens)

    def _tokens_for(self, keys: Sequence[ChunkKey]) -> list[int]:
        """What a LOOKUP carries beside its keys: nothing, unless the server asked for tokens."""
        if self.granted is None or not self.granted.wants_tokens or self._layout is None:
            return []
        return self._recent.tokens_for(keys, self._layout.chunk_size)

    def probe(self, keys: Sequence[ChunkKey], *, skip_tokens: int = 0, lease: AnyLease | None = None) -> Hit:
        """LOOKUP (leases the hit, starts its promotion), then QUERY_PREFETCH_STATUS for up to
        ``prefetch_wait_s`` while lower tiers are staged. ``Hit(0, 0)`` on any failure.

        Protocol v1's LOOKUP always leases (request id 0 without a lease): that lease is
        released at once, so nothing stays pinned (a promotion it started runs on as a prefetch)."""
        rid = wire_lease(lease, 0)[1] if lease is not None else 0
        if lease is None:
            try:
                return self._probe(keys, skip_tokens, rid)
            finally:
                self.release(rid)
        return self._probe(keys, skip_tokens, rid)

    def _probe(self, keys: Sequence[ChunkKey], skip_tokens: int, rid: int) -> Hit:
        try:
            status, _ = self.client.call(p.Lookup(rid, w.join_keys(keys), self._tokens_for(keys), skip_tokens))
            self.lease_token = status.lease_token or self.lease_token  # type: ignore[attr-defined]
            deadline = time.monotonic() + self.prefetch_wait_s
            while not status.done and time.monotonic() < deadline:  # type: ignore[attr-defined]
                time.sleep(0.0005)
                status, _ = self.client.call(p.QueryPrefetch(rid))
        except ServerError as exc:
            logger.warning("kvdepot: lookup of request %s refused: %s", rid, exc)
            return Hit(0, 0)
        except ServerUnavailable:
            return Hit(0, 0)
        assert isinstance(status, p.PrefetchStatus)
        return Hit(status.matched_tokens, status.matched_tokens if status.done else status.ready_tokens)

    def lookup(self, keys: Sequence[ChunkKey], *, skip_tokens: int = 0, lease: AnyLease | None = None) -> int:
        """End (tokens from 0) of the run every rank holds; 0 on any failure."""
        return self.probe(keys, skip_tokens=skip_tokens, lease=lease).tokens

    def handover(self, rid: int) -> Lease:
        """The lease of request ``rid`` as another session (a worker process) names it in
        ``retrieve(lease=...)``: without this session's token the server refuses the load."""
        return Lease(rid, session=self.client.session_id, token=self.lease_token)

    def release(self, lease: AnyLease) -> None:
        rid = wire_lease(lease, 0)[1]
        if self.client.ready:
            self.client.submit(p.Release(rid))  # fire and forget: the server releases idempotently

    def promotion_done(self, lease: AnyLease) -> bool:
        """Whether the server has the lease's lower-tier hit in host memory. True where there is
        nothing to wait for, and on any failure (the load that follows then answers short).
        QUERY_PREFETCH_STATUS names this session's lookups only: another session's lease (the
        scheduler's, asked from a worker) answers True, and its load waits on the server."""
        try:
            status, _ = self.client.call(p.QueryPrefetch(wire_lease(lease, 0)[1]))
        except KVDepotError:
            return True
        return status.done if isinstance(status, p.PrefetchStatus) else True

    # ---- copies ----------------------------------------------------------------------------------
    def _deadline(self) -> int:
        return time.monotonic_ns() + int(self.client.timeout_s * 0.5e9) if self.exported.kind != "bytes" else 0

    def store(self, keys: Sequence[ChunkKey], block_ids: Sequence[int], *, stream: Any = None) -> CopyHandle:
        """Send every full chunk of ``keys`` (from ``pool[block_ids]``); skipped when unavailable."""
        if not self.ready or not keys:
            return CopyHandle(None)
        chunks = min(len(keys), len(block_ids) // self.layout.blocks_per_chunk)
        ids = list(block_ids[: chunks * self.layout.blocks_per_chunk])
        blob = w.join_keys(keys[:chunks])
        if self.exported.kind == "bytes":
            payload = gather_rows(self._views, ids, stream)
            future = self.client.submit(p.Store(blob, ids), [payload], timeout=self._bulk_timeout(len(payload)))
        else:
            synced = self.exported.before_copy(stream)
            ticket = self._ticket()
            future = self.client.submit(p.Store(blob, ids, self._deadline(), synced, ticket.number if ticket else 0))
            return CopyHandle(future, lambda result: result[0].stored_chunks, ticket=ticket)
        return CopyHandle(future, lambda result: result[0].stored_chunks)

    def retrieve(self, keys: Sequence[ChunkKey], block_ids: Sequence[int], *, skip_blocks: int = 0,
                 num_blocks: int | None = None, lease: AnyLease | None = None, stream: Any = None) -> int:
        """Load ``[skip_blocks, skip_blocks+num_blocks)``; returns tokens valid from 0 afterwards."""
        return self.retrieve_async(keys, block_ids, skip_blocks=skip_blocks, num_blocks=num_blocks,
                                   lease=lease, stream=stream).result()

    def retrieve_by_layer(self, keys: Sequence[ChunkKey], block_ids: Sequence[int], *, skip_blocks: int = 0,
                          num_blocks: int | None = None, lease: AnyLease | None = None,
                          stream: Any = None) -> tuple[int, LayerWaits | None]:
        """``retrieve_async(by_layer=True)``, waited for: the layers' events where it was granted."""
        handle = self.retrieve_async(keys, block_ids, skip_blocks=skip_blocks, num_blocks=num_blocks,
                                     lease=lease, stream=stream, by_layer=True)
        end = handle.result()
        return end, handle.layered

    def retrieve_async(self, keys: Sequence[ChunkKey], block_ids: Sequence[int], *, skip_blocks: int = 0,
                       num_blocks: int | None = None, lease: AnyLease | None = None,
                       stream: Any = None, by_layer: bool = False) -> CopyHandle:
        """``by_layer``: ask the server to copy layer by layer (CUDA IPC pools with layer events);
        where it did, ``stream`` is *not* made to wait and the handle's ``layered`` must be waited
        on layer by layer, else ``stream`` waits for the whole load as usual."""
        fallback = skip_blocks * self.tokens_per_block
        if not self.ready:
            return CopyHandle(None, fallback=fallback)
        session, rid, token = wire_lease(lease, self.client.session_id) if lease is not None else (0, None, b"")
        ids = list(block_ids)
        by_layer = by_layer and self.exported.layered
        deadline, page, server = self._deadline(), self._page, self.client.server_id  # what the reply is read with
        # Given up on without a reply: once the server lets go of it, the stream waits on what it recorded.
        ticket = self._ticket(lambda: self.exported.after_abandoned_load(stream)) if self.exported.kind != "bytes" else None
        msg = p.Retrieve(w.join_keys(keys), ids, skip_blocks, num_blocks, session, rid, deadline,
                         self.exported.before_copy(stream), by_layer, token, early=by_layer,
                         ticket=ticket.number if ticket else 0)
        bulk = len(ids) * self._base.bytes_per_block if self.exported.kind == "bytes" else 0
        handle = CopyHandle(self.client.submit(msg, timeout=self._bulk_timeout(bulk)), fallback=fallback, ticket=ticket)

        def finish(result: Any) -> int:
            reply, payloads = result
            if self.exported.kind == "bytes":
                if reply.loaded_blocks:
                    scatter_rows(self._views, ids[skip_blocks : skip_blocks + reply.loaded_blocks], payloads[0], stream)
            elif reply.by_layer:
                if not by_layer:  # its events would say nothing about this load
                    raise ValueError("the server answered by layer a load not asked for by layer")
                follow = self._progress(reply, page, deadline, server)
                # answered early: the server copies on after its reply, so the ticket goes with the layers
                kept = handle.keep_ticket() if reply.load_id else None
                handle.layered = self.exported.layered_load(follow, reply.layers_ready if reply.load_id else None, kept)
            else:
                self.exported.after_load(stream)
            return reply.end_tokens

        handle._finish = finish
        return handle

    def _progress(self, reply: p.RetrieveReply, page: ProgressPage | None, deadline_ns: int,
                  server: int) -> Callable[[int], None] | None:
        """For a load answered early (``load_id``): what the forward's wait for layer ``l`` first
        calls, so it never waits on an event the server has not recorded for this load yet —
        read from ``page`` while the server that wrote it serves this client, else by LAYERS."""
        if not reply.load_id:
            return None  # every layer's event was recorded before the reply
        load_id, client = reply.load_id, self.client
        watch = None
        if page is not None:
            watch = Watch(page, load_id, deadline_ns + WATCH_GRACE_NS,
                          lambda: client.ready and client.server_id == server)
        follow = RemoteProgress(lambda through: client.submit(p.Layers(load_id, through)), reply.layers_ready,
                                self._base.num_layers, client.timeout_s, watch, self.layer_stats)
        return follow.through

    def _bulk_timeout(self, nbytes: int) -> float:
        return self.client.timeout_s + nbytes / 1e9  # bytes-mode payloads: allow ~1 GB/s on top

    def stats(self) -> p.StatsReply | None:
        try:
            reply, _ = self.client.call(p.GetStats())
        except KVDepotError:
            return None
        return reply  # type: ignore[return-value]

    def close(self) -> None:
        """Stop re-registering this pool; the client (shared) stays open."""
        self.client.remove_hook(self._register)
        self.exported.close()
        if self._page is not None:
            self._page.close()
        if self._fence is not None:
            self._fence.close()


def _made(wanted: bool, make: Callable[[], Any], otherwise: str) -> Any:
    """A registration's shared file, where ``wanted`` and it can be made (else None, logged)."""
    if not wanted:
        return None
    try:
        return make()
    except SharedFileError as exc:
        logger.warning("kvdepot: %s; %s", exc, otherwise)
        return None
