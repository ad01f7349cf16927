"""``kvdepot bench contexts``: what another process's copies into this GPU cost a forward on it,
by where that process records the events the forward waits on. No kvdepot engine or server.

Why: server mode's hits at 16K / 32K tokens sat 15% above in-process on an H100 (issue 19, runs
AX and AY), and the forward marks showed the forward paced by the server's copies, ~0.3 ms per
layer slower than in-process at both lengths (not in proportion to the bytes: a per-layer or
per-time cost, not bandwidth), while 4K, whose copies end early in the forward, paid nothing.
The server then recorded each layer's interprocess event on a stream of its own that first waited
for the layer's copies, so from the forward's start to the last layer's copies its context had work
pending on a stream that runs no copies; two contexts on one GPU without MPS share it by time
slices. If that was the cost, recording on the copy stream itself should remove it — and it did
(run AZ, H100: record stream 1.19-1.23x a device hit, copy stream 1.08-1.10x; MP TTFT at 16K / 32K
then matched in-process), so the server now records there (``server/layer_progress.py``).

One process plays the engine: a "forward" of ``--layers`` layers, each a few bf16 matmuls sized
so that a layer computes about as long as its KV takes to copy (``--compute-per-copy``), each
layer waiting first for its KV. The rows (rounds of each interleaved, medians):

``device hit``                  the forward alone, no copies, no waits
``in-process``                  this process copies the layers on a side stream, its own events
``other process, copy stream``  a second process copies them and records each layer's
                                interprocess event on its copy stream
``other process, record stream`` ... on a second stream made to wait for the copy (kvdepot's
                                server until issue 19's eighth pass)
``other process, copies only``  the second process copies, the forward waits on nothing: what
                                another context's copies alone cost

The forward waits on layer ``l``'s event only once the copier has said it recorded it (a shared
counter, as the server's progress page says it), as a wait on an event not yet recorded would pass.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from kvdepot.bench.common import positive, size_list
from kvdepot.bench.report import Bars, Report, add_output_arguments

DEVICE_HIT, IN_PROCESS = "device hit", "in-process"
COPY_STREAM, RECORD_STREAM, COPIES_ONLY = "other process, copy stream", "other process, record stream", "other process, copies only"
MODES = (DEVICE_HIT, IN_PROCESS, COPY_STREAM, RECORD_STREAM, COPIES_ONLY)
MATMUL = 4096  # bf16 square matmuls: ~0.2 ms each on an H100, so a layer's compute is finely sized


def _ratio(value: str) -> float:
    try:
        ratio = float(value)
    except ValueError:
        ratio = 0.0
    if not 0.1 <= ratio <= 10:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a number from 0.1 to 10")
    return ratio


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=positive, default=32, help="layers of the forward (8B: 32)")
    parser.add_argument("--layer-mib", type=size_list("MiB", "64,128"), default="64,128",
                        help="KV per layer in MiB, comma-separated (an 8B model at 16K / 32K tokens: ~64 / ~128)")
    parser.add_argument("--compute-per-copy", type=_ratio, default=1.05,
                        help="a layer's compute over its copy time (1.05: the copies just keep up, as at 32K)")
    parser.add_argument("--rounds", type=positive, default=7, help="timed forwards per row, rows interleaved")
    add_output_arguments(parser)


def run(args: argparse.Namespace) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("bench contexts: needs a CUDA device (two processes share it)")
    report = Report(args, steps=len(args.layer_mib), device=torch.device("cuda"), name="bench contexts",
                    bars=Bars(("layer MiB", "mode"), ("over device hit",), "forward / device hit"))
    report.table(f"kvdepot bench contexts — {args.layers} layers, a forward waiting on each layer's KV copied by "
                 "whom and signalled where; medians of interleaved rounds")
    for mib in args.layer_mib:
        with report.step(f"{mib} MiB per layer"):
            for row in _measure(args.layers, mib << 20, args.compute_per_copy, args.rounds):
                report.add({"layer MiB": mib, **row})
    return report.finish()


def _measure(layers: int, layer_bytes: int, compute_per_copy: float, rounds: int) -> list[dict[str, Any]]:
    ctx = torch.multiprocessing.get_context("spawn")
    device = torch.device("cuda", torch.cuda.current_device())
    dst = torch.empty((layers, layer_bytes), dtype=torch.uint8, device=device)
    src = _pattern(dst.shape, 1, device)
    events = [torch.cuda.Event(interprocess=True) for _ in range(layers)]
    for event in events:  # made on this device now (an event is created at its first record)
        event.record()
    recorded = ctx.Value("i", 0, lock=False)
    commands, done = ctx.Queue(), ctx.Queue()
    copier = ctx.Process(target=_copier, args=(commands, done, dst, events, recorded), daemon=True)
    copier.start()
    try:
        if done.get(timeout=300) != "ready":
            raise RuntimeError("bench contexts: the copying process did not start")
        forward = _Forward(device, layers, _matmuls_per_layer(src[0], dst[0], compute_per_copy))
        side = torch.cuda.Stream(device)
        local = [torch.cuda.Event() for _ in range(layers)]
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(rounds + 1):  # the first round of each warms up
            for mode in MODES:
                torch.cuda.synchronize()
                if mode == IN_PROCESS:
                    with torch.cuda.stream(side):
                        side.wait_stream(forward.stream)
                        for layer in range(layers):
                            dst[layer].copy_(src[layer], non_blocking=True)
                            local[layer].record(side)
                    ms = forward.run(lambda layer: forward.stream.wait_event(local[layer]))
                elif mode == DEVICE_HIT:
                    ms = forward.run(None)
                else:
                    recorded.value = 0
                    commands.put(mode)
                    ms = forward.run(None if mode == COPIES_ONLY else lambda layer: _wait(recorded, layer, forward, events))
                    if done.get(timeout=120) != mode:
                        raise RuntimeError("bench contexts: the copying process lost its place")
                times[mode].append(ms)
        torch.cuda.synchronize()
        # The last round was the other process's (COPIES_ONLY comes last): its bytes are all there.
        if not all(torch.equal(dst[layer], sent) for layer, sent in enumerate(_layers(dst.shape, 2, device))):
            raise RuntimeError("bench contexts: the other process's copies did not land as sent")
    finally:
        commands.put(None)
        copier.join(60)
        if copier.is_alive():
            copier.kill()
    base = statistics.median(times[DEVICE_HIT][1:])
    rows = []
    for mode in MODES:
        ms = statistics.median(times[mode][1:])
        rows.append({"mode": mode, "matmuls per layer": forward.matmuls, "forward ms": ms, "ms/layer": ms / layers,
                     "over device hit": ms / base})
    return rows


def _layers(shape: torch.Size, seed: int, device: torch.device) -> Iterator[torch.Tensor]:
    """Random bytes, layer by layer on ``device``: the same for the same ``seed`` in either process."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for _ in range(shape[0]):
        yield torch.randint(0, 256, tuple(shape[1:]), dtype=torch.uint8, device=device, generator=generator)


def _pattern(shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
    """``_layers`` in host memory (pinned where the device is a GPU): what a process copies from."""
    out = torch.empty(shape, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for layer, values in enumerate(_layers(shape, seed, device)):
        out[layer].copy_(values)
    return out


def _wait(recorded: Any, layer: int, forward: _Forward, events: list[torch.cuda.Event]) -> None:
    """The forward's wait for layer ``layer`` of another process's copies: only once that process
    has recorded the layer's event for this round (``recorded`` counts the layers it has)."""
    deadline = time.monotonic() + 60
    while recorded.value <= layer:
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench contexts: the copying process never recorded layer {layer}")
    forward.stream.wait_event(events[layer])


def _matmuls_per_layer(host: torch.Tensor, dev: torch.Tensor, compute_per_copy: float) -> int:
    """How many matmuls make a layer compute ``compute_per_copy`` times its copy's time."""
    copy_ms = _gpu_ms(lambda: dev.copy_(host, non_blocking=True))
    a = torch.randn(MATMUL, MATMUL, dtype=torch.bfloat16, device=dev.device)
    matmul_ms = _gpu_ms(lambda: a @ a)
    return max(1, round(copy_ms * compute_per_copy / matmul_ms))


def _gpu_ms(fn: Any, reps: int = 5) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


class _Forward:
    """The engine's forward: per layer, ``wait(layer)`` (or nothing), then ``matmuls`` matmuls."""

    def __init__(self, device: torch.device, layers: int, matmuls: int) -> None:
        self.stream, self.layers, self.matmuls = torch.cuda.Stream(device), layers, matmuls
        self.a = torch.randn(MATMUL, MATMUL, dtype=torch.bfloat16, device=device)
        self.out = torch.empty_like(self.a)

    def run(self, wait: Any) -> float:
        """The forward's device time in ms, from its start on its stream to its end."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            for layer in range(self.layers):
                if wait is not None:
                    wait(layer)
                for _ in range(self.matmuls):
                    torch.mm(self.a, self.a, out=self.out)
            end.record(self.stream)
        end.synchronize()
        return start.elapsed_time(end)


def _copier(commands: Any, done: Any, dst: torch.Tensor, events: list[torch.cuda.Event], recorded: Any) -> None:
    """The other process (a server): per command, copy every layer of ``dst`` from its own pinned
    memory and record each layer's event where the mode says, then count it recorded."""
    torch.cuda.set_device(dst.device)
    layers = dst.shape[0]
    src = _pattern(dst.shape, 2, dst.device)
    copy, record = torch.cuda.Stream(dst.device), torch.cuda.Stream(dst.device)
    local = [torch.cuda.Event() for _ in range(layers)]
    done.put("ready")
    while (mode := commands.get()) is not None:
        for layer in range(layers):
            with torch.cuda.stream(copy):
                dst[layer].copy_(src[layer], non_blocking=True)
            if mode == COPY_STREAM:
                events[layer].record(copy)
            elif mode == RECORD_STREAM:
                local[layer].record(copy)
                record.wait_event(local[layer])
                events[layer].record(record)
            recorded.value = layer + 1
        torch.cuda.synchronize()
        done.put(mode)
