"""``RemoteEngine``: the part of ``CacheEngine``'s surface the adapters use, served by a server.

    RemoteEngine(client, pool, tokens_per_block, model_id=, cache_salt=, tp_rank=, tp_size=, mode=)
    RemoteEngine.for_views(client, views | None, layout, model_id=, ...)   per-layer block views
      ready                                 registered with a live server
      chunk_keys(tokens) / hasher / layout  rank-free keys with the server's chunk size
      probe(keys=, skip_tokens=, lease=rid) -> Hit      LOOKUP (+ QUERY_PREFETCH_STATUS polling)
      lookup(...) -> int                    probe(...).tokens
      release(rid)                          fire-and-forget RELEASE
      store(None, block_ids, keys=, stream=) -> handle (.done(), .wait(), .chunks)
      retrieve(None, block_ids, keys=, skip_blocks=, num_blocks=, lease=, stream=) -> int
      retrieve_async(...) -> handle (.done(), .result())

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
A store's reply arrives once the copy has *completed*, and only then is the store done, so
blocks handed back to the engine are never read by the server afterwards. Mapped-pool copies
carry a deadline at half the call timeout: the server refuses to start a copy the client may
have stopped waiting for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from kvdepot.config import DepotConfig, load_config
from kvdepot.engine import Hit
from kvdepot.errors import Irrecoverable, KVDepotError
from kvdepot.keys import ChunkHasher, ChunkKey
from kvdepot.layout import PoolLayout
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.client import DepotClient, ServerError, ServerUnavailable
from kvdepot.server.ipc import ExportedPool, export_pool, frame_tensor
from kvdepot.transfer.layered import LayerWaits

logger = logging.getLogger("kvdepot")

_RECENT_PROMPTS = 1024  # prompts whose tokens a KV-event server may still be sent

REGISTER_TIMEOUT_S = 60.0


class _Handle:
    """A copy in flight: ``done()`` once the server answered (or the call failed)."""

    def __init__(self, future: Future | None, finish: Callable[[Any], int] | None = None, fallback: int = 0) -> None:
        self._future, self._finish, self._value = future, finish, fallback
        self._settled = future is None
        self.layered: LayerWaits | None = None  # a load the server answered by layer: wait on it per layer

    def done(self) -> bool:
        if self._settled:
            return True
        assert self._future is not None
        if not self._future.done():
            return False
        self._settled = True
        try:
            result = self._future.result()
            self._value = self._finish(result) if self._finish else self._value
        except ServerError as exc:
            logger.warning("kvdepot: server refused a copy: %s", exc)
        except KVDepotError:
            pass  # unavailable: logged once by the client
        except (IndexError, ValueError, RuntimeError, TypeError) as exc:  # a reply that does not fit
            logger.warning("kvdepot: copy reply could not be applied: %s", exc)
        return True

    def wait(self) -> None:
        if self._future is not None:
            with contextlib.suppress(KVDepotError):
                self._future.result()
        self.done()

    def result(self) -> int:
        self.wait()
        return self._value

    @property
    def chunks(self) -> int:
        return self._value if self.done() else 0


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
        self.layout: PoolLayout | None = None
        self.hasher: ChunkHasher | None = None
        self.granted: p.RegisterReply | None = None
        # KV events (server with kv_events_endpoint): the tokens of recent prompts, by last key, so
        # a lookup by keys can carry them to the server (docs/events.md).
        self._recent_tokens: OrderedDict[ChunkKey, Sequence[int]] = OrderedDict()
        self._recent_lock = threading.Lock()
        client.on_connect(self._register)

    @classmethod
    def for_views(cls, client: DepotClient, views: Sequence[torch.Tensor] | None, layout: PoolLayout,
                  **kwargs: Any) -> RemoteEngine:
        """Per-layer block views of ``layout`` (bytes over the socket); ``None``: lookups only."""
        return cls(client, None, layout.tokens_per_block, views=views, layout=layout, **kwargs)

    @property
    def ready(self) -> bool:
        return self.layout is not None and self.client.ready

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
        ns = p.mp_namespace(self.model_id, layout.dtype_name, geometry, reply.chunk_size, self.tp_size, self._wire_salt)
        hasher = ChunkHasher(ns, reply.hash_algo)
        if hasher.seed != reply.namespace_digest:
            raise Irrecoverable("the server derives chunk keys differently (another kvdepot version?)")
        if self.hasher is not None and self.hasher.seed != hasher.seed:
            raise Irrecoverable("the server's chunk_size/hash_algo changed since this engine started; restart the engine")
        self.layout, self.hasher, self.granted = layout, hasher, reply
        logger.info("kvdepot: registered %s pool rank %d/%d with %s: chunk %d tokens, %d host blocks granted",
                    self.exported.kind, self.tp_rank, self.tp_size, self.client.url, reply.chunk_size, reply.host_blocks)

    def _send_register(self) -> p.RegisterReply:
        base = self._base
        msg = p.Register(
            model_id=self.model_id, tp_rank=self.tp_rank, tp_size=self.tp_size, tokens_per_block=base.tokens_per_block,
            num_blocks=base.num_blocks, num_layers=base.num_layers, kv_factor=base.kv_factor,
            block_elems=base.block_elems, dtype=base.dtype_name, bytes_per_block=base.bytes_per_block,
            pool=self.exported.desc, cache_salt=self._wire_salt,
        )
        # NOTE: once per start-up, and slow on a cold server (CUDA init, opening the IPC handle,
        # measured > 2 s on the H200): give it more than an ordinary call's timeout.
        reply, _ = self.client.call(msg, handshake=True, timeout=max(self.client.timeout_s, REGISTER_TIMEOUT_S))
        assert isinstance(reply, p.RegisterReply)
        return reply

    # ---- keys and lookups -----------------------------------------------------------------------
    def chunk_keys(self, tokens: Sequence[int]) -> list[ChunkKey]:
        if self.hasher is None:
            raise Irrecoverable("not registered with a kvdepot server yet")
        keys = self.hasher.chunk_keys(tokens)
        self.describe(keys, tokens)
        return keys

    def describe(self, keys: Sequence[ChunkKey], tokens: Sequence[int]) -> None:
        """``keys[i]`` holds ``tokens[i*C:(i+1)*C]``: remembered (the last ``_RECENT_PROMPTS``
        prompts) when the server publishes KV events, so a LOOKUP by ``keys`` carries them."""
        if keys and self.granted is not None and self.granted.wants_tokens:
            with self._recent_lock:
                self._recent_tokens[keys[-1]] = tokens
                self._recent_tokens.move_to_end(keys[-1])
                if len(self._recent_tokens) > _RECENT_PROMPTS:
                    self._recent_tokens.popitem(last=False)

    def _tokens_for(self, keys: Sequence[ChunkKey], tokens: Sequence[int] | None) -> list[int]:
        """What a LOOKUP carries beside its keys: nothing, unless the server asked for tokens."""
        if not keys or self.granted is None or not self.granted.wants_tokens or self.layout is None:
            return []
        if tokens is None:
            with self._recent_lock:
                tokens = self._recent_tokens.get(keys[-1])
        return [] if tokens is None else list(tokens[: len(keys) * self.layout.chunk_size])

    def probe(self, tokens: Sequence[int] | None = None, *, keys: Sequence[ChunkKey] | None = None,
              skip_tokens: int = 0, lease: Hashable = None) -> Hit:
        """LOOKUP (leases the hit, starts its promotion), then QUERY_PREFETCH_STATUS for up to
        ``prefetch_wait_s`` while lower tiers are staged. ``Hit(0, 0)`` on any failure."""
        rid = int(lease) if lease is not None else 0  # type: ignore[call-overload]
        keys = keys if keys is not None else self.chunk_keys(tokens or [])
        try:
            status, _ = self.client.call(p.Lookup(rid, w.join_keys(keys), self._tokens_for(keys, tokens), skip_tokens))
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

    def lookup(self, tokens: Sequence[int] | None = None, *, keys: Sequence[ChunkKey] | None = None,
               skip_tokens: int = 0, lease: Hashable = None) -> int:
        """End (tokens from 0) of the run every rank holds; 0 on any failure."""
        return self.probe(tokens, keys=keys, skip_tokens=skip_tokens, lease=lease).tokens

    def release(self, lease: Hashable) -> None:
        rid = int(lease)  # type: ignore[call-overload]
        if self.client.ready:
            self.client.submit(p.Release(rid))  # fire and forget: the server releases idempotently

    # ---- copies ----------------------------------------------------------------------------------
    def _deadline(self) -> int:
        return time.monotonic_ns() + int(self.client.timeout_s * 0.5e9) if self.exported.kind != "bytes" else 0

    def store(self, tokens: Sequence[int] | None, block_ids: Sequence[int], *, keys: Sequence[ChunkKey],
              stream: Any = None) -> _Handle:
        """Send every full chunk of ``keys`` (from ``pool[block_ids]``); skipped when unavailable."""
        if not self.ready or not keys:
            return _Handle(None)
        assert self.layout is not None
        chunks = min(len(keys), len(block_ids) // self.layout.blocks_per_chunk)
        ids = list(block_ids[: chunks * self.layout.blocks_per_chunk])
        blob = w.join_keys(keys[:chunks])
        if self.exported.kind == "bytes":
            payload = self._gather(ids, stream)
            future = self.client.submit(p.Store(blob, ids), [payload], timeout=self._bulk_timeout(len(payload)))
        else:
            synced = self.exported.before_copy(stream)
            future = self.client.submit(p.Store(blob, ids, self._deadline(), synced))
        return _Handle(future, lambda result: result[0].stored_chunks)

    def retrieve(self, tokens: Sequence[int] | None, block_ids: Sequence[int], *, keys: Sequence[ChunkKey],
                 skip_blocks: int = 0, num_blocks: int | None = None, lease: Hashable = None, stream: Any = None) -> int:
        """Load ``[skip_blocks, skip_blocks+num_blocks)``; returns tokens valid from 0 afterwards."""
        return self.retrieve_async(None, block_ids, keys=keys, skip_blocks=skip_blocks, num_blocks=num_blocks,
                                   lease=lease, stream=stream).result()

    def retrieve_async(self, tokens: Sequence[int] | None, block_ids: Sequence[int], *, keys: Sequence[ChunkKey],
                       skip_blocks: int = 0, num_blocks: int | None = None, lease: Hashable = None,
                       stream: Any = None, by_layer: bool = False) -> _Handle:
        """``by_layer``: ask the server to copy layer by layer (CUDA IPC pools with layer events);
        where it did, ``stream`` is *not* made to wait and the handle's ``layered`` must be waited
        on layer by layer, else ``stream`` waits for the whole load as usual."""
        fallback = skip_blocks * self.tokens_per_block
        if not self.ready:
            return _Handle(None, fallback=fallback)
        session, rid = lease if isinstance(lease, tuple) else (self.client.session_id, lease)
        ids = list(block_ids)
        by_layer = by_layer and self.exported.layered
        msg = p.Retrieve(w.join_keys(keys), ids, skip_blocks, num_blocks, session if rid is not None else 0,
                         None if rid is None else int(rid), self._deadline(), self.exported.before_copy(stream), by_layer)
        bulk = len(ids) * self._base.bytes_per_block if self.exported.kind == "bytes" else 0
        handle = _Handle(self.client.submit(msg, timeout=self._bulk_timeout(bulk)), fallback=fallback)

        def finish(result: Any) -> int:
            reply, payloads = result
            if self.exported.kind == "bytes":
                if reply.loaded_blocks:
                    self._scatter(ids[skip_blocks : skip_blocks + reply.loaded_blocks], payloads[0], stream)
            elif reply.by_layer:
                if not by_layer:  # its events would say nothing about this load
                    raise ValueError("the server answered by layer a load not asked for by layer")
                handle.layered = self.exported.layered_load()
            else:
                self.exported.after_load(stream)
            return reply.end_tokens

        handle._finish = finish
        return handle

    def _bulk_timeout(self, nbytes: int) -> float:
        return self.client.timeout_s + nbytes / 1e9  # bytes-mode payloads: allow ~1 GB/s on top

    def _gather(self, ids: list[int], stream: Any) -> memoryview:
        """Blocks ``ids`` as one buffer: per block, every view's row in order."""
        device = self._views[0].device
        index = torch.as_tensor(ids, dtype=torch.long, device=device)
        with _on_stream(stream, device):
            parts = [view.index_select(0, index) for view in self._views]
            rows = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).cpu()
        return memoryview(rows.reshape(-1).numpy())

    def _scatter(self, ids: list[int], payload: Any, stream: Any) -> None:
        device = self._views[0].device
        rows = frame_tensor(payload).view(len(ids), -1)
        index = torch.as_tensor(ids, dtype=torch.long, device=device)
        with _on_stream(stream, device):
            rows = rows.to(device)
            offset = 0
            for view in self._views:
                width = view.shape[1]
                view.index_copy_(0, index, rows[:, offset : offset + width])
                offset += width

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


def _on_stream(stream: Any, device: torch.device) -> Any:
    """The caller's CUDA stream (else the current one) for copies on ``device``; nothing on CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(stream or torch.cuda.current_stream(device))
