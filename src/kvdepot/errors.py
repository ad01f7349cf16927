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
    """A load promised to the engine delivered fewer tokens than promised (the server went away or
    the lease was lost after the lookup). TensorRT-LLM 1.2 can neither take a promise back nor end
    a request with an error without storing its blocks for device reuse, so the connector raises
    this outside the forward and the engine's loop stops (a fail-stop, never wrong KV)."""
