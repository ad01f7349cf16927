"""TensorRT-LLM integration: the in-process adapter (``adapter``) and the multi-process one
(``mp_adapter``). The base classes come from TensorRT-LLM when it imports (old module path, then
new), else from compatible stand-ins, so ``import kvdepot`` never needs TensorRT-LLM."""

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
    "RequestData",
    "SchedulerOutput",
]
