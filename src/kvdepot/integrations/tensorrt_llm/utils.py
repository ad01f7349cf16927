"""Shared by the TensorRT-LLM adapters: the process's engine singleton and reading ``llm_args``.

TensorRT-LLM builds the worker and the scheduler concurrently. The worker's
``register_kv_caches`` creates the engine (it blocks until the engine is ready); the scheduler
resolves it lazily with ``current_engine()`` and answers "no hit" until it exists, so neither
constructor waits on the other.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvdepot.config import DepotConfig, load_config
from kvdepot.engine import CacheEngine
from kvdepot.integrations.slot import EngineSlot

logger = logging.getLogger("kvdepot")

_slot = EngineSlot()


def tokens_per_block(llm_args: Any) -> int:
    return int(llm_args.kv_cache_config.tokens_per_block)


def tp_rank_and_size(llm_args: Any) -> tuple[int, int]:
    """This process's TP rank and the TP size; rank from TensorRT-LLM's MPI helper when present."""
    size = int(getattr(llm_args, "tensor_parallel_size", 1) or 1)
    rank = 0
    try:
        from tensorrt_llm._utils import mpi_rank  # type: ignore[import-not-found]

        rank = int(mpi_rank())
    except (ImportError, OSError, RuntimeError):
        rank = 0
    return rank % size, size


def depot_config(llm_args: Any) -> DepotConfig:
    """kvdepot's config for this engine: env/file/defaults, model id from ``llm_args.model``."""
    config = load_config()
    if not config.model_id:
        config = load_config(model_id=str(getattr(llm_args, "model", "") or ""))
    if config.log_level:  # unset: the application's logging settings stand
        logging.getLogger("kvdepot").setLevel(config.log_level)
    return config


def get_or_create_engine(llm_args: Any, pool: torch.Tensor) -> CacheEngine:
    """The process's engine: created on the first call, re-registered with the new pool after."""

    def create() -> CacheEngine:
        rank, size = tp_rank_and_size(llm_args)
        config = depot_config(llm_args)
        engine = CacheEngine.for_pool(pool, tokens_per_block(llm_args), config, tp_rank=rank, tp_size=size)
        logger.info(
            "kvdepot: engine ready (pool %s %s, %d B/block, chunk %d tokens, host %d chunks)",
            tuple(pool.shape), pool.dtype, engine.layout.bytes_per_block, config.chunk_size, engine.host.num_slots,
        )
        return engine

    engine, created = _slot.get_or_create(create, lambda e: e.register_pool(pool))
    if not created:
        logger.info("kvdepot: re-registered KV pool %s on the existing engine", tuple(pool.shape))
    return engine


current_engine = _slot.current
destroy_engine = _slot.destroy
