"""Every configuration key, in one table, and the rules for where values come from.

The table is the ``DepotConfig`` dataclass itself: each field carries its type, default and
doc (in ``metadata``), so there is no second list to keep in step. Sources, lowest first:

1. the defaults below;
2. a YAML file named by ``KVDEPOT_CONFIG_FILE`` (kvdepot keys, or LMCache's names for the
   same things, so an LMCache config file can be brought as it is);
3. ``KVDEPOT_<KEY>`` environment variables (strings, parsed by the key's type);
4. explicit arguments (``load_config(chunk_size=128)``).

An unknown key, a value of the wrong type or a value out of range raises ``ConfigError``
naming the key, the value and what is allowed. Caller-owned objects are never mutated.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvdepot.errors import ConfigError

logger = logging.getLogger("kvdepot")

ENV_PREFIX = "KVDEPOT_"
CONFIG_FILE_ENV = "KVDEPOT_CONFIG_FILE"


def _key(default: Any, doc: str, *, choices: tuple[str, ...] = (), minimum: float | None = None, secret: bool = False):
    """A key; a ``secret`` one is left out of the config's repr and shown as *** by ``kvdepot config``."""
    return field(default=default, repr=not secret, metadata={"doc": doc, "choices": choices, "minimum": minimum, "secret": secret})


@dataclass(frozen=True)
class DepotConfig:
    """Normalized configuration consumed by every kvdepot layer (never an engine's own config)."""

    chunk_size: int = _key(256, "Tokens per cached chunk; a multiple of the engine's tokens_per_block.", minimum=1)
    host_capacity_gb: float = _key(4.0, "Host (pinned when CUDA is present) memory for the host tier, in GB.", minimum=0)
    disk_path: str | None = _key(None, "Directory of the disk tier; unset disables it.")
    disk_capacity_gb: float = _key(16.0, "Capacity of the disk tier in GB.", minimum=0)
    remote_url: str | None = _key(None, "Redis/Valkey URL (redis://, rediss://, unix://) of the shared tier; unset disables it.")
    server_url: str | None = _key(None, "URL of a kvdepot server (multi-process mode); unset uses the per-user ipc:// default.")
    save_decode_cache: bool = _key(False, "Also save chunks completed during decode, not only the prompt's.")
    log_level: str | None = _key(None, "Level of the 'kvdepot' logger; unset leaves it to the application (kvdepot server: INFO).", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    hash_algo: str = _key("xxh3_128", "Digest of the chained chunk keys (128-bit); blake3 is cryptographic, for untrusted multi-tenant prompts.", choices=("xxh3_128", "blake3"))
    cache_salt: str = _key("", "Mixed into every key: deployments with different salts never share KV.")
    model_id: str = _key("", "Model identity mixed into every key; adapters fill it from the engine's model name.")
    lease_timeout_s: float = _key(30.0, "Seconds a looked-up chunk stays pinned if its load never comes.", minimum=0.001)
    pin_host_memory: str = _key("auto", "Pin the host tier's memory: auto = when CUDA is available.", choices=("auto", "true", "false"))
    transfer_mover: str = _key("auto", "Block copy path (all on the copy engines): runs = one copy call per run of adjacent blocks, staged = GPU gather + few large copies, batch = one driver call (cuMemcpyBatchAsync) per window of per-run copies; auto = batch where the driver has it (CUDA 13), else staged below 2 MiB blocks, runs above.", choices=("auto", "batch", "runs", "staged"))
    load_by_layer: str = _key("auto", "TensorRT-LLM: copy a hit layer by layer so that each layer's forward starts once its own KV is in (wait_for_layer_load). auto = where each layer's part of a block is >= 64 KiB on a CUDA pool with the batch mover, once the engine's layer hooks have been seen to fire; in MP mode the worker's setting asks and the server's can refuse (CUDA IPC pools only); off = whole blocks, the forward waits for all of them.", choices=("auto", "off"))
    load_layers_ahead: int = _key(4, "Layered loads: layers enqueued in start_load_kv, and how far ahead of the forward's wait it enqueues layers itself where the engine's layer thread has not yet (in-process; that thread enqueues the rest); more: more driver calls before the forward starts, 64 = all of them in start_load_kv. A server's loads enqueue none before its reply (its own thread enqueues them all).", minimum=0)
    load_layer_thread: bool = _key(True, "In-process loads by layer: a helper thread enqueues the layers after the first load_layers_ahead while the forward runs (its driver calls release the GIL); false = the forward's layer hooks enqueue them (no thread; their driver calls then take the forward's host time, which is TTFT wherever the host paces the forward). The server always issues a load's layers on its own thread.")
    layer_progress: str = _key("auto", "MP loads by layer: how the forward learns that the server recorded a layer's event. auto = from a shared-memory progress page the server writes (x86-64 hosts, ipc:// servers that map it), else by LAYERS round trips; rpc = always LAYERS round trips (one per layer the forward catches up with).", choices=("auto", "rpc"))
    store_head_mib: float = _key(16.0, "CUDA stores, batch mover: while the store issuer thread wakes up (it sleeps when idle), the calling thread enqueues the store's first copies itself, up to this many MiB (at least its first window, 2 MiB), and stops as soon as the issuer has taken over; 0 = the issuer enqueues everything (the copy engines wait for it to wake).", minimum=0)
    transfer_lanes: int = _key(1, "Batch mover: streams a move's copy windows alternate on, joined back into the move's stream (2 = two copy engines may overlap each copy's fixed cost; an experiment for small blocks, measured by kvdepot bench transfer --lanes 1,2).", minimum=1)
    disk_admission: str = _key("always", "Which chunks the disk takes: all, or only those seen twice (stored or hit).", choices=("always", "second_hit"))
    disk_o_direct: str = _key("auto", "O_DIRECT for the disk tier: auto = probe the directory and fall back to buffered I/O.", choices=("auto", "true", "false"))
    disk_fsync: bool = _key(False, "Fsync each disk object and its directory before it counts as stored.")
    remote_timeout_s: float = _key(0.5, "Connect and per-operation socket timeout of the Redis tier, in seconds.", minimum=0.001)
    remote_retry_s: float = _key(1.0, "After a Redis outage, answer misses this long before trying again.", minimum=0)
    remote_ttl_s: float | None = _key(None, "Expire Redis values after this many seconds; unset keeps them until Redis evicts.", minimum=0.001)
    remote_cluster: bool = _key(False, "remote_url names one seed node of a Redis Cluster / Valkey cluster (redis:// or rediss://), served through redis-py's cluster client; run it with cluster-require-full-coverage no, so a dead master costs only its slots.")
    remote_secret: str | None = _key(None, "Shared secret of the Redis tier: values carry a keyed BLAKE3 tag derived from it, and a value whose tag fails (forged, or written without the secret) is a miss, counted. Every node of a deployment needs the same secret; unset = checksummed values only.", secret=True)
    write_queue_depth: int = _key(4096, "Most write-behind jobs waiting for lower tiers; more are dropped and counted. A job is a chunk's key: its bytes are read from host memory when written (counted gone if evicted by then), so depth costs no memory (so are copies of chunks promoted from Redis to disk).", minimum=1)
    promote_to_disk: bool = _key(True, "Copy chunks promoted from Redis to disk too (a lazy write-behind job: read back from its host slot when written).")
    promote_streams: int = _key(4, "Chunks read at once when a lower-tier hit is promoted into host memory (each on its own thread and Redis connection): one stream leaves the checksum and the per-read round trip unoverlapped, and several streams spread over a Redis Cluster's masters.", minimum=1)
    server_curve_dir: str | None = _key(None, "Directory of the CURVE keys written by `kvdepot keys DIR`: a tcp:// server admits only the clients whose public keys are in it, and its clients encrypt with them (the server reads server.key_secret and authorized_clients/, clients server.key and client.key_secret); ipc:// does not use it.")
    server_timeout_s: float = _key(2.0, "Multi-process mode: every client call to the server gives up after this many seconds (then: no hit, store skipped).", minimum=0.001)
    session_timeout_s: float = _key(30.0, "Server: close a silent client's session (its leases, mapped pool) after this many seconds.", minimum=0.1)
    metrics_port: int = _key(0, "Server: serve Prometheus metrics on metrics_host:PORT (0 = off).", minimum=0)
    metrics_host: str = _key("127.0.0.1", "Server: address the Prometheus metrics listen on (0.0.0.0: every interface).")
    tp_kv_copies: str = _key(
        "auto",
        "Server mode under tensor parallelism: copies of a chunk the server keeps. per-rank = one per "
        "TP rank (each rank's pool holds its own KV heads); one = one copy, loaded into every rank's "
        "pool, for KV that is the same on every rank (an MLA latent); auto = one where the pool has "
        "kv_factor 1 (TensorRT-LLM's MLA pools), per-rank otherwise.",
        choices=("auto", "per-rank", "one"),
    )
    lower_tier_hits: str = _key(
        "load",
        "How a hit found only on disk/Redis is served to the request that found it. load: "
        "TensorRT-LLM's lookup waits (at most lower_tier_wait_s) while it is read into host memory "
        "and is promised what arrived; vLLM's request is parked while it is read and recomputes "
        "what could not be (docs/tiers.md). prefetch: the request gets only the host part; the "
        "rest is promoted in the background for later requests. The old value async means load.",
        choices=("load", "prefetch"),
    )
    lower_tier_wait_s: float = _key(
        1.0,
        "TensorRT-LLM, lower_tier_hits: load: the longest a lookup waits for a disk/Redis hit to be "
        "read into host memory before it promises what has arrived (1.2 cannot take back a promise "
        "that then fails, so it promises only bytes already read); 0 = never wait.",
        minimum=0,
    )
    lower_tier_gate: bool = _key(
        True,
        "With lower_tier_hits: load, promise a hit's disk/Redis part only when reading it is expected "
        "to be faster than recomputing it: the lower tiers' read rate (finished promotions) against the "
        "engine's prefill rate (the steps the connector sees), both measured at run time; until both are, "
        "and with false, it is always promised. A part not promised is still promoted, for later requests "
        "(docs/tiers.md).",
    )

    kv_events_endpoint: str | None = _key(
        None,
        "Publish vLLM-format KV events (which chunks host memory, disk and Redis hold) on this ZMQ "
        "PUB address, e.g. tcp://*:5557: bound when it is a wildcard or ipc:// address, connected "
        "otherwise; unset = off. See docs/events.md.",
    )
    kv_events_topic: str = _key("", "Topic frame of every KV-event message (empty by default).")
    kv_events_replay_endpoint: str | None = _key(
        None, "ZMQ ROUTER address (always bound) that answers requests for missed KV-event batches; unset = no replay."
    )

    def __post_init__(self) -> None:
        if self.lower_tier_hits == "async":  # the old, unsafe mode's name: now the safe load
            _warn_async_once()
            object.__setattr__(self, "lower_tier_hits", "load")
        for f in dataclasses.fields(self):
            _check_value(f, getattr(self, f.name))
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(_ZMQ_SCHEMES):
                raise ConfigError(f"config key {name!r}: value {value!r} is not allowed; expected a ZMQ address "
                                  "starting with " + ", ".join(_ZMQ_SCHEMES) + " (or unset)")
        _check_remote(self)


_warned_async = False


def _warn_async_once() -> None:
    global _warned_async
    if not _warned_async:
        _warned_async = True
        logger.warning("config key 'lower_tier_hits': value 'async' is the old name of 'load'; using 'load'")


def _check_remote(config: DepotConfig) -> None:
    """``remote_url`` must be a URL redis-py can use (checked here, not at the first call)."""
    if config.remote_url is not None:
        # NOTE: imported here: redis-py is loaded only when a URL is set
        from kvdepot.storage.redis_client import redact, url_problem

        problem = url_problem(config.remote_url, config.remote_cluster)
        if problem is not None:
            raise ConfigError(f"config key 'remote_url': value {redact(config.remote_url)!r} is not allowed; {problem}")
    if config.remote_secret == "":
        raise ConfigError("config key 'remote_secret': an empty secret is not allowed; expected a string (or unset)")


_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


# LMCache's names for the same things, so a user can bring an LMCache config file.
LMCACHE_ALIASES: dict[str, str] = {
    "max_local_cpu_size": "host_capacity_gb",
    "local_disk": "disk_path",
    "max_local_disk_size": "disk_capacity_gb",
    "remote_url": "remote_url",
    "chunk_size": "chunk_size",
    "save_decode_cache": "save_decode_cache",
}
# LMCache keys that have no meaning here: accepted from a file and ignored with a warning,
# so an LMCache config loads; anything else unknown is an error.
LMCACHE_IGNORED = frozenset({"local_cpu", "remote_serde", "use_layerwise", "enable_blending", "lmcache_instance_id"})

_FIELDS = {f.name: f for f in dataclasses.fields(DepotConfig)}


def config_keys() -> list[dataclasses.Field]:
    """The table: one dataclass field per key (name, type, default, ``metadata['doc']``)."""
    return list(_FIELDS.values())


def _allowed(f: dataclasses.Field) -> str:
    choices = f.metadata["choices"]
    if choices:
        return "one of " + ", ".join(repr(c) for c in choices)
    kind = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
    base = str(f.type).replace(" | None", "")
    text = kind.get(base, base)
    if f.metadata["minimum"] is not None:
        text += f" >= {f.metadata['minimum']:g}"
    if "None" in str(f.type):
        text += " (or unset)"
    return text


def _fail(name: str, value: Any, f: dataclasses.Field) -> ConfigError:
    return ConfigError(f"config key {name!r}: value {value!r} is not allowed; expected {_allowed(f)}")


def _check_value(f: dataclasses.Field, value: Any) -> None:
    optional = "None" in str(f.type)
    base = str(f.type).replace(" | None", "")
    if value is None:
        if optional:
            return
        raise _fail(f.name, value, f)
    ok_type = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
    }[base]
    if not ok_type:
        raise _fail(f.name, value, f)
    if f.metadata["choices"] and value not in f.metadata["choices"]:
        raise _fail(f.name, value, f)
    minimum = f.metadata["minimum"]
    if minimum is not None and not value >= minimum:  # NOTE: written so that NaN fails too
        raise _fail(f.name, value, f)


def _parse_env(f: dataclasses.Field, raw: str) -> Any:
    """Environment values are strings: parse them by the key's type, strictly."""
    base = str(f.type).replace(" | None", "")
    text = raw.strip()
    if "None" in str(f.type) and text == "":
        return None
    try:
        if base == "int":
            return int(text)
        if base == "float":
            return float(text)
    except ValueError:
        raise _fail(f.name, raw, f) from None
    if base == "bool":
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise _fail(f.name, raw, f)
    return text


def _from_file(path: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{CONFIG_FILE_ENV}={path!r}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:  # a directory, no permission, not text
        raise ConfigError(f"{CONFIG_FILE_ENV}={path!r}: cannot be read ({exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{CONFIG_FILE_ENV}={path!r}: not valid YAML ({' '.join(str(exc).split())})") from None  # one line
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{CONFIG_FILE_ENV}={path!r}: expected a mapping of keys, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key)
        if name in LMCACHE_IGNORED:
            logger.warning("config file %s: LMCache key %r has no meaning in kvdepot; ignored", path, name)
            continue
        target = LMCACHE_ALIASES.get(name, name)
        if target not in _FIELDS:
            raise ConfigError(
                f"config file {path!r}: unknown key {name!r} (value {value!r}); allowed keys: {', '.join(sorted(_FIELDS))}"
            )
        out[target] = _normalize_alias(name, value)
    return out


def _normalize_alias(name: str, value: Any) -> Any:
    """LMCache writes the disk directory as ``file:///path``; kvdepot takes the path."""
    if name == "local_disk" and isinstance(value, str) and value.startswith("file://"):
        return value[len("file://"):]
    return value


def resolve_config(
    overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> tuple[DepotConfig, dict[str, str]]:
    """Return the effective config and, per key, where its value came from."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources = {name: "default" for name in _FIELDS}
    file_path = env.get(CONFIG_FILE_ENV)
    if file_path:
        for name, value in _from_file(file_path).items():
            values[name], sources[name] = value, f"file {file_path}"
    known_vars = {CONFIG_FILE_ENV} | {ENV_PREFIX + name.upper() for name in _FIELDS}
    for var, raw in env.items():
        if var.startswith(ENV_PREFIX) and var not in known_vars:
            raise ConfigError(
                f"unknown config variable {var!r} (value {raw!r}); allowed: {CONFIG_FILE_ENV} and "
                + ", ".join(ENV_PREFIX + n.upper() for n in sorted(_FIELDS))
            )
    for name, f in _FIELDS.items():
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name], sources[name] = _parse_env(f, raw), f"env {ENV_PREFIX}{name.upper()}"
    for name, value in (overrides or {}).items():
        target = LMCACHE_ALIASES.get(name, name)
        if target not in _FIELDS:
            raise ConfigError(f"unknown config key {name!r} (value {value!r}); allowed keys: {', '.join(sorted(_FIELDS))}")
        values[target], sources[target] = _normalize_alias(name, value), "argument"
    return DepotConfig(**values), sources


def load_config(**overrides: Any) -> DepotConfig:
    """The effective config: defaults < ``KVDEPOT_CONFIG_FILE`` < ``KVDEPOT_*`` env < arguments."""
    return resolve_config(overrides)[0]
