"""Plain stand-ins for the parts of TensorRT-LLM's ``TorchLlmArgs`` that connectors read.

Connectors receive ``llm_args`` in their constructors and read, in the wild:
``kv_cache_config.tokens_per_block`` (every connector), ``kv_connector_config.server_url`` (LMCache
MP), ``tensor_parallel_size``/``pipeline_parallel_size``/``model`` (LMCache),
``parallel_config.to_mapping().rank`` (Dynamo KVBM), ``scheduler_config.capacity_scheduler_policy``
and ``max_beam_width``. Names and defaults follow TensorRT-LLM 1.2's ``llm_args.py`` (reference §3):
the connector config is 1.2's strict three-field model (``server_url`` there is a start-up error,
``MainKvCacheConnectorConfig`` is the opt-in for main's wider one), and the overlap scheduler is on
by default as in 1.2 (``disable_overlap_scheduler=False``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

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


class KvCacheConnectorConfig:
    """TensorRT-LLM 1.2's ``llm_args.KvCacheConnectorConfig``: strict, keyword-only, three fields.

    1.2 declares it a pydantic ``StrictBaseModel``: exactly ``connector_module``,
    ``connector_scheduler_class`` and ``connector_worker_class``, each a required ``str``; positional
    arguments raise ``TypeError`` and any other key (``server_url`` included) is rejected with
    "Extra inputs are not permitted". A double that accepted more hid exactly that start-up crash, so
    this one refuses the same inputs. Main's wider model is ``MainKvCacheConnectorConfig`` (opt-in).
    """

    FIELDS: ClassVar[tuple[str, ...]] = ("connector_module", "connector_scheduler_class", "connector_worker_class")
    OPTIONAL: ClassVar[dict[str, object]] = {}  # key -> default; main's model widens this
    __slots__ = ("connector_module", "connector_scheduler_class", "connector_worker_class")

    def __init__(self, **data: object) -> None:
        self._validate(data)
        for name in (*self.FIELDS, *self.OPTIONAL):
            object.__setattr__(self, name, data.get(name, self.OPTIONAL.get(name)))

    @classmethod
    def _validate(cls, data: dict[str, object]) -> None:
        errors = [f"{k}: Extra inputs are not permitted" for k in data if k not in cls.FIELDS and k not in cls.OPTIONAL]
        errors += [f"{k}: Field required" for k in cls.FIELDS if k not in data]
        errors += [f"{k}: Input should be a valid string, got {type(v).__name__}" for k, v in data.items()
                   if not isinstance(v, str) and (k in cls.FIELDS or (k in cls.OPTIONAL and v is not None))]
        if errors:
            raise ConfigError(f"{len(errors)} validation error(s) for {cls.__name__}: " + "; ".join(errors)
                              + f" (allowed keys: {', '.join((*cls.FIELDS, *cls.OPTIONAL))})")

    @classmethod
    def model_validate(cls, data: object) -> KvCacheConnectorConfig:
        """Build from a mapping, as ``kv_connector_config:`` in ``--extra_llm_api_options`` YAML is."""
        if not isinstance(data, dict):
            raise ConfigError(f"{cls.__name__} needs a mapping, got {type(data).__name__}")
        return cls(**data)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen here (set {name!r} when building it)")

    def __eq__(self, other: object) -> bool:
        names = (*self.FIELDS, *self.OPTIONAL)
        return type(other) is type(self) and all(getattr(self, n) == getattr(other, n) for n in names)

    def __repr__(self) -> str:
        names = (*self.FIELDS, *self.OPTIONAL)
        return f"{type(self).__name__}(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in names) + ")"


class MainKvCacheConnectorConfig(KvCacheConnectorConfig):
    """TensorRT-LLM main's (post-1.2) wider model: a ``connector`` preset and ``server_url``, with the
    class fields optional. Opt-in only: nothing released as 1.2 accepts these keys."""

    FIELDS: ClassVar[tuple[str, ...]] = ()
    OPTIONAL: ClassVar[dict[str, object]] = {
        "connector_module": None, "connector_scheduler_class": None, "connector_worker_class": None,
        "connector": None, "server_url": None,
    }
    __slots__ = ("connector", "server_url")


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
        rank = _mpi_rank()
        return Mapping(rank=rank, world_size=self.tp_size * self.pp_size, tp_size=self.tp_size,
                       pp_size=self.pp_size, tp_rank=rank % self.tp_size)


def _mpi_rank() -> int:
    """This process's rank as TensorRT-LLM tells it (``runtime.tp`` provides it in rank processes)."""
    try:
        from tensorrt_llm._utils import mpi_rank  # type: ignore[import-not-found]
    except ImportError:
        return 0
    return int(mpi_rank())


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
    cuda_graph_config: object | None = None  # eager only: set, it is refused with a connector (§3.2)
    # 1.2's default: the next forward is enqueued before the last one's tokens reach the host, so
    # request_finished comes one iteration late and decode deltas lag a token (reference §5.1, §6.1).
    disable_overlap_scheduler: bool = False
    backend: str = "pytorch"

    @property
    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size)


LlmArgs = TorchLlmArgs


def validate_llm_args(args: TorchLlmArgs, with_connector: bool, ranks: int = 1) -> None:
    """Reject what TensorRT-LLM rejects (§3.1, §10.7) and what the runtime's ``ranks`` cannot do."""
    if args.pipeline_parallel_size != 1:
        raise NotImplementedError("the reference runtime has no pipeline parallelism: pipeline_parallel_size must be 1")
    if args.tensor_parallel_size != ranks:
        raise NotImplementedError(f"tensor_parallel_size={args.tensor_parallel_size} needs that many rank processes "
                                  f"(runtime.tp.launch), this engine is one of {ranks}")
    if args.max_beam_width != 1:
        raise NotImplementedError("beam search is not supported (max_beam_width must be 1)")
    tpb = args.kv_cache_config.tokens_per_block
    if tpb <= 0 or tpb & (tpb - 1):
        raise ConfigError(f"kv_cache_config.tokens_per_block={tpb} must be a power of two")
    if not with_connector:
        return
    if args.scheduler_config.capacity_scheduler_policy != CapacitySchedulerPolicy.GUARANTEED_NO_EVICT:
        raise NotImplementedError("KV connector is only supported with guaranteed no evict scheduler policy.")
    if args.cuda_graph_config is not None:
        raise NotImplementedError("CUDA graphs are not supported with KV connector hooks.")
    if args.speculative_config is not None:
        raise NotImplementedError("KV connector is not supported with speculative decoding.")
    if not args.kv_cache_config.enable_block_reuse:
        raise ConfigError("kv_cache_config.enable_block_reuse=False: TensorRT-LLM never consults the connector then")
