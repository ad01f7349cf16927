"""Reference paged inference engine: proves a KV connector the way TensorRT-LLM would drive it.

``Engine`` runs a Llama-architecture model (``model``, ``weights``) over a KV pool in TensorRT-LLM's
layout, managed like its V1 block manager (``block_manager``), and calls a connector in the
executor's documented order (``connector``, ``executor``). ``llm_args`` and ``request`` mimic the
objects a connector receives. ``tp`` runs tensor parallelism as TensorRT-LLM does: a process per rank.
"""

from kvdepot.runtime.block_manager import Allocation, BlockManager, OutOfBlocks
from kvdepot.runtime.connector import ConnectorManager, resolve_connector_classes
from kvdepot.runtime.executor import Engine, ExecutorStopped
from kvdepot.runtime.llm_args import (
    CapacitySchedulerPolicy,
    KvCacheConfig,
    KvCacheConnectorConfig,
    MainKvCacheConnectorConfig,
    SchedulerConfig,
    TorchLlmArgs,
)
from kvdepot.runtime.model import PRESETS, LlamaModel, ModelConfig, RopeScaling, Segment
from kvdepot.runtime.request import CppRequestView, LlmRequest, LlmRequestState, Result
from kvdepot.runtime.tp import TpGroup, launch
from kvdepot.runtime.weights import (
    LlamaWeights,
    build_model,
    config_from_hf,
    load_checkpoint,
    random_weights,
)

__all__ = [
    "PRESETS", "Allocation", "BlockManager", "CapacitySchedulerPolicy", "ConnectorManager",
    "CppRequestView", "Engine", "ExecutorStopped", "KvCacheConfig", "KvCacheConnectorConfig", "LlamaModel",
    "LlamaWeights", "LlmRequest", "LlmRequestState", "MainKvCacheConnectorConfig", "ModelConfig", "OutOfBlocks", "Result",
    "RopeScaling", "SchedulerConfig", "Segment", "TorchLlmArgs", "TpGroup", "build_model", "config_from_hf",
    "launch", "load_checkpoint", "random_weights", "resolve_connector_classes",
]
