"""Prometheus metrics of a running server, read from the service at scrape time.

    start_metrics(snapshot, port, host) -> stop()    port 0 = off; a taken port is a KVDepotError
    format_stats(stats) -> str                       what ``kvdepot stats`` prints
    exported_series() -> set[str]                    every series name /metrics can carry

No second set of counters is kept: each scrape reads ``DepotService.snapshot()``, so the figures
are the same ones ``kvdepot stats`` prints. The series are declared in the tables below, one line
each, so a new figure is exported by adding a line (and docs/grafana's test sees it):

- per shard (labels ``model``, ``rank``): ``SHARD_COUNTERS`` and ``SHARD_GAUGES`` read
  ``ShardStats.figures[field]``, plus ``kvdepot_store_gbps`` / ``kvdepot_load_gbps``;
- per lower tier (labels ``model``, ``rank``, ``tier``): ``TIER_COUNTERS`` / ``TIER_GAUGES`` read
  the flattened ``<tier>_<field>`` figures (``disk_hits``, ``redis_corrupt`` ...), so a tier added
  later is exported without a code change here;
- for the whole server: ``SERVER_GAUGES`` read ``StatsReply`` attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kvdepot.errors import KVDepotError
from kvdepot.server.protocol import StatsReply

# series name (without kvdepot_ and _total) -> (ShardStats.figures key, help)
SHARD_COUNTERS = {
    "hits": ("hits", "chunks found by lookups"),
    "misses": ("misses", "chunks looked up and not found"),
    "lookups": ("lookups", "lookup calls"),
    "bytes_stored": ("bytes_stored", "bytes copied from engines' pools into the cache"),
    "bytes_loaded": ("bytes_loaded", "bytes copied from the cache into engines' pools"),
    "evictions": ("evictions", "host-tier chunks evicted to make room"),
    "dropped_stores": ("dropped_stores", "stores dropped (no room: everything pinned)"),
    "refused_batches": ("refused_batches", "batched copies refused by the mover and split"),
}
SHARD_GAUGES = {
    "live_leases": ("live_leases", "looked-up chunks pinned for a load that has not come yet"),
    "pinned_chunks": ("pinned_chunks", "host-tier chunks pinned by leases or copies in flight"),
    "host_chunks": ("host_chunks", "chunks held in host memory"),
    "host_capacity_chunks": ("host_capacity_chunks", "host-tier slots"),
    "host_pending_chunks": ("host_pending_chunks", "host-tier slots not yet allocated (pinning in the background)"),
}
TIER_NAMES = ("disk", "redis")  # lower tiers whose <tier>_<field> figures are exported
TIER_COUNTERS = {
    "hits": "chunks served by the tier",
    "misses": "chunks asked of the tier and not found",
    "puts": "chunks written to the tier",
    "evictions": "chunks the tier evicted",
    "dropped": "writes the tier could not place (full, down, queue full)",
    "corrupt": "objects that failed verification (served as misses and removed)",
}
TIER_GAUGES = {
    "used_bytes": "bytes the tier holds",
    "capacity_bytes": "the tier's capacity in bytes (0: unbounded or unknown)",
    "chunks": "chunks the tier holds",
}
SERVER_GAUGES = {
    "clients": ("sessions", "connected client sessions"),
    "mappings": ("mappings", "engine pools mapped by the server"),
    "prefetches": ("prefetches", "lookups whose lower-tier promotion is still tracked"),
}


def exported_series() -> set[str]:
    """Every series name /metrics can carry (what a dashboard may query)."""
    names = {f"kvdepot_{n}_total" for n in SHARD_COUNTERS} | {f"kvdepot_{n}" for n in SHARD_GAUGES}
    names |= {"kvdepot_store_gbps", "kvdepot_load_gbps"}
    names |= {f"kvdepot_tier_{n}_total" for n in TIER_COUNTERS} | {f"kvdepot_tier_{n}" for n in TIER_GAUGES}
    return names | {f"kvdepot_{n}" for n in SERVER_GAUGES}


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def format_stats(stats: StatsReply) -> str:
    lines = [f"kvdepot server {stats.url} (pid {stats.pid}, up {stats.uptime_s:.0f} s): "
             f"{stats.sessions} clients, {stats.mappings} mapped pools, {stats.prefetches} live lookups"]
    if not stats.shards:
        lines.append("no model registered yet")
    for shard in stats.shards:
        f: dict[str, Any] = shard.figures
        lines.append(
            f"  {shard.group} rank {shard.rank}: {int(f.get('host_chunks', 0))}/{int(f.get('host_capacity_chunks', 0))} chunks, "
            f"hits {int(f.get('hits', 0))}, misses {int(f.get('misses', 0))}, lookups {int(f.get('lookups', 0))}, "
            f"stored {f.get('bytes_stored', 0) / 1e9:.3f} GB at {gbps(f.get('bytes_stored', 0), f.get('store_seconds', 0)):.2f} GB/s, "
            f"loaded {f.get('bytes_loaded', 0) / 1e9:.3f} GB at {gbps(f.get('bytes_loaded', 0), f.get('load_seconds', 0)):.2f} GB/s, "
            f"evictions {int(f.get('evictions', 0))}, leases {int(f.get('live_leases', 0))}, "
            f"pinned {int(f.get('pinned_chunks', 0))}"
        )
        for tier in TIER_NAMES:
            if f"{tier}_hits" in f:
                lines.append(f"    {tier}: " + ", ".join(
                    f"{field} {int(f.get(f'{tier}_{field}', 0))}" for field in (*TIER_GAUGES, *TIER_COUNTERS)))
    return "\n".join(lines)


class _Collector:
    def __init__(self, snapshot: Callable[[], StatsReply]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self._snapshot()
        labels = ["model", "rank"]

        def per_shard(family: Any, value: Callable[[dict[str, float]], float]) -> Any:
            for shard in stats.shards:
                family.add_metric([shard.group, str(shard.rank)], value(shard.figures))
            return family

        for name, (field, text) in SHARD_COUNTERS.items():  # the client appends _total
            yield per_shard(CounterMetricFamily(f"kvdepot_{name}", text, labels=labels), lambda f, k=field: f.get(k, 0.0))
        for name, (field, text) in SHARD_GAUGES.items():
            yield per_shard(GaugeMetricFamily(f"kvdepot_{name}", text, labels=labels), lambda f, k=field: f.get(k, 0.0))
        for direction, nbytes, secs in (("store", "bytes_stored", "store_seconds"), ("load", "bytes_loaded", "load_seconds")):
            yield per_shard(GaugeMetricFamily(f"kvdepot_{direction}_gbps", f"average {direction} GB/s over the shard's life",
                                              labels=labels), lambda f, b=nbytes, s=secs: gbps(f.get(b, 0.0), f.get(s, 0.0)))
        tier_labels = [*labels, "tier"]
        for table, kind in ((TIER_COUNTERS, CounterMetricFamily), (TIER_GAUGES, GaugeMetricFamily)):
            for field, text in table.items():
                family = kind(f"kvdepot_tier_{field}", f"lower tier: {text}", labels=tier_labels)
                for shard in stats.shards:
                    for tier in TIER_NAMES:
                        value = shard.figures.get(f"{tier}_{field}")
                        if value is not None:
                            family.add_metric([shard.group, str(shard.rank), tier], value)
                yield family
        for name, (attr, text) in SERVER_GAUGES.items():
            yield GaugeMetricFamily(f"kvdepot_{name}", text, value=getattr(stats, attr))


def start_metrics(snapshot: Callable[[], StatsReply], port: int, host: str = "127.0.0.1") -> Callable[[], None]:
    """Serve ``/metrics`` on ``host:port`` from a private registry; returns a stop function.

    A port that cannot be bound (taken, privileged, a bad host) raises ``KVDepotError`` naming
    ``host:port``, so the server refuses to start in one line instead of a socket traceback."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snapshot))  # type: ignore[arg-type]
    try:
        started = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise KVDepotError(f"metrics: cannot listen on {host}:{port} ({exc.strerror or exc}); "
                           "choose another --metrics-port / --metrics-host") from None
    server = started[0] if isinstance(started, tuple) else None

    def stop() -> None:
        if server is not None:
            server.shutdown()
            server.server_close()

    return stop
