"""The figures of ``kvdepot bench cluster``: one row per configuration, and its two-panel plot.

    Served(prompt, pool, kvdepot, ttft_ms, recomputed, redis_reads) one request, as its node measured it
    row(config, nodes, served)                           the configuration's figures
    plot(rows, path, title)                              shares of prompt tokens | TTFT p50/p90

hit %        prompt tokens not computed (the engine's own pool + kvdepot) / prompt tokens
kvdepot %    prompt tokens kvdepot loaded / prompt tokens
recompute %  prompt tokens computed although some node had computed the same prefix before /
             prompt tokens: the cluster's duplicated work, what a shared cache is for
Redis reads  chunks the nodes read from the Redis Cluster (served, or promoted for later)
TTFT         per request, measured in the node (submission to first token)
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Served:
    prompt: int
    pool: int
    kvdepot: int
    ttft_ms: float
    recomputed: int
    redis_reads: int


def row(config: str, nodes: int, served: Sequence[Served]) -> dict[str, Any]:
    prompt = sum(s.prompt for s in served)
    ttfts = [s.ttft_ms for s in served]
    deciles = statistics.quantiles(ttfts, n=10, method="inclusive") if len(ttfts) > 1 else ttfts * 9
    return {
        "config": config,
        "nodes": nodes,
        "requests": len(served),
        "prompt tokens": prompt,
        "hit %": 100.0 * sum(s.pool + s.kvdepot for s in served) / prompt,
        "kvdepot %": 100.0 * sum(s.kvdepot for s in served) / prompt,
        "recompute %": 100.0 * sum(s.recomputed for s in served) / prompt,
        "Redis reads": sum(s.redis_reads for s in served),
        "TTFT p50 ms": statistics.median(ttfts),
        "TTFT p90 ms": deciles[8],
    }


def plot(rows: Sequence[dict[str, Any]], path: str, title: str) -> bool:
    """A PNG: left, hit % / kvdepot % / recompute % per configuration; right, TTFT p50 and p90."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no plot: matplotlib is not installed — pip install 'kvdepot[bench]'; {path} not written)")
        return False
    labels = [r["config"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 1.6 + 0.55 * len(rows)))
    for ax, keys, unit in ((left, ("hit %", "kvdepot %", "recompute %"), "% of prompt tokens"),
                           (right, ("TTFT p50 ms", "TTFT p90 ms"), "ms")):
        height = 0.8 / len(keys)
        for j, key in enumerate(keys):
            ys = [i + (j - (len(keys) - 1) / 2) * height for i in range(len(rows))]
            ax.barh(ys, [r[key] for r in rows], height=height, label=key)
        ax.set_yticks(range(len(rows)), labels if ax is left else [""] * len(rows), fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")
    return True
