"""``kvdepot bench tiers --read-settings``: the disk tier's ``get_into`` under several read settings
(piece size and pieces in flight), in one process, each read paired with a raw read.

Why one process, and why interleaved: run in separate processes (``h200_run.sh pieces`` until
the eleventh pass of issue 19), one setting's ``get_into`` ratio moved by 15 points between two runs
on the same GPU host, more than the settings differ. The dev VM's virtual disk also runs in phases
(1.3-2.8 GB/s). In one phase a deeper queue read 0.91-0.95 of raw reads where 2 MiB x 4 read
0.68-0.77; in the others every setting read the same. Here every chunk is written once per
setting's tier and once as a raw file, off the clock, in a shuffled order: on a GPU host (issue
19, twelfth pass) the raw file, always written last, and the setting written first read as if the
order mattered (of the 2 MiB settings the one listed first read lowest in both runs). Then the raw
read and each setting's ``get_into`` run in a shuffled order, back to back, so that each phase
lands on all of them. A row
gives the median of the per-chunk ratios (raw seconds over the tier's) and the ratio of the median
times. ``after reads ms`` is the median time from the end of a ``get_into``'s last read to its return:
the checksum of what landed last, and the joins. On GPU hosts xxh3 ran at ~7.5 GB/s, against
~30 GB/s on the dev VM, so pieces that land together leave more of it after the read there.
"""

from __future__ import annotations

import argparse
import mmap
import random
import statistics
import time
from pathlib import Path

from kvdepot.bench.report import Report
from kvdepot.bench.tiers import NS, _check, _key, _o_direct, _raw_io
from kvdepot.storage import disk_io
from kvdepot.storage.disk import ALIGN, DiskTier


def parse_settings(text: str) -> list[tuple[int, int]]:
    """``"2:4,2:16"`` -> [(2 MiB, 4), (2 MiB, 16)]: each a piece size in MiB and the pieces in flight."""
    out = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        try:
            mib, depth = (int(x) for x in item.split(":"))
        except ValueError:
            raise SystemExit(f"--read-settings: {item!r} is not MiB:depth (e.g. 2:4,2:16)") from None
        if mib < 1 or depth < 1:
            raise SystemExit(f"--read-settings: {item!r}: piece MiB and depth must be at least 1")
        out.append((mib << 20, depth))
    if not out:
        raise SystemExit("--read-settings: give at least one MiB:depth (e.g. 2:4,2:16)")
    return out


def read_settings_rows(args: argparse.Namespace, root: Path, payload: bytes, settings: list[tuple[int, int]],
                       report: Report) -> list[dict]:
    """One ``DiskTier`` per setting under ``root``; ``args.chunks`` chunks per repetition, a warm-up
    repetition first (untimed)."""
    size = len(payload)
    tiers = {(piece, depth): DiskTier(root / f"reads-{piece >> 20}-{depth}", 2 * (size + 2 * ALIGN), NS, fsync=args.fsync,
                                      o_direct=_o_direct(args), read_piece=piece, read_depth=depth)
             for piece, depth in settings}
    direct = next(iter(tiers.values())).o_direct
    (root / "reads-raw").mkdir()
    span = -(-size // ALIGN) * ALIGN  # whole blocks, as O_DIRECT moves them
    src, dst = mmap.mmap(-1, span), mmap.mmap(-1, span)
    src[:size] = payload
    out = memoryview(dst)[:size]
    seconds: dict[tuple[int, int] | None, list[float]] = {key: [] for key in [None, *tiers]}
    ratios: dict[tuple[int, int], list[float]] = {key: [] for key in tiers}
    after: dict[tuple[int, int], list[float]] = {key: [] for key in tiers}
    rng = random.Random(0)
    read_ends: list[float] = []  # when each of the tier's reads returned (its reader threads' too)
    transfer = disk_io._transfer

    def stamped(*a: object) -> int:
        try:
            return transfer(*a)  # type: ignore[arg-type]
        finally:
            read_ends.append(time.perf_counter())

    disk_io._transfer = stamped  # NOTE: the bench's own wrapper, undone below; the tiers' reads call it
    try:
        for rep in range(args.reps + 1):
            with report.step(f"disk reads by setting: {'warm-up' if rep == 0 else f'repetition {rep}'}"):
                for i in range(args.chunks):
                    key, path = _key(), root / "reads-raw" / f"{rep}.{i}"
                    order: list[tuple[int, int] | None] = [None, *tiers]
                    rng.shuffle(order)  # written in a shuffled order too: the last written may read faster
                    for setting in order:
                        if setting is None:
                            _raw_io(path, memoryview(src), direct, True, args.fsync)
                        else:
                            _check(tiers[setting].put(key, memoryview(src)[:size]), "disk put refused")
                    rng.shuffle(order)
                    took: dict[tuple[int, int] | None, float] = {}
                    for setting in order:
                        start = time.perf_counter()
                        if setting is None:
                            _check(_raw_io(path, memoryview(dst), direct, False) >= size, "short read")
                        else:
                            read_ends.clear()
                            got = tiers[setting].get_into(key, out)
                            if rep and read_ends:
                                after[setting].append(time.perf_counter() - max(read_ends))
                            _check(got == size, f"get_into by setting {setting} missed a chunk it holds")
                        took[setting] = time.perf_counter() - start
                    if rep:
                        for setting, s in took.items():
                            seconds[setting].append(s)
                            if setting is not None:
                                ratios[setting].append(took[None] / s)
                    for tier in tiers.values():
                        tier.delete(key)
                    path.unlink()
    finally:
        disk_io._transfer = transfer
        for tier in tiers.values():
            tier.close()
    raw_s = statistics.median(seconds[None])
    rows = []
    for (piece, depth), ratio in ratios.items():
        tier_s = statistics.median(seconds[(piece, depth)])
        rows.append(report.add({"setting": f"{piece >> 20}:{depth}", "in flight MiB": (piece >> 20) * depth,
                                "tier GB/s": size / tier_s / 1e9, "raw GB/s": size / raw_s / 1e9,
                                "paired ratio": statistics.median(ratio), "ratio of medians": raw_s / tier_s,
                                "after reads ms": 1e3 * statistics.median(after[(piece, depth)]), "O_DIRECT": direct}))
    return rows
