"""What the TensorRT-LLM connector halves are built from: kvdepot's config read from ``llm_args``
and the mode, and (``setup.provider()``) the engine provider for that mode (``providers.py``).

    Setup.from_llm_args(llm_args, server=None) -> Setup   config, block size, TP rank/size, server URL
    setup.provider() -> EngineProvider                    InProcess or ViaServer

Mode: server when a server URL is configured (``kv_connector_config.server_url`` on TensorRT-LLM
versions that have the field, else ``KVDEPOT_SERVER_URL`` or the config file), in-process
otherwise; ``server=True/False`` pins it (the ``adapter`` and ``mp_adapter`` class names do). In
server mode without a configured URL the per-user default socket is used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvdepot.config import DepotConfig, load_config
from kvdepot.integrations.tensorrt_llm.providers import EngineProvider, InProcess, ViaServer
from kvdepot.server.paths import default_url

logger = logging.getLogger("kvdepot")


def _configured_url(llm_args: Any, config: DepotConfig) -> str | None:
    # NOTE: TensorRT-LLM 1.2's KvCacheConnectorConfig has no server_url field (main has): read it if there.
    connector = getattr(llm_args, "kv_connector_config", None)
    return getattr(connector, "server_url", None) or config.server_url or None


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
        logger.setLevel(config.log_level)
    return config


@dataclass(frozen=True)
class Setup:
    """What both halves know from construction on (``llm_args`` is read here only)."""

    config: DepotConfig
    tokens_per_block: int
    tp_rank: int
    tp_size: int
    server_url: str | None  # server mode when set

    @classmethod
    def from_llm_args(cls, llm_args: Any, server: bool | None = None) -> Setup:
        """``server``: None picks the mode by configuration; True/False pins it."""
        config = depot_config(llm_args)
        url = _configured_url(llm_args, config)
        if server is True:
            url = url or default_url()
        elif server is False:
            url = None
        rank, size = tp_rank_and_size(llm_args)
        return cls(config, int(llm_args.kv_cache_config.tokens_per_block), rank, size, url)

    def provider(self) -> EngineProvider:
        return ViaServer(self) if self.server_url else InProcess(self)
