"""Where a hit's TTFT goes, for ``kvdepot bench ttft``: before its forward, on the way to layer 0,
and in the forward, each on the clock that can tell.

    with ForwardMarks(engine) as marks:
        result = engine.generate([prompt], 1)
    marks.split()   # {"before ms", "to layer 0 ms", "forward ms"} of the last forward

Why: server mode's hits sat 12–14 ms above their device hit at 32K tokens where in-process ones sat
0–3 (issue 19, runs AR/AS), and a TTFT alone cannot say whether the time went before the forward
(the lookup, the load's start: host round trips) or inside it (the forward waiting on the device
for a layer's copies, or the copies themselves slower). The marks are taken in the reference
runtime's forward: at its start and right after each layer's ``wait_for_layer_load``, as CUDA
events on the execution stream (the device's time: when the forward could go on past a layer's
wait) and ``perf_counter`` on the host. ``before ms`` is host time from ``submit`` to the last
forward's start; ``to layer 0 ms`` and ``forward ms`` are the device's, from that start (on CPU,
where a forward runs as it is issued, the host's).

Inside the forward, the marks after every layer's wait tell who paced it (``pace``): ``ms/layer``
is the device's median time from one layer's mark to the next, and ``host-paced layers`` counts
the layers whose mark the device passed within ``HOST_PACED_MS`` of the host enqueueing it — the
device had caught up with the host, which was waiting (in MP, for the server to record that
layer). A forward paced by the copies instead has its host far ahead and ``ms/layer`` above the
device hit's.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from typing import Any
from unittest import mock

import torch

HOST_PACED_MS = 0.2  # a layer's mark passed this soon after the host enqueued it: the host paced it


class _Forward:
    """The marks of one forward that ``split`` reads: (host seconds, CUDA event or None) at its
    start, after each layer's wait (in order), and at its end."""

    def __init__(self) -> None:
        self.start: tuple[float, Any] | None = None
        self.layers: list[tuple[float, Any]] = []
        self.end: tuple[float, Any] | None = None

    @property
    def layer0(self) -> tuple[float, Any] | None:
        return self.layers[0] if self.layers else None

    @staticmethod
    def mark(stream: Any) -> tuple[float, Any]:
        event = None
        if stream is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
        return time.perf_counter(), event

    def since_start(self, mark: tuple[float, Any]) -> float:
        """Seconds from the start to ``mark``: the device's when both are events (synchronized)."""
        assert self.start is not None
        if mark[1] is not None and self.start[1] is not None:
            mark[1].synchronize()
            return self.start[1].elapsed_time(mark[1]) / 1e3
        return mark[0] - self.start[0]


class ForwardMarks:
    """Marks the forwards ``engine`` (a ``runtime.Engine`` with a connector) runs inside the block,
    patched on the instance as ``ConnectorClock`` patches the connector's classes; ``before ms``
    counts from the block's last ``submit`` (its request's TTFT starts there too)."""

    def __init__(self, engine: Any) -> None:
        self._engine, self._submitted, self._last = engine, 0.0, None
        self.forwards = 0  # forwards run inside the block
        self._patches = contextlib.ExitStack()

    def __enter__(self) -> ForwardMarks:
        engine = self._engine
        conn, run_model, submit = engine.connector, engine._run_model, engine.submit

        def submitted(*args: Any, **kwargs: Any) -> int:
            rid = submit(*args, **kwargs)
            self._submitted = time.perf_counter()
            return rid

        def marked(segments: Any, exec_stream: Any) -> Any:
            forward = self._last = _Forward()
            self.forwards += 1
            forward.start = forward.mark(exec_stream)
            hooks = conn.layer_hooks

            def layer_hooks(stream: Any) -> Any:
                pre, post = hooks(stream)

                def waited(i: int) -> None:
                    pre(i)
                    forward.layers.append(forward.mark(stream))

                return waited, post

            try:
                with mock.patch.object(conn, "layer_hooks", layer_hooks):
                    return run_model(segments, exec_stream)
            finally:
                forward.end = forward.mark(exec_stream)

        self._patches.enter_context(mock.patch.object(engine, "submit", submitted))
        self._patches.enter_context(mock.patch.object(engine, "_run_model", marked))
        return self

    def __exit__(self, *exc: object) -> None:
        self._patches.close()

    def _last_forward(self) -> _Forward:
        """The last forward run inside the block (the one that gave the first token)."""
        if self._last is None:
            raise RuntimeError("no forward ran inside ForwardMarks")
        return self._last

    def split(self) -> dict[str, float]:
        """The last forward's split (the one that gave the first token)."""
        last = self._last_forward()
        assert last.start is not None and last.end is not None
        return {"before ms": (last.start[0] - self._submitted) * 1e3,
                "to layer 0 ms": last.since_start(last.layer0) * 1e3 if last.layer0 else 0.0,
                "forward ms": last.since_start(last.end) * 1e3}

    def pace(self) -> dict[str, float]:
        """Who paced the last forward past its layers' waits (module docstring): ``ms/layer``
        and ``host-paced layers`` (NaN and 0 with fewer than two layers)."""
        last = self._last_forward()
        assert last.start is not None
        device = [last.since_start(mark) * 1e3 for mark in last.layers]
        host = [(mark[0] - last.start[0]) * 1e3 for mark in last.layers]
        steps = [b - a for a, b in itertools.pairwise(device)]
        return {"ms/layer": statistics.median(steps) if steps else float("nan"),
                "host-paced layers": sum(d - h < HOST_PACED_MS for d, h in zip(device[1:], host[1:], strict=True))}
