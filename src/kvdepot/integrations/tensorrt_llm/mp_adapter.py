"""TensorRT-LLM KV connector, multi-process mode: kvdepot's engine lives in ``kvdepot server``.

    KvCacheConnectorConfig(connector_module="kvdepot.integrations.tensorrt_llm.mp_adapter",
                           connector_scheduler_class="KvDepotMPConnectorScheduler",
                           connector_worker_class="KvDepotMPConnectorWorker")

The names TensorRT-LLM configurations already use: the connector's one scheduler and one worker
(``scheduler.py``, ``worker.py``) with the mode pinned to server. The server URL comes from
``KVDEPOT_SERVER_URL`` (or ``server_url`` in the config file), else the per-user default.
TensorRT-LLM 1.2's config has only the three fields above and rejects any other; where a version's
config has ``server_url`` (main), ``kv_connector_config.server_url`` wins.

Scheduler (rank 0)                                  Worker (every rank)
  LOOKUP + QUERY_PREFETCH_STATUS: in host memory ->   register_kv_caches -> REGISTER its shard (CUDA
  sync; still promoted from disk/Redis -> is_async    IPC / shared file / bytes) with the server
  (loaded via update_state_after_alloc's blocks)      start_load_kv -> RETRIEVE (server copies,
                                                        by layer where in-process would)
  hits count only where every TP rank holds the       wait_for_save -> notes the step's saves
  chunk (the server checks; keys are rank-free)       get_finished -> STORE (after sampling); saves
                                                      replied, async loads in

IPC constraint: the server maps the worker's pool, so server and engine share the machine (and
the GPUs); over TCP to another host only "bytes" pools work. If the server is down, lookups
answer 0 and stores are skipped (one warning per outage); the client re-registers by itself.
"""

from __future__ import annotations

from kvdepot.integrations.tensorrt_llm.scheduler import KvDepotScheduler
from kvdepot.integrations.tensorrt_llm.worker import KvDepotWorker


class KvDepotMPConnectorScheduler(KvDepotScheduler):
    """``KvDepotScheduler``, in server mode."""

    server = True


class KvDepotMPConnectorWorker(KvDepotWorker):
    """``KvDepotWorker``, in server mode."""

    server = True
