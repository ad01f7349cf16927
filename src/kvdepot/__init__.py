"""kvdepot: a KV-cache layer for LLM inference engines.

Core (no engine imports): ``config``, ``keys``, ``layout``, ``transfer``, ``storage``, ``engine``.
Engine adapters live under ``kvdepot.integrations`` and are imported only by the engines.

The names below are imported on first use (PEP 562): ``import kvdepot.config`` — what the
``kvdepot`` command and every engine's connector start with — must not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CacheEngine": "kvdepot.engine",
    "EngineStats": "kvdepot.engine",
    "StoreHandle": "kvdepot.engine",
    "ChunkHasher": "kvdepot.keys",
    "ChunkKey": "kvdepot.keys",
    "Namespace": "kvdepot.keys",
    "ConfigError": "kvdepot.errors",
    "KVDepotError": "kvdepot.errors",
    "LayoutError": "kvdepot.errors",
    "DepotConfig": "kvdepot.config",
    "load_config": "kvdepot.config",
    "PoolLayout": "kvdepot.layout",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvdepot' has no attribute {name!r}")
