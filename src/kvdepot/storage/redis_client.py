"""How the Redis tier reaches its server: one node (``redis.Redis``) or a Redis Cluster
(``redis.cluster.RedisCluster`` from one seed node), and how it names them in log lines.

Why a module of its own: the tier's logic (one value per chunk, verification, outages as values)
is the same for both; what differs is how a client is made, which node owns a key (a cluster's
outages are per node: a dead master costs misses for its slots only), which connection pool
reaches that node (reads into caller memory take a connection from it: ``redis_reply.py``), and
how a batch of EXISTS is split so that no command spans slots (a pipeline per node, each command
single-key).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ClusterError, RedisClusterException
from redis.retry import Retry

SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis", "rediss")  # a cluster's seed is a TCP node
# What makes a node (or the whole server) unavailable, rather than one call wrong.
OUTAGE = (redis.ConnectionError, redis.TimeoutError, ClusterError, RedisClusterException)
WHOLE = ""  # the outage key of a single server, and of a cluster whose slot map is unknown


def url_problem(url: str, cluster: bool = False) -> str | None:
    """Why ``url`` cannot name the server (or the seed node of a cluster), or None if it can."""
    allowed = CLUSTER_SCHEMES if cluster else SCHEMES
    parts = urlsplit(url)
    if parts.scheme not in allowed:
        return "expected a URL with scheme " + ", ".join(f"{s}://" for s in allowed) + (
            " (a cluster's seed node)" if cluster else "")
    if parts.scheme == "unix" and not parts.path:
        return "a unix:// URL needs a socket path (unix:///path/to/redis.sock)"
    if parts.scheme != "unix" and not parts.hostname:
        return f"a {parts.scheme}:// URL needs a host ({parts.scheme}://host:6379/0)"
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        return "its port is not a number in 1-65535"
    return None


def redact(url: str) -> str:
    """``url`` without its password, for log lines."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


def make_client(url: str, cluster: bool, timeout_s: float) -> Any:
    """A client with bounded socket operations and redis-py's own retries off (the tier decides
    when to try again). A cluster client reads the slot map from the seed now (may raise OUTAGE)."""
    options: dict[str, Any] = {
        "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s, "retry": Retry(NoBackoff(), 0),
    }
    if not cluster:
        return redis.Redis.from_url(url, **options)
    return RedisCluster.from_url(url, require_full_coverage=False, **options)


def node_of(client: Any, cluster: bool, name: bytes) -> str:
    """The outage key of the node serving ``name``: ``host:port`` in a cluster, else ``WHOLE``."""
    if not cluster:
        return WHOLE
    try:
        return str(client.get_node_from_key(name).name)
    except OUTAGE:
        return WHOLE


def pool_of(client: Any, cluster: bool, name: bytes) -> Any:
    """redis-py's connection pool of the node that serves ``name`` (may raise OUTAGE in a cluster
    whose slot map must be read first)."""
    if not cluster:
        return client.connection_pool
    return client.get_redis_connection(client.get_node_from_key(name)).connection_pool


def refresh_slots(client: Any) -> None:
    """Re-read a cluster's slot map (after a ``-MOVED`` reply to a GET read outside redis-py; may
    raise OUTAGE). A whole ``CLUSTER SLOTS`` walk: MOVED means slots moved, which is rare."""
    client.nodes_manager.initialize()


def by_node(client: Any, cluster: bool, names: Sequence[bytes]) -> dict[str, list[int]]:
    """Indexes of ``names`` grouped by the node that serves them (one group without a cluster)."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(node_of(client, cluster, name), []).append(i)
    return groups
