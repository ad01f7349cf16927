"""``kvdepot bench ab``: two kvdepot source trees in one process. Their stores, retrieves and
stores-with-a-load-beside, each paired with a plain copy of the same bytes, are timed round by
round in a shuffled order.

Why one process: on GPU hosts a ``bench transfer`` process lands in a slow or a fast phase (issue
19, ninth pass: the same tree read 0.741 in one process and 0.882 in the next), so two trees run
in two processes differ by more than most changes do. Here both engines share the process, the
pool and the host's phase, and each round times both. ``--old`` is another tree's ``src``
directory: its ``kvdepot`` package is copied under another name (``kvdepot_old``, its own imports
renamed) and imported beside this one. In the ninth pass the engine built first always read
lowest, whichever tree it was (cause unknown): ``--first`` picks which is built first, and a
comparison should alternate it from process to process.

Each row: an op's median ratio (memcpy seconds over op seconds, paired) for each tree, and the
median of the per-round differences, new minus old, in points.
"""

from __future__ import annotations

import argparse
import importlib
import random
import re
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kvdepot.bench.common import (
    HostSteal,
    Memcpy,
    c_helper,
    device_name,
    host_python_us,
    paired_seconds,
)
from kvdepot.bench.numa import placement
from kvdepot.bench.report import Report, add_output_arguments

OPS = ("store", "retrieve", "both")
_IMPORT = re.compile(r"\bkvdepot(?=\.[A-Za-z_]|\s+import\b|\s*$)", re.MULTILINE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--old", required=True, help="the other tree's src directory (the one holding its kvdepot/)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu (default: cuda where there is one)")
    parser.add_argument("--layers", type=int, default=16, help="pool shape: layers (default: Llama-3.2-1B's 16)")
    parser.add_argument("--kv-heads", type=int, default=8, help="pool shape: KV heads")
    parser.add_argument("--head-dim", type=int, default=64, help="pool shape: head dim")
    parser.add_argument("--tokens-per-block", type=int, default=8, help="(default: 256 KiB blocks with the shape above)")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per kvdepot chunk")
    parser.add_argument("--blocks", type=int, default=256, help="blocks per operation")
    parser.add_argument("--rounds", type=int, default=40, help="rounds; each times every op of both trees once")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of: {', '.join(OPS)} (both: CUDA only)")
    parser.add_argument("--first", choices=("new", "old"), default="new", help="whose engine is built (and its arena pinned) first")
    parser.add_argument("--mover", default="batch", help="config transfer_mover for both engines")
    parser.add_argument("--seed", type=int, default=0, help="seed of the block ids and of each round's order")
    add_output_arguments(parser)


def import_tree(src: Path, name: str, into: Path) -> ModuleType:
    """``src/kvdepot`` copied to ``into/name`` with its imports of ``kvdepot`` renamed, and imported
    (a package of that name imported before is dropped first)."""
    package = Path(src) / "kvdepot"
    if not (package / "__init__.py").is_file():
        raise SystemExit(f"--old {src}: no kvdepot package there (give a tree's src directory)")
    target = Path(into) / name
    shutil.copytree(package, target, ignore=shutil.ignore_patterns("__pycache__"))
    for path in target.rglob("*.py"):
        path.write_text(_IMPORT.sub(name, path.read_text()))
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[loaded]
    sys.path.insert(0, str(into))
    importlib.invalidate_caches()
    return importlib.import_module(name)


class _Side:
    """One tree's engine over the shared pool, and its ops (keys and ids drawn before the clock)."""

    def __init__(self, package: str, pool: torch.Tensor, args: argparse.Namespace, nbytes: int, rng: random.Random) -> None:
        engine_mod = importlib.import_module(f"{package}.engine")
        config = importlib.import_module(f"{package}.config").load_config(
            chunk_size=args.chunk_size, host_capacity_gb=(3 * nbytes + 1) / 1e9, transfer_mover=args.mover)
        self.engine = engine_mod.CacheEngine.for_pool(pool, args.tokens_per_block, config)
        self.engine.wait_arena()
        self._pool_blocks, self._rng, self._blocks = pool.shape[0], rng, args.blocks  # ids drawn off the clock
        self._tokens = args.blocks * args.tokens_per_block
        self._next = iter(range(1 << 40))
        self._batches = [self._batch() for _ in range(4 + 2 * (args.rounds + 1))]
        self._loads = [rng.sample(range(self._pool_blocks), self._blocks) for _ in range(2 * (args.rounds + 1))]
        for _ in range(4):  # fill the arena once over: every timed store evicts
            self.store()
        self.held = self._batch()
        self.engine.store(*self.held).wait()

    def _batch(self) -> tuple[list, list[int]]:
        tokens = [next(self._next) % 100_000 for _ in range(self._tokens)]
        return self.engine.chunk_keys(tokens), self._rng.sample(range(self._pool_blocks), self._blocks)

    def store(self) -> None:
        keys, ids = self._batches.pop()
        handle = self.engine.store(keys, ids)
        handle.wait()
        if handle.chunks != len(keys):  # a dropped store would time as free
            raise RuntimeError(f"store placed {handle.chunks} of {len(keys)} chunks")

    def lookup(self) -> None:
        self.engine.lookup(self.held[0])  # off the clock, as an engine's scheduler makes it

    def retrieve(self) -> None:
        if self.engine.retrieve(self.held[0], self._loads.pop()) != self._tokens:
            raise RuntimeError("the held chunks were evicted")

    def both(self) -> None:
        keys, ids = self._batches.pop()
        handle = self.engine.store(keys, ids)
        self.retrieve()
        handle.wait()


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    ops = [op for op in args.ops.split(",") if op != "both" or device.type == "cuda"]
    if unknown := sorted(set(ops) - set(OPS)):
        raise SystemExit(f"--ops: {', '.join(unknown)} unknown; choose from {', '.join(OPS)}")
    moved = args.blocks - args.blocks % (args.chunk_size // args.tokens_per_block)
    args.blocks = moved
    pool = torch.empty((moved * 3, args.layers, 2, args.kv_heads * args.tokens_per_block * args.head_dim),
                       dtype=torch.bfloat16, device=device)
    pool.view(torch.int16).random_(-(2**15), 2**15 - 1)
    nbytes = moved * pool[0].numel() * pool.element_size()
    report = Report(args, steps=args.rounds + 2, device=device, name="bench ab")
    with tempfile.TemporaryDirectory(prefix="kvdepot-ab-") as into:
        try:
            with report.step("import the old tree"):
                import_tree(Path(args.old), "kvdepot_old", Path(into))
            steal = HostSteal()
            ratios = _rounds(args, ops, pool, nbytes, report)
            stolen = steal.ms_per_s()
        finally:
            if into in sys.path:
                sys.path.remove(into)  # the copy goes with the directory
    report.table(f"kvdepot bench ab — {device_name(device)}; {nbytes / 2**20:.0f} MiB per op, {args.rounds} rounds, "
                 f"{args.first} built first; ratio = memcpy seconds / op seconds, paired; host Python "
                 f"{host_python_us():.0f} us per reference loop; copy lists by {c_helper()} (new), "
                 f"{c_helper('kvdepot_old')} (old); CPU steal "
                 f"{'?' if stolen is None else f'{stolen:.0f}'} ms/s over the rounds", op=10)
    for op in ops:
        new, old = ratios[("new", op)], ratios[("old", op)]
        report.add({"op": op, "old ratio": statistics.median(old), "new ratio": statistics.median(new),
                    "new - old points": 100 * statistics.median(n - o for n, o in zip(new, old, strict=True))})
    return report.finish()


def _rounds(args: argparse.Namespace, ops: list[str], pool: torch.Tensor, nbytes: int,
            report: Report) -> dict[tuple[str, str], list[float]]:
    """Both engines built (in ``--first``'s order), then ``--rounds`` rounds: each times every op
    of both trees once, in a shuffled order, each beside a plain copy of its bytes."""
    rng = random.Random(args.seed)
    order = ("kvdepot", "kvdepot_old") if args.first == "new" else ("kvdepot_old", "kvdepot")
    sides: dict[str, _Side] = {}
    try:
        with report.step("build both engines"):
            for package in order:
                sides["new" if package == "kvdepot" else "old"] = _Side(package, pool, args, nbytes, rng)
        copies = Memcpy(nbytes, pool.device)
        arenas = {f"{tree} arena": getattr(side.engine.host, "segments", ()) for tree, side in sides.items()}
        report.note(f"NUMA: {placement({**arenas, 'memcpy': [copies.host]}, pool.device)}")
        ceilings: dict[str, Callable[[], Any]] = {"store": copies.d2h, "retrieve": copies.h2d, "both": copies.both}
        ratios: dict[tuple[str, str], list[float]] = {(t, op): [] for t in sides for op in ops}
        for round_ in range(args.rounds):
            with report.step("rounds"):
                items = [(t, op) for t in sides for op in ops]
                rng.shuffle(items)
                for tree, op in items:
                    side = sides[tree]
                    # One pair; the first round first runs each pair untimed: first calls pay lazy
                    # set-up and page faults (2-round runs read up to 8x apart without it, dev VM).
                    # A lookup, off the clock, before every op keeps the held chunks the newest:
                    # the arena holds three operations, and a load follows a lookup in an engine.
                    ratios[(tree, op)].append(paired_seconds(getattr(side, op), ceilings[op], pool.device, 1,
                                                             warmup=0 if round_ else 1, before=side.lookup)[2])
        return ratios
    finally:
        for side in sides.values():
            side.engine.close()

