"""``kvdepot stats``: a running server's live figures, printed."""

from __future__ import annotations

import sys
from typing import IO

from kvdepot.errors import KVDepotError
from kvdepot.server import protocol as p
from kvdepot.server.client import DepotClient
from kvdepot.server.metrics import format_stats
from kvdepot.server.paths import default_url


def print_stats(url: str | None = None, file: IO[str] | None = None, timeout_s: float = 2.0) -> int:
    """Print a running server's live figures; 0 on success, 1 if no server answers."""
    url = url or default_url()
    client = DepotClient(url, timeout_s=timeout_s, heartbeat_s=3600.0, name="kvdepot-stats", connect=False,
                         log_outages=False)
    try:
        if not client.connect():
            print(f"kvdepot: no server answering at {url}", file=sys.stderr)
            return 1
        stats, _ = client.call(p.GetStats())
        print(format_stats(stats), file=file or sys.stdout)  # type: ignore[arg-type]
        return 0
    except KVDepotError as exc:
        print(f"kvdepot: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
