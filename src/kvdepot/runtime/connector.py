"""The executor's side of the KV connector API: TensorRT-LLM's ``KvCacheConnectorManager``, per rank.

Every rule a connector can observe lives here, in one place (reference §2–§3, §10):

* the scheduler and worker classes come from ``connector_module`` via ``importlib`` (or are given
  directly) and are constructed concurrently in a 2-thread pool, each with the full ``llm_args``;
* ``register_forward_pass_callable()`` is asked once; ``register_kv_caches(pool)`` runs once;
* ``get_num_new_matched_tokens`` gets a binding-only request view, ``update_state_after_alloc`` and
  ``request_finished`` the Python request; ``(0, True)`` and leaving no prompt token to compute
  raise like TensorRT-LLM's checks;
* ``SchedulerOutput`` is built from cumulative per-request token/block lists (first appearance:
  whole prompt and all blocks; then deltas), subtracting this step's synchronous connector matches
  from ``computed_position`` of new requests;
* the metadata is pickled and unpickled on its way to the worker, as 1.2's broadcast does;
* ids enter ``get_finished`` exactly once; ids coming back must have been handed over before;
* tensor parallel (``tp``, one manager per rank process): the scheduler lives on rank 0 only; its
  answers (matched tokens, metadata, ``request_finished``) are broadcast to every rank, and an id
  ``get_finished`` reports counts once every rank's worker has reported it.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvdepot.errors import ConfigError
from kvdepot.integrations.tensorrt_llm.api import (
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    RequestData,
    SchedulerOutput,
)
from kvdepot.runtime.request import CppRequestView, LlmRequest, LlmRequestState
from kvdepot.runtime.tp import TpGroup

ConnectorClasses = tuple[type[KvCacheConnectorScheduler], type[KvCacheConnectorWorker]]


def resolve_connector_classes(llm_args: Any) -> ConnectorClasses | None:
    """Import ``kv_connector_config.connector_module`` and fetch both classes by name."""
    cfg = getattr(llm_args, "kv_connector_config", None)
    if cfg is None:
        return None
    names = (cfg.connector_module, cfg.connector_scheduler_class, cfg.connector_worker_class)
    if not all(names):
        raise ConfigError(f"kv_connector_config needs module, scheduler and worker class, got {names}")
    module = importlib.import_module(cfg.connector_module)
    return getattr(module, cfg.connector_scheduler_class), getattr(module, cfg.connector_worker_class)


class ConnectorManager:
    """Drives one connector (scheduler + worker) on behalf of the executor loop."""

    def __init__(self, scheduler: KvCacheConnectorScheduler | None, worker: KvCacheConnectorWorker,
                 tp: TpGroup | None = None):
        self.scheduler = scheduler  # None on TP ranks other than 0
        self.worker = worker
        self.tp = tp
        self._reports: dict[tuple[str, int], set[int]] = {}  # (kind, id) -> ranks that reported it
        self.forward_pass_callable: Callable[[], Any] | None = (
            worker.register_forward_pass_callable() or None
        )
        self._registered = False
        self._seen: dict[int, tuple[int, int]] = {}  # request id -> (tokens, blocks) reported
        self._external_loads: dict[int, int] = {}  # this step's synchronous connector matches
        self._new_saving: list[int] = []
        self._new_loading: list[int] = []
        self._pending_saving: set[int] = set()
        self._pending_loading: set[int] = set()

    @classmethod
    def create(cls, classes: ConnectorClasses, llm_args: Any, tp: TpGroup | None = None) -> ConnectorManager:
        """Construct worker and scheduler (rank 0 only) concurrently: either may wait on the other in __init__."""
        scheduler_cls, worker_cls = classes
        with ThreadPoolExecutor(max_workers=2) as pool:
            worker_f = pool.submit(worker_cls, llm_args)
            scheduler_f = pool.submit(scheduler_cls, llm_args) if tp is None or tp.rank == 0 else None
            worker, scheduler = worker_f.result(), scheduler_f.result() if scheduler_f else None
        return cls(scheduler, worker, tp)

    def _from_rank0(self, ask: Callable[[KvCacheConnectorScheduler], Any]) -> Any:
        """The scheduler's answer (rank 0), broadcast to every rank under TP."""
        answer = ask(self.scheduler) if self.scheduler is not None else None
        return self.tp.broadcast(answer) if self.tp is not None else answer

    def register_kv_caches(self, pool: Any) -> None:
        if self._registered:
            raise RuntimeError("register_kv_caches must be called exactly once")
        self._registered = True
        self.worker.register_kv_caches(pool)

    # -- admission -------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, req: LlmRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """Ask the scheduler how many tokens past the device match it can load; validate the answer."""
        num, is_async = self._from_rank0(
            lambda s: tuple(s.get_num_new_matched_tokens(CppRequestView(req), num_computed_tokens)))
        num, is_async = int(num), bool(is_async)
        if num == 0 and is_async:
            raise RuntimeError("load_kv_async must be False when num_tokens is 0!")
        if num < 0:
            raise RuntimeError(f"connector matched a negative number of tokens ({num})")
        if num_computed_tokens + num >= req.prompt_len:
            # TensorRT-LLM: TLLM_CHECK(prepopulatedPromptLen < promptLen) in setPrepopulatedPromptLen.
            raise RuntimeError(
                f"[TensorRT-LLM][ERROR] Assertion failed: prepopulatedPromptLen < promptLen "
                f"({num_computed_tokens} + {num} >= {req.prompt_len}) for request {req.request_id}"
            )
        if is_async:
            self._new_loading.append(req.request_id)
            self._pending_loading.add(req.request_id)
        elif num:
            self._external_loads[req.request_id] = num
        return num, is_async

    def update_state_after_alloc(self, req: LlmRequest, block_ids: Sequence[int]) -> None:
        if self.scheduler is not None:  # rank 0 only, and not broadcast (as in 1.2)
            self.scheduler.update_state_after_alloc(req, list(block_ids))

    # -- one step --------------------------------------------------------------------------------

    def build_scheduler_output(
        self, batch: Sequence[LlmRequest], block_ids: Callable[[int], list[int]]
    ) -> SchedulerOutput:
        """Per §2.1: cumulative token/block lists per request, reported as deltas."""
        out = SchedulerOutput(new_requests=[], cached_requests=[])
        for req in batch:
            tokens, blocks = req.get_tokens(0), block_ids(req.request_id)
            is_new = req.request_id not in self._seen
            seen_tokens, seen_blocks = self._seen.get(req.request_id, (0, 0))
            if req.state == LlmRequestState.CONTEXT_INIT:
                computed = req.context_current_position
                scheduled = min(req.context_remaining_length, req.context_chunk_size)
            else:
                computed, scheduled = len(tokens) - 1, 1
            if is_new:
                # "Don't include the connector matched tokens in the initial scheduler output."
                computed -= self._external_loads.get(req.request_id, 0)
            data = RequestData(req.request_id, tokens[seen_tokens:], blocks[seen_blocks:],
                               computed, scheduled)
            (out.new_requests if is_new else out.cached_requests).append(data)
            self._seen[req.request_id] = (len(tokens), len(blocks))
        self._external_loads.clear()
        return out

    def start_batch(self, out: SchedulerOutput, stream: Any) -> None:
        """``handle_metadata`` then ``start_load_kv(outer stream)``. The metadata goes through a
        pickle round trip (1.2 broadcasts it over MPI) and is simply replaced each step."""
        meta = pickle.loads(self._from_rank0(lambda s: pickle.dumps(s.build_connector_meta(out))))
        self.worker.bind_connector_meta(meta)
        self.worker.start_load_kv(stream)

    def layer_hooks(self, exec_stream: Any) -> tuple[Callable[[int], None], Callable[[int], None]]:
        """Module hooks on every decoder layer; they get the stream current during the forward,
        i.e. the execution stream (``None`` on CPU)."""
        return (lambda i: self.worker.wait_for_layer_load(i, exec_stream),
                lambda i: self.worker.save_kv_layer(i, exec_stream))

    def forward_done(self) -> None:
        """The forward-pass callable, if any: run at the end of every forward, still on its stream."""
        if self.forward_pass_callable is not None:
            self.forward_pass_callable()

    def wait_for_save(self, outer_stream: Any) -> None:
        """After the outer stream has been made to wait for the execution stream."""
        self.worker.wait_for_save(outer_stream)

    # -- completion ------------------------------------------------------------------------------

    def request_finished(self, req: LlmRequest, block_ids: Sequence[int]) -> bool:
        """True: the connector saves asynchronously, so the caller keeps the blocks until told."""
        saving = bool(self._from_rank0(lambda s: bool(s.request_finished(req, list(block_ids)))))
        if saving:
            self._new_saving.append(req.request_id)
            self._pending_saving.add(req.request_id)
        return saving

    def get_finished(self) -> tuple[list[int], list[int]]:
        """Hand new ids to the worker once; return the saves and loads it reports complete."""
        new_saving, new_loading = self._new_saving, self._new_loading
        self._new_saving, self._new_loading = [], []
        saved, loaded = self.worker.get_finished(new_saving, new_loading)
        saved, loaded = list(saved or []), list(loaded or [])
        for ids, pending, what in ((saved, self._pending_saving, "saving"),
                                   (loaded, self._pending_loading, "loading")):
            unknown = [i for i in ids if i not in pending]
            if unknown:
                raise RuntimeError(f"connector worker reported {what} ids {unknown} it was not given")
        if self.tp is not None:
            saved, loaded = self._on_every_rank(saved, loaded)
        for ids, pending in ((saved, self._pending_saving), (loaded, self._pending_loading)):
            pending.difference_update(ids)
        return saved, loaded

    def _on_every_rank(self, saved: list[int], loaded: list[int]) -> tuple[list[int], list[int]]:
        """The ids every rank has now reported (all-gathered; a rank may report one later than another)."""
        assert self.tp is not None
        done: dict[str, list[int]] = {"save": [], "load": []}
        for rank, (rank_saved, rank_loaded) in enumerate(self.tp.all_gather((saved, loaded))):
            for kind, ids in (("save", rank_saved), ("load", rank_loaded)):
                for rid in ids:
                    ranks = self._reports.setdefault((kind, rid), set())
                    ranks.add(rank)
                    if len(ranks) == self.tp.size:
                        del self._reports[(kind, rid)]
                        done[kind].append(rid)
        return done["save"], done["load"]

    @property
    def has_pending(self) -> bool:
        return bool(self._pending_saving or self._pending_loading)

    def forget(self, request_id: int) -> None:
        """The request's blocks are freed; drop its bookkeeping."""
        self._seen.pop(request_id, None)
        self._external_loads.pop(request_id, None)
