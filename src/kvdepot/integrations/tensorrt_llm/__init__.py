"""TensorRT-LLM integration: one connector (``scheduler.KvDepotScheduler``, ``worker.KvDepotWorker``),
in-process or against ``kvdepot server`` by configuration (``setup.py``):

    KvCacheConnectorConfig(connector_module="kvdepot.integrations.tensorrt_llm",
                           connector_scheduler_class="KvDepotScheduler",
                           connector_worker_class="KvDepotWorker")

``adapter`` (in-process) and ``mp_adapter`` (server) keep the class names earlier configurations
use, each pinned to its mode. The base classes come from TensorRT-LLM when it imports (old module
path, then new), else from compatible stand-ins (``api.py``), so ``import kvdepot`` never needs
TensorRT-LLM. The connector classes are imported on first use, so importing ``api`` (all the
reference runtime needs) does not import kvdepot's engine or its server client.
"""

from __future__ import annotations

from typing import Any

from kvdepot.integrations.tensorrt_llm.api import (
    HAVE_TRTLLM,
    TRTLLM_MODULE_PATH,
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    RequestData,
    SchedulerOutput,
)

__all__ = [
    "HAVE_TRTLLM",
    "TRTLLM_MODULE_PATH",
    "KvCacheConnectorScheduler",
    "KvCacheConnectorWorker",
    "KvDepotScheduler",
    "KvDepotWorker",
    "RequestData",
    "SchedulerOutput",
]


def __getattr__(name: str) -> Any:
    if name == "KvDepotScheduler":
        from kvdepot.integrations.tensorrt_llm.scheduler import KvDepotScheduler

        return KvDepotScheduler
    if name == "KvDepotWorker":
        from kvdepot.integrations.tensorrt_llm.worker import KvDepotWorker

        return KvDepotWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
