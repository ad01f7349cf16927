"""Plain stand-ins for the parts of TensorRT-LLM's ``TorchLlmArgs`` that connectors read.

Connectors receive ``llm_args`` in their constructors and read, in the wild:
``kv_cache_config.tokens_per_block`` (every connector), ``kv_connector_config.server_url`` (LMCache
MP), ``tensor_parallel_size``/``pipeline_parallel_size``/``model`` (LMCache),
``parallel_config.to_mapping().rank`` (Dynamo KVBM), ``scheduler_config.capacity_scheduler_policy``
and ``max_beam_width``. Names and defaults follow TensorRT-LLM's ``llm_args.py`` (reference §4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvdepot.errors import ConfigError


class CapacitySchedulerPolicy(str, Enum):
    """TensorRT-LLM's capacity policies; connectors are only supported with GUARANTEED_NO_EVICT."""

    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    MAX_UTILIZATION = "MAX_UTILIZATION"
    STATIC_BATCH = "STATIC_BATCH"


@dataclass
class KvCacheConfig:
    """Pool sizing and reuse; ``max_tokens`` caps the pool at ``max_tokens // tokens_per_block`` blocks."""

    tokens_per_block: int = 32
    max_tokens: int | None = None
    enable_block_reuse: bool = True
    free_gpu_memory_fraction: float | None = 0.9
    enable_partial_reuse: bool = False  # we reuse whole blocks only; kept for connectors that read it
    host_cache_size: int | None = None
    dtype: str = "auto"


@dataclass
class KvCacheConnectorConfig:
    """Where the connector classes live; imported with ``importlib`` like TensorRT-LLM does."""

    connector_module: str = ""
    connector_scheduler_class: str = ""
    connector_worker_class: str = ""
    server_url: str | None = None


@dataclass
class SchedulerConfig:
    capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT


@dataclass
class Mapping:
    """The slice of ``tensorrt_llm.Mapping`` connectors read."""

    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0


@dataclass
class ParallelConfig:
    tp_size: int = 1
    pp_size: int = 1

    def to_mapping(self) -> Mapping:
        return Mapping(rank=0, world_size=self.tp_size * self.pp_size, tp_size=self.tp_size,
                       pp_size=self.pp_size)


@dataclass
class TorchLlmArgs:
    """What the executor hands to ``KvCacheConnectorScheduler/Worker.__init__``."""

    model: str = ""
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    kv_connector_config: KvCacheConnectorConfig | None = None
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    max_beam_width: int = 1
    max_batch_size: int = 64
    max_num_tokens: int = 8192  # per-iteration token budget; prefill chunks are cut to fit it
    enable_chunked_prefill: bool = True
    speculative_config: object | None = None
    cuda_graph_config: object | None = None  # always eager here, so layer hooks run every step
    backend: str = "pytorch"

    @property
    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size)


LlmArgs = TorchLlmArgs


def validate_llm_args(args: TorchLlmArgs, with_connector: bool) -> None:
    """Reject what TensorRT-LLM rejects (§3.1, §10.7) and what one rank cannot do."""
    if args.pipeline_parallel_size != 1 or args.tensor_parallel_size != 1:
        raise NotImplementedError("the reference runtime runs one rank: TP and PP must be 1")
    if args.max_beam_width != 1:
        raise NotImplementedError("beam search is not supported (max_beam_width must be 1)")
    tpb = args.kv_cache_config.tokens_per_block
    if tpb <= 0 or tpb & (tpb - 1):
        raise ConfigError(f"kv_cache_config.tokens_per_block={tpb} must be a power of two")
    if not with_connector:
        return
    if args.scheduler_config.capacity_scheduler_policy != CapacitySchedulerPolicy.GUARANTEED_NO_EVICT:
        raise NotImplementedError("KV connector is only supported with guaranteed no evict scheduler policy.")
    if args.speculative_config is not None:
        raise NotImplementedError("KV connector is not supported with speculative decoding.")
    if not args.kv_cache_config.enable_block_reuse:
        raise ConfigError("kv_cache_config.enable_block_reuse=False: TensorRT-LLM never consults the connector then")
