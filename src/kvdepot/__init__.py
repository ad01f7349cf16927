"""kvdepot: a KV-cache layer for LLM inference engines.

Core (no engine imports): ``config``, ``keys``, ``layout``, ``transfer``, ``storage``, ``engine``.
Engine adapters live under ``kvdepot.integrations`` and are imported only by the engines.
"""

from kvdepot.config import DepotConfig, load_config
from kvdepot.engine import CacheEngine, EngineStats, StoreHandle
from kvdepot.errors import ConfigError, KVDepotError, LayoutError
from kvdepot.keys import ChunkHasher, ChunkKey, Namespace
from kvdepot.layout import PoolLayout

__version__ = "0.1.0"

__all__ = [
    "CacheEngine",
    "ChunkHasher",
    "ChunkKey",
    "ConfigError",
    "DepotConfig",
    "EngineStats",
    "KVDepotError",
    "LayoutError",
    "Namespace",
    "PoolLayout",
    "StoreHandle",
    "load_config",
]
