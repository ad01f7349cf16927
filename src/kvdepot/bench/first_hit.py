"""``kvdepot bench firsthit``: does a process's first kvdepot hit cost more than its later ones, and whose cost is it?

Issue 19 asks for no first-hit toll (the first hit of a process within 5% of later hits); run E found
~60 ms more on the H200 and left it unattributed. A hit is also the first forward of a process that
attends over KV it did not just compute, so the runtime may pay a one-time cost there with or without
kvdepot. This bench tells the two apart: each ``--order`` runs in a fresh process (the toll is per
process), after a warm-up of misses only, and times ``--hits`` prompts, each served once from kvdepot
(after a filler evicted it from the engine's pool) and once from the engine's own pool (a device hit):

    kvdepot-first  miss, filler, kvdepot hit, device hit     -- the first query over past KV is kvdepot's
    device-first   miss, device hit, filler, kvdepot hit     -- the runtime meets past KV first

If the first row of either kind is slow only when it comes first in its process, the toll is the
runtime's (it follows whatever runs first); if the first kvdepot hit is slow in both orders, it is
kvdepot's. ``--processes``: each order and warm-up in that many fresh processes (a process has
one first hit; on a GPU host one process's first/later read anywhere from 0.74 to 1.05), and the
summary gives each ratio's median and range over them. Every hit must load the whole prompt
(else the bench raises).

``--warmup``: whether the engine runs its construction-time warm-up (``Engine.warm_up``: a prefill,
a chunk and a token over past KV, before the pool is registered, as TensorRT-LLM 1.2's
``PyExecutor`` warms up). ``on`` is what a TensorRT-LLM server does; ``off`` shows the toll that
the warm-up pays instead (on CPU neither has one: the warm-up is skipped there unless asked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvdepot.bench.common import positive
from kvdepot.bench.report import Report, add_output_arguments

ORDERS = ("kvdepot-first", "device-first")
WARMUPS = ("on", "off")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvdepot.bench.ttft import _model_arg, _preset_names

    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu", help="cuda (default when available) or cpu")
    parser.add_argument("--model", default="llama-8b" if cuda else "small", type=_model_arg,
                        help="runtime preset (" + ", ".join(_preset_names()) + "); random weights")
    parser.add_argument("--length", type=int, default=4096 if cuda else 512, help="prompt tokens of each hit")
    parser.add_argument("--hits", type=int, default=4, help="prompts per order (the first and the later ones)")
    parser.add_argument("--order", choices=ORDERS + ("both",), default="both",
                        help="which kind of hit a fresh process meets first (both: one process each)")
    parser.add_argument("--warmup", choices=WARMUPS + ("both",), default="both",
                        help="the engine's warm-up at construction (Engine.warm_up) on, off, or both (a process each)")
    parser.add_argument("--processes", type=positive, default=1,
                        help="fresh processes per order and warm-up: a process has one first hit, and one process "
                             "read 0.74-1.05 (issue 19); the summary gives the median and range over them")
    add_output_arguments(parser)


def _one_order(args: argparse.Namespace, order: str, warmup: str) -> list[dict[str, Any]]:
    """The rows of one order, in this process (which must not have served a hit before)."""
    from kvdepot.bench.ttft import _engine, _prompt, _ready, _teardown
    from kvdepot.integrations.tensorrt_llm.providers import current_engine

    pool = -(-(args.length + 64) // 32) * 32  # whole blocks of 32 tokens (bench ttft's engine)
    eng = _engine(args, pool, connected=True, warmup=warmup == "on")
    _ready(None)
    vocab = eng.model.config.vocab_size
    whole = args.length - current_engine().config.chunk_size  # at least: all but the last, partial chunk
    for seed in (1, 2):  # warm-up: prefill kernels and the store path, misses only (no query over past KV)
        eng.generate([_prompt(pool - 1, seed, vocab)], 1)
    rows = []
    for i in range(args.hits):
        a = _prompt(args.length, 100 + i, vocab)
        eng.generate([a], 1)  # the miss; kvdepot stores it
        if order == "device-first":
            device = eng.generate([a], 1)[0]
            eng.generate([_prompt(pool - 1, 200 + i, vocab)], 1)  # evicts A from the engine's pool
            hit = eng.generate([a], 1)[0]
        else:
            eng.generate([_prompt(pool - 1, 200 + i, vocab)], 1)
            hit = eng.generate([a], 1)[0]
            device = eng.generate([a], 1)[0]
        if hit.num_connector_matched_tokens < whole or device.num_device_reused_tokens == 0:
            raise RuntimeError(f"prompt {i}: kvdepot loaded {hit.num_connector_matched_tokens} of {args.length}, "
                               f"the device reused {device.num_device_reused_tokens}")
        rows.append({"warm-up": warmup, "order": order, "prompt": i, "kvdepot hit ms": hit.ttft_s * 1e3, "device hit ms": device.ttft_s * 1e3,
                     "hit==device bitwise": bool(torch.equal(hit.logits[0], device.logits[0]))})
    _teardown()
    return rows


def _in_fresh_process(args: argparse.Namespace, order: str, warmup: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="kvd-firsthit-") as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", "kvdepot.cli", "bench", "firsthit", "--order", order, "--warmup", warmup, "--device", args.device,
               "--model", args.model, "--length", str(args.length), "--hits", str(args.hits), "--json", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["rows"]


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per warm-up, order and kind: in each process, its first row over the median of its later
    ones; over the processes, the median of those ratios and their range (``first ms`` and
    ``later median ms``: the medians over the processes of each)."""
    out = []
    for warmup in WARMUPS:
        for order in ORDERS:
            mine = [r for r in rows if r["order"] == order and r["warm-up"] == warmup]
            runs = [[r for r in mine if r.get("process", 0) == p] for p in sorted({r.get("process", 0) for r in mine})]
            runs = [run for run in runs if len(run) >= 2]
            if not runs:
                continue
            for kind in ("kvdepot hit ms", "device hit ms"):
                firsts = [run[0][kind] for run in runs]
                laters = [statistics.median(r[kind] for r in run[1:]) for run in runs]
                ratios = [f / later for f, later in zip(firsts, laters, strict=True)]
                out.append({"warm-up": warmup, "order": order, "hit": kind.removesuffix(" ms"), "processes": len(runs),
                            "first ms": statistics.median(firsts), "later median ms": statistics.median(laters),
                            "first/later": statistics.median(ratios), "min": min(ratios), "max": max(ratios)})
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    orders = ORDERS if args.order == "both" else (args.order,)
    warmups = WARMUPS if args.warmup == "both" else (args.warmup,)
    processes = getattr(args, "processes", 1)
    # The processes of one order and warm-up are not run back to back: a drift of the host's phase
    # then spreads over every order alike.
    runs = [(p, w, o) for p in range(processes) for w in warmups for o in orders]
    report = Report(args, steps=len(runs), device=torch.device(args.device), name="bench firsthit")
    report.table(f"kvdepot bench firsthit — {args.model}, {args.length}-token prompts, {args.hits} per order, "
                 f"each order and warm-up in {processes} fresh process{'es' * (processes > 1)}", order=13)
    rows: list[dict[str, Any]] = []
    fresh = len(runs) > 1
    for process, warmup, order in runs:
        with report.step(f"{order}, warm-up {warmup}" + (f", process {process + 1}" if processes > 1 else "")):
            got = _in_fresh_process(args, order, warmup) if fresh else _one_order(args, order, warmup)
        rows += [report.add({**row, "process": process}) for row in got]
    summary = _summary(rows)
    if summary:
        report.table("first hit of a process over the median of its later hits", order=13)
        for row in summary:
            report.add(row)
    report.finish({"rows": rows, "summary": summary})
    return {"rows": rows, "summary": summary}
