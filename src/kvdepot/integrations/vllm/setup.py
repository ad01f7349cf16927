"""What the vLLM connector's halves are built from: settings read once from vLLM's config, and
(``setup.provider()``) the engine provider for the mode (``providers.py``).

    Setup.from_vllm(vllm_config, kv_cache_config) -> Setup   kvdepot config, stats file, KV group, roles
    setup.provider() -> EngineProvider                       InProcess, or ViaServer when ``server_url`` is set
    StatsFile(path).write(event, **fields)                   one JSON line per event (O_APPEND)
    ensure_log_handler()                                     our logger prints even inside vLLM

Extra config keys (``kv_connector_extra_config``): any kvdepot config key (``chunk_size``,
``host_capacity_gb``, ``server_url``, … or LMCache's names for them) over the usual sources, and
``stats_file``, which is the connector's own.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvdepot.config import DepotConfig, load_config
from kvdepot.integrations.vllm.providers import EngineProvider, InProcess, ViaServer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("kvdepot")

OWN_EXTRA_KEYS = frozenset({"stats_file"})


def ensure_log_handler() -> None:
    """vLLM configures only its own logger: give ours a handler when nobody else did."""
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("kvdepot %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


class StatsFile:
    """Appends one JSON object per line; each write is one small ``O_APPEND`` write."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        if not self.path:
            return
        line = json.dumps({"event": event, "pid": os.getpid(), "t": round(time.time(), 6), **fields}) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line)


def depot_config(vllm_config: VllmConfig, extra: dict[str, Any]) -> DepotConfig:
    """kvdepot's config: the extra config's keys over file and environment; model id from vLLM."""
    overrides = {k: v for k, v in extra.items() if k not in OWN_EXTRA_KEYS}
    config = load_config(**overrides)
    if not config.model_id:
        model = getattr(getattr(vllm_config, "model_config", None), "model", "") or ""
        config = load_config(**overrides, model_id=str(model))
    if config.log_level:  # unset: the application's logging settings stand
        logger.setLevel(config.log_level)
    return config


def group_spec(kv_cache_config: KVCacheConfig | None) -> tuple[Any, list[str]] | None:
    """The single full-attention KV cache group's spec and layers, or None if unsupported."""
    if kv_cache_config is None:
        return None
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if len(groups) != 1:
        return None
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    spec = groups[0].kv_cache_spec
    # NOTE: exact types: subclasses (sinks, hidden states, …) change what a block holds.
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        return None
    return spec, list(groups[0].layer_names)


@dataclass(frozen=True)
class Setup:
    """What a connector half knows from construction on; shared by the roles' classes."""

    vllm_config: Any  # VllmConfig
    kv_cache_config: Any  # KVCacheConfig | None
    config: DepotConfig
    stats: StatsFile
    group: tuple[Any, list[str]] | None  # (spec, layer names) of the one supported group, else None
    block: int  # tokens per vLLM (manager) block
    loads: bool  # kv_role kv_both / kv_consumer
    saves: bool  # kv_role kv_both / kv_producer

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> Setup:
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None, "vLLM builds connectors only with a kv_transfer_config"
        extra = dict(transfer.kv_connector_extra_config or {})
        group = group_spec(kv_cache_config)
        block = int(group[0].block_size) if group else int(vllm_config.cache_config.block_size)
        if group is None:
            logger.warning("kvdepot: only models with one full-attention KV cache group are supported; kvdepot is off")
        return cls(vllm_config, kv_cache_config, depot_config(vllm_config, extra), StatsFile(extra.get("stats_file")),
                   group, block, bool(transfer.is_kv_consumer), bool(transfer.is_kv_producer))

    @property
    def server_url(self) -> str | None:
        """Server mode when set (extra config ``server_url``, ``KVDEPOT_SERVER_URL``, config file)."""
        return self.config.server_url or None

    def provider(self) -> EngineProvider:
        return ViaServer(self) if self.server_url else InProcess(self)
