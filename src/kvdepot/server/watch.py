"""``kvdepot stats --watch``: a running server's figures redrawn in place, with per-second rates.

    watch(url, interval_s) -> int      until Ctrl-C (0), or 1 if no server answers at the start
    render(stats, previous, dt) -> str one frame (what the tests look at)

Plain ANSI (home + clear) rather than a curses UI: it works in any terminal, tmux and ``watch``'s
absence alike, and a frame is the same text ``kvdepot stats`` prints plus a rates table. Rates
come from the difference of two snapshots, so they are what happened in the last interval.
"""

from __future__ import annotations

import sys
import time
from typing import IO

from kvdepot.errors import KVDepotError
from kvdepot.server import protocol as p
from kvdepot.server.metrics import format_stats

_CLEAR = "\x1b[H\x1b[2J"
_RATES = (("hits", "hits/s", 1.0), ("misses", "misses/s", 1.0), ("lookups", "lookups/s", 1.0),
          ("bytes_stored", "store GB/s", 1e-9), ("bytes_loaded", "load GB/s", 1e-9), ("evictions", "evictions/s", 1.0))


def render(stats: p.StatsReply, previous: p.StatsReply | None, dt: float) -> str:
    lines = [time.strftime("%H:%M:%S") + f"  kvdepot stats --watch (every {dt:g} s; Ctrl-C quits)", "",
             format_stats(stats), ""]
    before = {(s.group, s.rank): s.figures for s in previous.shards} if previous is not None else {}
    header = ["model", "rank", *(label for _, label, _ in _RATES), "hit ratio"]
    rows = []
    for shard in stats.shards:
        old = before.get((shard.group, shard.rank), {})
        f = shard.figures
        rates = [(f.get(k, 0.0) - old.get(k, 0.0)) * scale / dt if old else 0.0 for k, _, scale in _RATES]
        looked = (f.get("hits", 0.0) - old.get("hits", 0.0)) + (f.get("misses", 0.0) - old.get("misses", 0.0))
        ratio = f"{(f.get('hits', 0.0) - old.get('hits', 0.0)) / looked:.0%}" if old and looked else "-"
        rows.append([shard.group, str(shard.rank), *(f"{r:.3f}" if r < 100 else f"{r:.0f}" for r in rates), ratio])
    if rows:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        lines.append("rates over the last interval:")
        lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def watch(url: str | None, interval_s: float = 1.0, out: IO[str] | None = None, frames: int | None = None) -> int:
    """Redraw every ``interval_s`` until Ctrl-C (or ``frames`` frames, for tests)."""
    from kvdepot.server.client import DepotClient
    from kvdepot.server.paths import default_url

    out = out or sys.stdout
    url = url or default_url()
    interval_s = max(0.1, interval_s)
    client = DepotClient(url, timeout_s=2.0, heartbeat_s=3600.0, name="kvdepot-watch", connect=False, log_outages=False)
    previous, shown = None, 0
    try:
        if not client.connect():
            print(f"kvdepot: no server answering at {url}", file=sys.stderr)
            return 1
        while frames is None or shown < frames:
            try:
                stats, _ = client.call(p.GetStats())
            except KVDepotError as exc:  # the server went away: say so in place, keep trying
                print(f"{_CLEAR}{time.strftime('%H:%M:%S')}  kvdepot server at {url}: {exc}; retrying", file=out, flush=True)
                previous = None
            else:
                print(_CLEAR + render(stats, previous, interval_s), file=out, flush=True)
                previous = stats
            shown += 1
            if frames is None or shown < frames:
                time.sleep(interval_s)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()
