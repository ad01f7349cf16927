"""Walking a disk tier's directory: every chunk file and temp file under it, in all namespaces.

Layout: ``<path>/<namespace hex>/<kk>/<key hex>``; temp files end in ``.tmp`` and name their
writer's claim id (``disk_budget``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from kvdepot.keys import KEY_BYTES

_HEX = frozenset("0123456789abcdef")


def _is_hex(name: str, n: int) -> bool:
    return len(name) == n and set(name) <= _HEX


def objects(base: Path) -> Iterator[tuple[os.DirEntry[str], bool]]:
    """Every chunk file and temp file under ``base`` (all namespaces): (entry, is_temp)."""
    for ns in os.scandir(base):
        if not (_is_hex(ns.name, 32) and ns.is_dir(follow_symlinks=False)):
            continue
        for shard in os.scandir(ns.path):
            if shard.name.endswith(".tmp"):
                yield shard, True  # an O_DIRECT probe
            elif _is_hex(shard.name, 2) and shard.is_dir(follow_symlinks=False):
                for entry in os.scandir(shard.path):
                    if entry.name.endswith(".tmp"):
                        yield entry, True
                    elif _is_hex(entry.name, 2 * KEY_BYTES) and entry.is_file(follow_symlinks=False):
                        yield entry, False


def stat_all(base: Path) -> Iterator[tuple[str, os.stat_result]]:
    """(path, stat) of every chunk file under ``base``; one removed meanwhile is skipped."""
    for entry, temp in objects(base):
        if not temp:
            try:
                yield entry.path, entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue


def temp_owner(name: str) -> str:
    """The claim id in a temp file's name (``.<key>.<claim>.tmp``, ``.probe-<claim>.tmp``); ""
    for a name from before claims (their writer cannot be told apart: removed only when alone)."""
    stem = name[1:-4]
    owner = stem.rsplit(".", 1)[-1] if "." in stem else stem.removeprefix("probe-")
    return owner if _is_hex(owner, 32) else ""
