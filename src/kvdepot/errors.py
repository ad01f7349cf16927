"""The small exception hierarchy every kvdepot layer raises from.

Tier I/O failures are *values* (a miss, ``False``), not exceptions; exceptions are for
bad input and broken invariants, so a caller can tell "not cached" from "you asked wrong".
"""

from __future__ import annotations


class KVDepotError(Exception):
    """Base of every error kvdepot raises on purpose."""


class ConfigError(KVDepotError, ValueError):
    """A configuration key, type or value is not allowed; the message names all three."""


class LayoutError(KVDepotError, ValueError):
    """A KV pool tensor, block id list or token list does not fit the registered geometry."""


class TierUnavailable(KVDepotError):
    """A storage tier cannot be reached right now (server down, disk gone); callers treat it as a miss."""


class Irrecoverable(KVDepotError):
    """State that must not be used any more (e.g. a server speaking another protocol version)."""


class PromisedLoadFailed(KVDepotError, RuntimeError):
    """A load promised to the engine delivered fewer tokens than promised (a chunk vanished or
    failed every checksum after the lookup, the server went away). Raised in the forward of the
    step that would read those blocks, so the engine answers the request with an error instead
    of computing from KV that is not there (TensorRT-LLM 1.2 cannot take a promise back)."""
