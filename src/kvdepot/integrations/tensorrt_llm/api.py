"""TensorRT-LLM's KV connector interface: the real classes when TensorRT-LLM is installed, else
compatible stand-ins with the same signatures.

The module moved between releases: ``tensorrt_llm._torch.pyexecutor.kv_cache_connector`` (v1.2.x)
and ``tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector`` (1.3 main line). We try the
old path, then the new one; when neither imports (no TensorRT-LLM, or no NVIDIA driver for its
native bindings) we define the classes here so ``kvdepot`` and our reference runtime work alone.
The stand-ins follow the reference exactly: ABCs with the same abstract methods, and the
five-field ``RequestData`` of the v1.2 era (later fields have defaults and are not read).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_MODULE_PATHS = (
    "tensorrt_llm._torch.pyexecutor.kv_cache_connector",
    "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",
)


def _import_real() -> tuple[Any, str] | tuple[None, None]:
    for path in _MODULE_PATHS:
        try:
            module = importlib.import_module(path)
        except (ImportError, OSError, RuntimeError):
            continue
        if hasattr(module, "KvCacheConnectorScheduler") and hasattr(module, "KvCacheConnectorWorker"):
            return module, path
    return None, None


_real, TRTLLM_MODULE_PATH = _import_real()
HAVE_TRTLLM = _real is not None

if _real is not None:
    KvCacheConnectorScheduler = _real.KvCacheConnectorScheduler
    KvCacheConnectorWorker = _real.KvCacheConnectorWorker
    SchedulerOutput = _real.SchedulerOutput
    RequestData = _real.RequestData
else:

    @dataclass
    class RequestData:  # type: ignore[no-redef]
        """One request's delta for the upcoming forward pass (v1.2 fields, in order)."""

        request_id: int
        new_tokens: list[int]
        new_block_ids: list[int]
        computed_position: int
        num_scheduled_tokens: int

    @dataclass
    class SchedulerOutput:  # type: ignore[no-redef]
        """Requests scheduled for the first time (whole prompt, all blocks) and the rest (deltas)."""

        new_requests: list[RequestData] = field(default_factory=list)
        cached_requests: list[RequestData] = field(default_factory=list)

    class KvCacheConnectorWorker(ABC):  # type: ignore[no-redef]
        """Runs on every rank; moves KV between the engine's pool and the connector's storage."""

        def __init__(self, llm_args: Any) -> None:
            self._llm_args = llm_args
            self._metadata: object = None

        def bind_connector_meta(self, metadata: object) -> None:
            self._metadata = metadata

        def get_connector_meta(self) -> object:
            return self._metadata

        def _clear_connector_meta(self) -> None:
            self._metadata = None

        def register_forward_pass_callable(self) -> Callable[[], None] | None:
            return None

        @abstractmethod
        def register_kv_caches(self, kv_cache_tensor: Any) -> None: ...

        @abstractmethod
        def start_load_kv(self, stream: Any) -> None: ...

        @abstractmethod
        def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None: ...

        @abstractmethod
        def save_kv_layer(self, layer_idx: int, stream: Any) -> None: ...

        @abstractmethod
        def wait_for_save(self, stream: Any) -> None: ...

        @abstractmethod
        def get_finished(
            self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
        ) -> tuple[list[int], list[int]]: ...

    class KvCacheConnectorScheduler(ABC):  # type: ignore[no-redef]
        """Runs on rank 0; decides what each request loads and saves."""

        def __init__(self, llm_args: Any) -> None:
            self._llm_args = llm_args

        @abstractmethod
        def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object: ...

        @abstractmethod
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]: ...

        @abstractmethod
        def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool: ...

        @abstractmethod
        def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None: ...


__all__ = [
    "HAVE_TRTLLM",
    "TRTLLM_MODULE_PATH",
    "KvCacheConnectorScheduler",
    "KvCacheConnectorWorker",
    "RequestData",
    "SchedulerOutput",
]
