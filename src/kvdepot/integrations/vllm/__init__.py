"""vLLM integration: ``KvDepotConnector``, a ``KVConnectorBase_V1`` for vLLM's V1 engine.

    from vllm.config import KVTransferConfig
    KVTransferConfig(kv_connector="KvDepotConnector",
                     kv_connector_module_path="kvdepot.integrations.vllm",
                     kv_role="kv_both")

In-process by default; with ``kv_connector_extra_config={"server_url": ...}`` (or
``KVDEPOT_SERVER_URL``) against a shared ``kvdepot server`` (modes: ``providers.py``).
The connector class is imported on first use, so ``kvdepot.integrations.vllm.layout`` (the
per-layer block views and their engine) imports without vLLM. See docs/vllm.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvDepotConnector", "KvDepotVllmMetadata"]


def __getattr__(name: str) -> Any:
    if name == "KvDepotConnector":
        from kvdepot.integrations.vllm.connector import KvDepotConnector

        return KvDepotConnector
    if name == "KvDepotVllmMetadata":
        from kvdepot.integrations.vllm.metadata import KvDepotVllmMetadata

        return KvDepotVllmMetadata
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
