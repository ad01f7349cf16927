"""Prometheus metrics of a running server, read from the service at scrape time.

    start_metrics(snapshot, port, host) -> stop()    port 0 = off
    format_stats(stats) -> str                       what ``kvdepot stats`` prints

No second set of counters is kept: each scrape reads ``DepotService.snapshot()``, so the figures
are the same ones ``kvdepot stats`` prints. Series (label ``model`` and ``rank`` per shard):
kvdepot_hits_total, kvdepot_misses_total, kvdepot_lookups_total, kvdepot_bytes_stored_total,
kvdepot_bytes_loaded_total, kvdepot_store_gbps, kvdepot_load_gbps, kvdepot_evictions_total,
kvdepot_dropped_stores_total, kvdepot_refused_batches_total,
kvdepot_live_leases, kvdepot_pinned_chunks, kvdepot_host_chunks; and kvdepot_clients,
kvdepot_mappings, kvdepot_prefetches for the whole server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kvdepot.server.protocol import StatsReply

_COUNTERS = {"hits": "hits", "misses": "misses", "lookups": "lookups", "bytes_stored": "bytes_stored",
             "bytes_loaded": "bytes_loaded", "evictions": "evictions", "dropped_stores": "dropped_stores",
             "refused_batches": "refused_batches"}
_GAUGES = {"live_leases": "live_leases", "pinned_chunks": "pinned_chunks", "host_chunks": "host_chunks",
           "host_capacity_chunks": "host_capacity_chunks", "host_pending_chunks": "host_pending_chunks"}


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
    return "\n".join(lines)


class _Collector:
    def __init__(self, snapshot: Callable[[], StatsReply]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self._snapshot()
        labels = ["model", "rank"]
        for name, field in _COUNTERS.items():
            family = CounterMetricFamily(f"kvdepot_{name}", f"{field} summed over the shard's life", labels=labels)
            for shard in stats.shards:
                family.add_metric([shard.group, str(shard.rank)], shard.figures.get(field, 0.0))
            yield family
        for name, field in _GAUGES.items():
            family = GaugeMetricFamily(f"kvdepot_{name}", f"current {field}", labels=labels)
            for shard in stats.shards:
                family.add_metric([shard.group, str(shard.rank)], shard.figures.get(field, 0.0))
            yield family
        for direction, nbytes, secs in (("store", "bytes_stored", "store_seconds"), ("load", "bytes_loaded", "load_seconds")):
            family = GaugeMetricFamily(f"kvdepot_{direction}_gbps", f"average {direction} GB/s", labels=labels)
            for shard in stats.shards:
                f = shard.figures
                family.add_metric([shard.group, str(shard.rank)], gbps(f.get(nbytes, 0.0), f.get(secs, 0.0)))
            yield family
        for name, value in (("clients", stats.sessions), ("mappings", stats.mappings), ("prefetches", stats.prefetches)):
            yield GaugeMetricFamily(f"kvdepot_{name}", f"current {name}", value=value)


def start_metrics(snapshot: Callable[[], StatsReply], port: int, host: str = "127.0.0.1") -> Callable[[], None]:
    """Serve ``/metrics`` on ``host:port`` from a private registry; returns a stop function."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snapshot))  # type: ignore[arg-type]
    started = start_http_server(port, addr=host, registry=registry)
    server = started[0] if isinstance(started, tuple) else None

    def stop() -> None:
        if server is not None:
            server.shutdown()
            server.server_close()

    return stop
