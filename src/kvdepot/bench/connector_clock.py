"""Host time spent inside a TensorRT-LLM connector's calls, for ``kvdepot bench ttft``.

    with ConnectorClock() as clock: ...          every scheduler and worker call site (``HOOKS``)
    with ConnectorClock({"worker": ("wait_for_layer_load",)}) as hooks: ...   the layer hooks only
    clock.seconds                                the total, a call made from another one counted once
"""

from __future__ import annotations

import contextlib
import time
from unittest import mock


class ConnectorClock:
    """Host time spent inside the connector's calls (scheduler and worker, either mode), per call
    site wrapped on the classes while the clock runs. The 0%-reuse rows time every site: the
    copies run off the forward stream, so a miss can cost a step at most this host time, a bound
    that two engines' decode speeds, which moved by up to 20% between paired runs on the H200 (run
    Q), cannot resolve. The hit rows time the layer hooks alone: what a load by layer holds the
    forward's host thread (in-process its copies' issue, in server mode its waits for the server)."""

    HOOKS = {"scheduler": ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                           "request_finished"),
             "worker": ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished")}

    def __init__(self, hooks: dict[str, tuple[str, ...]] = HOOKS) -> None:
        self.hooks, self.seconds, self._depth, self._patches = hooks, 0.0, 0, contextlib.ExitStack()

    def __enter__(self) -> ConnectorClock:
        from kvdepot.integrations.tensorrt_llm.scheduler import KvDepotScheduler
        from kvdepot.integrations.tensorrt_llm.worker import KvDepotWorker

        for cls, role in ((KvDepotScheduler, "scheduler"), (KvDepotWorker, "worker")):
            for name in self.hooks.get(role, ()):
                self._patches.enter_context(mock.patch.object(cls, name, self._timed(cls.__dict__[name])))
        return self

    def __exit__(self, *exc: object) -> None:
        self._patches.close()

    def _timed(self, fn):
        def timed(*args, **kwargs):
            self._depth += 1
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:  # a hook called from another hook is counted once
                    self.seconds += time.perf_counter() - started

        return timed
