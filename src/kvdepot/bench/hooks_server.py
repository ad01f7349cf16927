"""The server of ``kvdepot bench hooks``: the real loop, sessions, LAYERS and progress page, over
loads by layer whose copies are simulated — so the path runs, and is timed, on a CPU.

    python -m kvdepot.bench.hooks_server URL LAYERS ISSUE_US GIL_US STAMPS

REGISTER maps the client's progress page as a real server does (``serve_page``) and keeps nothing
else; RETRIEVE makes a real ``LayeredLoad`` whose "driver call" per layer holds the GIL for
``GIL_US`` then sleeps the rest of ``ISSUE_US`` (a batch of copies: address lists in numpy, then
``cuMemcpyBatchAsync`` without the GIL) and "records" each layer as it enqueues it (its
``on_layer``, as the server's loads record a layer's event on the copy stream), and answers it
early on a ``LayerIssuer`` exactly as ``DepotService._answer_early`` does. Each layer's record
time (CLOCK_MONOTONIC ns) goes to the shared file ``STAMPS``, for the client to measure how late
it heard of it.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterator

import numpy as np

from kvdepot.config import load_config
from kvdepot.server import protocol as p
from kvdepot.server.layer_progress import LayerIssuer, LayerProgress, start_early
from kvdepot.server.progress_page import ProgressPage, serve_page
from kvdepot.server.server import DepotServer
from kvdepot.server.service import DepotService
from kvdepot.transfer.layered import LayeredLoad


def spin(us: float) -> None:
    """Hold the GIL for ``us`` microseconds (Python work; another thread gets it at the switch interval)."""
    end = time.perf_counter_ns() + int(us * 1e3)
    while time.perf_counter_ns() < end:
        pass


class _Event:
    def record(self, stream: object = None) -> None:
        pass


class _Stream:
    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        pass


class SimulatedService(DepotService):
    """``DepotService`` whose REGISTER and RETRIEVE need no pool and no GPU (everything else is its own)."""

    def __init__(self, url: str, layers: int, issue_us: float, gil_us: float, stamps: str) -> None:
        super().__init__(load_config(), url=url)
        self.layers, self.issue_us, self.gil_us = layers, issue_us, gil_us
        self.stamps = np.memmap(stamps, dtype=np.int64, mode="r+", shape=(layers,))
        self.issuer = LayerIssuer("sim-layers")
        self.pages: dict[int, ProgressPage | None] = {}
        self.ids = itertools.count(1)

    def register(self, peer: bytes, msg: p.Register, payloads: p.Payloads) -> p.Reply:
        session = self._session(peer)
        page = self.pages[session.sid] = serve_page(msg.pool, self.allow_shm)
        return p.RegisterReply(256, "xxh3_128", 0, 0, b"", "simulated", progress_page=page is not None), []

    def _issue(self) -> Iterator[int]:
        for layer in range(self.layers):
            spin(self.gil_us)
            time.sleep(max(0.0, self.issue_us - self.gil_us) / 1e6)
            yield layer

    def _record(self, layer: int) -> None:
        self.stamps[layer] = time.monotonic_ns()

    def retrieve(self, peer: bytes, msg: p.Retrieve, payloads: p.Payloads) -> p.Reply:
        session = self._session(peer)
        load = LayeredLoad(self._issue(), [_Event() for _ in range(self.layers)], None, lambda exc: None,
                           on_layer=lambda layer, _side: self._record(layer))
        # As the service does: the engine enqueues nothing of a signalled load, and the reply goes
        # before layer 0 where the client reads a page (``layer_progress.start_early``)
        progress = LayerProgress(next(self.ids), self.layers, msg.deadline_ns, self.pages.get(session.sid))
        start_early(load, progress, self.issuer, self._record, _Stream(), lambda: None)
        self.layer_loads.add(session.sid, progress)
        return p.RetrieveReply(0, 0, True, progress.load_id, progress.recorded), []

    def close(self) -> None:
        self.issuer.close()
        super().close()


def main(argv: list[str]) -> None:
    url, layers, issue_us, gil_us, stamps = argv
    server = DepotServer(url, load_config())
    server.service.close()
    server.service = SimulatedService(url, int(layers), float(issue_us), float(gil_us), stamps)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
