"""``kvdepot bench tiers --parts stall``: what write-behind costs the engine's step loop.

An in-process engine's writer thread copies each chunk committed to host memory down to disk and
Redis while the engine's step loop goes on launching work. Python runs one thread at a time, so
every stretch the writer holds the GIL is a stretch the loop cannot issue its next op: a ``bytes``
copy of a 32 MiB chunk is one memcpy under it (~17 ms on the dev VM, with its page faults).

Here this thread runs a loop of small tensor ops, which release the GIL around their kernels as
the runtime's do, while a ``TierManager`` writes ``--chunks`` chunks of ``--chunk-mib`` behind to
one tier. Each chunk is provided as the engine provides it now (``lent``: its host slot in place,
``manager.Lent``) and, in alternating rounds, as the engine used to (``bytes copy``: the slot
copied to ``bytes`` first). The loop alone, in the same run, is the floor.

Columns: ``loop ops/s`` beside the writes over the loop alone (``ratio``); ``max gap ms``, the
longest the loop waited between two ops (in any repetition); ``stalled ms/chunk``, its time in
gaps over 1 ms per chunk written. On 2 cores some of the slowdown is the copies' CPU time, GIL
or not; the gaps tell the GIL.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from kvdepot.bench.report import Report
from kvdepot.keys import ChunkKey
from kvdepot.storage.disk import ALIGN, DiskTier
from kvdepot.storage.host import page_aligned
from kvdepot.storage.manager import Lent, LowerTier, Provider, TierManager
from kvdepot.storage.redis_tier import RedisTier

NS = bytes(range(16))
GAP_S = 1e-3  # a gap over this between two of the loop's ops is a stall (the ops take ~10 us)
ALONE_S = 0.5
PROVIDERS = ("bytes copy", "lent")


@dataclasses.dataclass
class LoopRun:
    """One run of the loop: its ops and seconds, its gaps over ``GAP_S``, and its longest gap."""

    ops: int
    seconds: float
    gaps: list[float]
    longest: float


def stall_rows(args: argparse.Namespace, root: Path, url: str | None, report: Report) -> list[dict]:
    size = int(args.chunk_mib * 2**20)
    # The host slots, as the engine's arena makes them: pinned where a GPU is, else plain memory on a
    # page (both page-aligned, so the disk writes a slot in place when its size is a 4 KiB multiple).
    arena = torch.empty((args.chunks, size), dtype=torch.uint8, pin_memory=True) if torch.cuda.is_available() \
        else page_aligned(args.chunks, size)
    slots = list(arena.copy_(torch.randint(0, 256, (args.chunks, size), dtype=torch.uint8)).unbind(0))
    tiers: list[tuple[str, Callable[[], LowerTier]]] = [
        ("disk", lambda: DiskTier(root / "stall", 2 * args.chunks * (size + 2 * ALIGN), NS, fsync=args.fsync))]
    if url is not None:
        tag = uuid.uuid4().hex[:8]
        tiers.append(("redis", lambda: RedisTier(url, NS, timeout_s=args.redis_timeout, prefix=f"kvdepot-bench-{tag}")))
    rows = []
    for name, make in tiers:
        runs: dict[str, list[LoopRun]] = {p: [] for p in ("alone", *PROVIDERS)}
        for rep in range(args.reps + 1):  # repetition 0 is a warm-up
            with report.step(f"stall, {name}: {'warm-up' if rep == 0 else f'repetition {rep}'}"):
                for kind in ("alone", *(PROVIDERS if rep % 2 else PROVIDERS[::-1])):
                    run = _alone() if kind == "alone" else _beside_writes(make(), name, slots, kind)
                    if rep:
                        runs[kind].append(run)
        rows += [report.add(_row(name, kind, runs[kind], runs["alone"], len(slots))) for kind in ("alone", *PROVIDERS)]
    return rows


def _provider(slot: torch.Tensor, kind: str) -> Provider:
    if kind == "lent":
        return lambda: Lent(memoryview(slot.numpy()), lambda: None)
    return lambda: slot.numpy().tobytes()


def _beside_writes(tier: LowerTier, name: str, slots: list[torch.Tensor], kind: str) -> LoopRun:
    """The loop while ``slots`` are written behind to ``tier`` (fresh keys), until the last is
    written; then the chunks are deleted and the tier closed (with its manager)."""
    manager = TierManager(tier if name == "disk" else None, tier if name != "disk" else None,  # type: ignore[arg-type]
                          promote_to_disk=False)
    keys = [ChunkKey(uuid.uuid4().bytes) for _ in slots]
    done = threading.Event()
    try:
        for key, slot in zip(keys, slots, strict=True):
            if not manager.write_behind(key, _provider(slot, kind)):
                raise RuntimeError("bench tiers: the write-behind queue dropped a chunk")
        threading.Thread(target=lambda: (manager.flush(), done.set()), daemon=True).start()
        run = _loop(done.is_set)
        written = manager.stats().written
        if written != len(slots):
            raise RuntimeError(f"bench tiers: {written} of {len(slots)} chunks written behind ({kind}, {name})")
        for key in keys:
            tier.delete(key)
    finally:
        manager.close()
    return run


def _alone() -> LoopRun:
    until = time.perf_counter() + ALONE_S
    return _loop(lambda: time.perf_counter() > until)


def _loop(done: Callable[[], bool]) -> LoopRun:
    """A loop of small in-place adds until ``done()``, at least one: writes that end before the
    loop's first op (tiny chunks on a fast disk) would leave a run of 0 ops in 0 seconds."""
    x = torch.zeros(4096)
    ops, gaps, longest = 0, [], 0.0
    start = last = time.perf_counter()
    while not ops or not done():
        x.add_(1.0)
        now = time.perf_counter()
        gap = now - last
        if gap > GAP_S:
            gaps.append(gap)
        longest = max(longest, gap)
        last, ops = now, ops + 1
    return LoopRun(ops, last - start, gaps, longest)


def _row(tier: str, kind: str, runs: list[LoopRun], alone: list[LoopRun], chunks: int) -> dict:
    rate = statistics.median(r.ops / r.seconds for r in runs)
    floor = statistics.median(r.ops / r.seconds for r in alone)
    per_chunk = "" if kind == "alone" else statistics.median(sum(r.gaps) for r in runs) * 1e3 / chunks
    return {"tier": tier, "provider": kind, "loop ops/s": rate, "ratio": rate / floor,
            "max gap ms": max((r.longest for r in runs), default=0.0) * 1e3,
            "stalled ms/chunk": per_chunk, "write s": statistics.median(r.seconds for r in runs) if kind != "alone" else ""}
