"""Counters of the byte tiers (disk, Redis), for operators: ``/metrics`` and ``kvdepot stats``.

One dataclass for both tiers, so an exporter needs one set of column names; a counter that does
not apply to a tier stays 0 (a disk is never ``unavailable``, Redis has no ``no_space``).
Every field is a plain number; ``dataclasses.asdict`` makes a stats row of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvdepot.storage.base import TierStats


@dataclass
class ByteTierStats(TierStats):
    """``TierStats`` (hits, misses, puts, evictions, dropped, corrupt, …) plus the I/O figures.

    ``hits``/``misses`` count reads (``get``/``get_into``); ``corrupt`` counts objects that failed
    their checksum or named another chunk/namespace; ``forged`` counts Redis values that failed
    the keyed tag of ``remote_secret`` (or carried none) — damage and forgery look alike to a MAC,
    so a damaged authenticated value counts here too.
    """

    forged: int = 0  # values refused by the keyed BLAKE3 tag (Redis with remote_secret)
    bytes_read: int = 0  # payload bytes of the hits served
    bytes_written: int = 0  # payload bytes stored by successful puts
    errors: int = 0  # I/O errors (disk) / error replies and outages met (Redis)
    write_behind_dropped: int = 0  # copies for this tier the write-behind queue dropped (full, closed)
    no_space: int = 0  # disk writes that met a full filesystem (ENOSPC/EDQUOT) and evicted to retry
    unavailable: int = 0  # Redis calls answered as misses because the server (or its node) was down
    shared_used_bytes: int = 0  # disk: bytes held under the whole disk_path (every process, namespace)
