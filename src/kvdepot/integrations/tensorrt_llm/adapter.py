"""TensorRT-LLM KV connector, in-process mode: kvdepot's engine lives in the TensorRT-LLM process.

    KvCacheConnectorConfig(connector_module="kvdepot.integrations.tensorrt_llm.adapter",
                           connector_scheduler_class="KvDepotConnectorScheduler",
                           connector_worker_class="KvDepotConnectorWorker")

The names TensorRT-LLM configurations already use: the connector's one scheduler and one worker
(``scheduler.py``, ``worker.py``) with the mode pinned to in-process whatever ``server_url`` says.
``kvdepot.integrations.tensorrt_llm`` itself offers ``KvDepotScheduler``/``KvDepotWorker``, which
pick the mode by configuration; ``mp_adapter`` pins server mode.

Scheduler (rank 0)                               Worker (every rank)
  get_num_new_matched_tokens -> engine.probe       register_kv_caches -> the process's CacheEngine
  build_connector_meta -> KvDepotMetadata          start_load_kv -> engine.retrieve (load stream,
  request_finished -> True while saves run           by layer once the hooks were seen)
                                                   wait_for_save -> notes the step's saves
                                                   get_finished -> engine.store (after sampling);
                                                     requests whose saves completed

In-process mode sees this rank's pool only: with ``tensor_parallel_size > 1`` it saves but never
claims a hit (use server mode).
"""

from __future__ import annotations

from kvdepot.integrations.tensorrt_llm.scheduler import KvDepotScheduler
from kvdepot.integrations.tensorrt_llm.worker import KvDepotWorker


class KvDepotConnectorScheduler(KvDepotScheduler):
    """``KvDepotScheduler``, in-process."""

    server = False


class KvDepotConnectorWorker(KvDepotWorker):
    """``KvDepotWorker``, in-process."""

    server = False
