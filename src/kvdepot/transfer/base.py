"""The transfer contract: copy whole blocks between a pool and a contiguous host buffer.

A pool is presented as *block views*: a list of 2-D ``uint8`` tensors ``[num_blocks, seg_bytes]``
such that block ``b``'s bytes are ``views[0][b] ‖ views[1][b] ‖ …``. TensorRT-LLM's cross-layer
pool is a single view (``pool[b]`` is contiguous across layers); per-layer engines give one
view per layer and K/V. A host chunk buffer holding ``n`` blocks is laid out view-major:
``[view 0: n × seg_0][view 1: n × seg_1]…``, so each view's part is one contiguous region.

Primitives (all enqueue on the *current* CUDA stream for CUDA pools; synchronous on CPU):
    gather(views, block_ids, dst, first)    pool blocks -> host buffer positions first.. (a store)
    scatter(src, views, block_ids, first)   host buffer positions first.. -> pool blocks (a load)
``first`` lets a load start inside a chunk (blocks the engine already holds are skipped).
    gather_many(views, copies) / scatter_many(copies, views)
                                            the same for many chunks in one call, so a mover can
                                            batch them (one gather kernel, coalesced copies)
    scatter_layers(copies, views, num_layers) -> iterator of layers
                                            a load, one layer per step; only movers that declare
                                            ``copies_by_layer`` split it (the others load whole at
                                            the first step, which is still correct)
    prepare_gather(views, copies) -> Move   a store enqueued in two parts: ``head(max_bytes)``
                                            its first copies, then ``rest()`` all the others,
                                            maybe on two threads in turn (the engine's caller,
                                            then its store issuer), with the same stream
                                            current; movers that cannot split enqueue nothing
                                            in ``head`` and everything in ``rest``
Declared capabilities (never probed): ``copies_by_layer`` and ``refused`` (batched copies the
driver refused so far, each redone another way; 0 for movers that never batch).
Postconditions: exactly the listed blocks are read or written, in list order; no other byte
of the pool is touched. Callers validate block ids before calling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class ChunkCopy:
    """One chunk's part of a batched move: pool blocks <-> block positions ``first..`` of ``host``.
    (Not frozen: a frozen dataclass is made through ``object.__setattr__``, 2.5x slower, and an
    operation makes one per chunk before its first copy.)"""

    block_ids: Sequence[int]
    host: torch.Tensor  # 1-D uint8 chunk buffer, view-major
    first: int = 0
    # (host.data_ptr(), host.untyped_storage().data_ptr()) where the caller knows them (the host
    # tier, since it made the slot); None: movers ask torch. Asking costs up to ~8 us a call when
    # an operation starts with the caches cold, two per chunk part (issue 19; dev VM, caches swept:
    # a store's first window listed in 10 us with spans, 15 without, and the move issued 15-60 us sooner).
    span: tuple[int, int] | None = None

    def part(self, lo: int, hi: int | None = None) -> ChunkCopy:
        """Blocks ``lo..hi-1`` of this part (to its end with None), as a part of their own."""
        return ChunkCopy(self.block_ids[lo:hi], self.host, self.first + lo, self.span)

    def addresses(self) -> tuple[int, int]:
        """The host buffer's address and its allocation's: ``span``, or torch's answer."""
        if self.span is not None:
            return self.span
        return host_span(self.host)


def host_span(host: torch.Tensor) -> tuple[int, int]:
    """A host buffer's address and its allocation's (what ``ChunkCopy.span`` holds)."""
    return host.data_ptr(), host.untyped_storage().data_ptr()


class Move(Protocol):
    """A gather prepared to be enqueued in two parts (``BlockMover.prepare_gather``), on two
    threads in turn: ``head(max_bytes)`` enqueues about ``max_bytes`` of the first copies (maybe
    none) and never raises (a failure is kept for ``rest``); ``rest()``, called once after
    ``head`` has returned (or without it), enqueues every copy not enqueued yet and raises what
    either part could not enqueue. Each on the current stream of its thread, the same stream."""

    def head(self, max_bytes: int) -> None: ...

    def rest(self) -> None: ...


class BlockMover(Protocol):
    """Copies whole blocks by id; implementations differ in how (per run, gather kernel, …)."""

    copies_by_layer: bool  # scatter_layers enqueues layer by layer (a cross-layer pool on CUDA)
    refused: int  # batched copies the driver refused so far, each redone by per-run copies

    def gather(
        self, views: Sequence[torch.Tensor], block_ids: Sequence[int], dst: torch.Tensor, first: int = 0
    ) -> None:
        """Copy ``pool[block_ids]`` into block positions ``first..`` of host buffer ``dst``."""
        ...

    def scatter(
        self, src: torch.Tensor, views: Sequence[torch.Tensor], block_ids: Sequence[int], first: int = 0
    ) -> None:
        """Copy block positions ``first..`` of host buffer ``src`` into ``pool[block_ids]``."""
        ...

    def gather_many(self, views: Sequence[torch.Tensor], copies: Sequence[ChunkCopy]) -> None:
        """``gather`` for every copy (a store of many chunks)."""
        ...

    def scatter_many(self, copies: Sequence[ChunkCopy], views: Sequence[torch.Tensor]) -> None:
        """``scatter`` for every copy (a load of many chunks)."""
        ...

    def scatter_layers(self, copies: Sequence[ChunkCopy], views: Sequence[torch.Tensor], num_layers: int) -> Iterator[int]:
        """``scatter_many`` in layer order: each ``next()`` enqueues (at least) layer ``l`` of every
        block on the current stream and yields ``l``."""
        ...

    def prepare_gather(self, views: Sequence[torch.Tensor], copies: Sequence[ChunkCopy]) -> Move:
        """``gather_many``, to be enqueued in parts (a store: the caller's thread may start it)."""
        ...


class WholeMove:
    """A ``Move`` that does it all in ``rest``: for movers whose copies cannot be split."""

    def __init__(self, move: Callable[[], None]) -> None:
        self._move = move

    def head(self, max_bytes: int) -> None:
        pass

    def rest(self) -> None:
        self._move()


class LateMove:
    """A ``Move`` made on its first use: a store whose later chunks are booked (and listed) only
    after its lead is enqueued (``CacheEngine.store``), so the move over them cannot be made
    before; every path calls ``head`` or ``rest`` only after the store's check, which books them."""

    def __init__(self, make: Callable[[], Move]) -> None:
        self._make: Callable[[], Move] | None = make
        self._move: Move | None = None

    def _get(self) -> Move:
        if self._move is None:
            make, self._make = self._make, None
            self._move = make()  # type: ignore[misc]
        return self._move

    def head(self, max_bytes: int) -> None:
        self._get().head(max_bytes)

    def rest(self) -> None:
        self._get().rest()


class WholeLoads:
    """The capabilities of a mover that neither splits loads by layer nor batches driver calls."""

    copies_by_layer = False
    refused = 0

    def prepare_gather(self, views: Sequence[torch.Tensor], copies: Sequence[ChunkCopy]) -> Move:
        """All of the store in ``rest`` (on the engine's issuer thread)."""
        return WholeMove(lambda: self.gather_many(views, copies))  # type: ignore[attr-defined]

    def scatter_layers(self, copies: Sequence[ChunkCopy], views: Sequence[torch.Tensor], num_layers: int) -> Iterator[int]:
        """The whole load at the first step: every layer is in once layer 0 is."""
        self.scatter_many(copies, views)  # type: ignore[attr-defined]
        yield from range(num_layers)


class PerChunk(WholeLoads):
    """``*_many`` as a loop over chunks, for movers with nothing to gain from batching."""

    def gather_many(self, views: Sequence[torch.Tensor], copies: Sequence[ChunkCopy]) -> None:
        for c in copies:
            self.gather(views, c.block_ids, c.host, c.first)  # type: ignore[attr-defined]

    def scatter_many(self, copies: Sequence[ChunkCopy], views: Sequence[torch.Tensor]) -> None:
        for c in copies:
            self.scatter(c.host, views, c.block_ids, c.first)  # type: ignore[attr-defined]


class OneChunk(WholeLoads):
    """``gather``/``scatter`` as a one-chunk ``*_many``: for movers whose work is per batch (the
    twin of ``PerChunk``)."""

    def gather(
        self, views: Sequence[torch.Tensor], block_ids: Sequence[int], dst: torch.Tensor, first: int = 0
    ) -> None:
        if block_ids:
            self.gather_many(views, [ChunkCopy(block_ids, dst, first)])  # type: ignore[attr-defined]

    def scatter(
        self, src: torch.Tensor, views: Sequence[torch.Tensor], block_ids: Sequence[int], first: int = 0
    ) -> None:
        if block_ids:
            self.scatter_many([ChunkCopy(block_ids, src, first)], views)  # type: ignore[attr-defined]


def split_lead(copies: Sequence[ChunkCopy], blocks: int) -> tuple[list[ChunkCopy], list[ChunkCopy]]:
    """The first ``blocks`` blocks of a move as chunk parts of their own, and the parts left (a
    chunk may be split between the two): a move's lead, enqueued before the rest is checked."""
    lead: list[ChunkCopy] = []
    for index, c in enumerate(copies):
        if blocks <= 0:
            return lead, list(copies[index:])
        if len(c.block_ids) <= blocks:
            lead.append(c)
            blocks -= len(c.block_ids)
            continue
        lead.append(c.part(0, blocks))
        return lead, [c.part(blocks), *copies[index + 1 :]]
    return lead, []


def view_regions(views: Sequence[torch.Tensor], buf: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Pair each pool view with its ``[n, seg_bytes]`` region of a view-major host buffer."""
    n = buf.numel() // sum(v.shape[1] for v in views)
    offset = 0
    for view in views:
        seg = view.shape[1]
        yield view, buf[offset : offset + n * seg].view(n, seg)
        offset += n * seg


def windows(copies: Sequence[ChunkCopy], per_block: int, window_bytes: int) -> list[list[ChunkCopy]]:
    """Split a batch into consecutive windows of at most ``window_bytes`` (at least one chunk each):
    movers issue window by window, so the first copies run while later ones are prepared."""
    out: list[list[ChunkCopy]] = []
    size = 0
    for c in copies:
        need = len(c.block_ids) * per_block
        if not out or size + need > window_bytes:
            out.append([])
            size = 0
        out[-1].append(c)
        size += need
    return out


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split block ids into runs of consecutive ids: ``(position, first_id, length)``.

    One copy per run instead of one per block: consecutive blocks are one contiguous span of
    the pool, and large copies are what DMA engines run fastest.
    """
    runs: list[tuple[int, int, int]] = []
    for pos, bid in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == bid:
            p, first, length = runs[-1]
            runs[-1] = (p, first, length + 1)
        else:
            runs.append((pos, bid, 1))
    return runs
