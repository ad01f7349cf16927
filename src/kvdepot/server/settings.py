"""What ``kvdepot server`` checks before it listens: settings that would make it useless.

    check_settings(config)    raises ConfigError, one line naming the key, the value and why

A server with an unusable setting would start, print "listening", and then refuse every
engine's REGISTER (a disk tier that cannot be made, a chunk size no engine's block size
divides) or fail later on every lookup (a Redis URL that names nothing). The operator learns it
at start-up instead, and ``kvdepot server`` exits with status 2.

    chunk_size   a power of two: engines' block sizes are (8, 16, 32, 64, 128 tokens), and a
                 chunk must hold whole blocks of every engine that registers
    disk_path    a directory that exists or can be made, where a file can be written
    remote_url   redis://HOST[:PORT][/DB], rediss://…, or unix:///PATH, answering within
                 remote_timeout_s
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from urllib.parse import urlsplit

from kvdepot.config import DepotConfig
from kvdepot.errors import ConfigError

_SCHEMES = ("redis", "rediss", "unix")


def check_settings(config: DepotConfig) -> None:
    """Refuse, in one line, a setting this server could not serve with."""
    _check_chunk_size(config.chunk_size)
    if config.disk_path:
        _check_disk_path(config.disk_path)
    if config.remote_url:
        _check_remote_url(config.remote_url, config.remote_timeout_s)


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ConfigError(f"config key 'chunk_size': {chunk_size} is not a power of two (e.g. 256); a chunk must hold "
                          "whole blocks of every engine, whose block sizes are powers of two")


def _check_disk_path(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".kvdepot-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(f"config key 'disk_path': {path!r} is not a writable directory "
                          f"({exc.strerror or exc})") from None


def _check_remote_url(url: str, timeout_s: float) -> None:
    shown = _without_password(url)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        raise ConfigError(f"config key 'remote_url': {shown!r} is malformed ({exc})") from None
    if parts.scheme not in _SCHEMES or (parts.scheme == "unix" and not parts.path) or (
            parts.scheme != "unix" and not parts.hostname):
        raise ConfigError(f"config key 'remote_url': {shown!r} is not a Redis URL; expected redis://HOST[:PORT][/DB], "
                          "rediss://HOST[:PORT][/DB] or unix:///PATH")
    from kvdepot.storage.redis_tier import RedisTier  # redis lives in the Redis tier

    try:
        with _quiet("kvdepot"):
            tier = RedisTier(url, bytes(16), timeout_s=timeout_s, retry_after_s=3600.0)
            try:
                tier.contains(bytes(16))
                reachable = tier.available
            finally:
                tier.close()
    except ValueError as exc:  # redis-py's own URL parsing
        raise ConfigError(f"config key 'remote_url': {shown!r} is malformed ({exc})") from None
    if not reachable:
        raise ConfigError(f"config key 'remote_url': no Redis answers at {shown!r} within {timeout_s} s "
                          "(start it, or unset remote_url)")


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """The probe's own outage warning (with its traceback) would be a second, longer message."""
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)
