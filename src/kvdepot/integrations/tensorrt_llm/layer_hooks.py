"""When the TensorRT-LLM worker may load by layer, and the waits of one forward's layered loads.

A load by layer leaves the forward stream unguarded: layer ``i``'s attention is safe only because
``wait_for_layer_load(i)`` made the stream wait for layer ``i``'s copies first. TensorRT-LLM calls
that hook from a Python module hook, which does not run on a CUDA-graph replay, so a worker that
loaded by layer before it knew the hooks fire could let a forward read blocks still being copied.
Hence a small state machine, apart from the worker so it can be tested alone:

    LayerHooks()
      allowed                    a whole forward's hooks were seen, in order, and none was missed since
      add(load)                  a layered load (``transfer.layered.LayerWaits``) this forward waits for
      wait_layer(i, stream)      the hook: counts it, makes ``stream`` wait for layer ``i`` of every load
      end_forward(stream, L)     ``wait_for_save``: the forward is over; ``L`` layers: were all hooks seen?
      settle(stream)             every load not waited for layer by layer is waited for wholly, now

States: not seen (whole loads) -> seen (layered loads allowed) -> failed (whole loads for good). A
forward whose layered load was not waited for wholly moves to failed and logs one error: if one of
its layers' attention ran before the copies, that forward read stale KV, which must never pass
silently.
"""

from __future__ import annotations

import logging
from typing import Any

from kvdepot.transfer.layered import LayerWaits, TransferFailed

logger = logging.getLogger("kvdepot")


class LayerHooks:
    """What the forwards' layer hooks have shown, and this forward's layered loads."""

    def __init__(self) -> None:
        self._loads: list[LayerWaits] = []
        self._in_order = 0  # layers 0.. whose hook this forward has called, in order
        self._seen = False  # a whole forward's hooks were seen
        self._failed = False  # a forward skipped a layered load's layer: whole loads from then on

    @property
    def allowed(self) -> bool:
        """Whether the next loads may go by layer (the configuration aside)."""
        return self._seen and not self._failed

    def add(self, load: LayerWaits) -> None:
        self._loads.append(load)

    def wait_layer(self, layer_idx: int, stream: Any) -> None:
        """Count the hook, and make ``stream`` wait for layer ``layer_idx`` of every layered load.

        Raises:
            TransferFailed: a load's copies could not be enqueued (raised after the other loads
                were waited for): its blocks hold no valid KV, and a forward that went on would
                read them.
        """
        self._in_order = self._in_order + 1 if layer_idx == self._in_order else int(layer_idx == 0)
        failed: TransferFailed | None = None
        for load in self._loads:
            try:
                load.wait_layer(layer_idx, stream)
            except TransferFailed as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    def end_forward(self, stream: Any, num_layers: int | None) -> None:
        """The forward is over (``wait_for_save``). Its hooks count as seen if every one of the
        pool's ``num_layers`` fired in order (draft-model layers may follow; None: pool unknown)."""
        if num_layers is not None and self._in_order >= num_layers:
            self._seen = True
        self._in_order = 0
        self.settle(stream)

    def settle(self, stream: Any) -> None:
        """Wait wholly for every load the forward did not wait for layer by layer, so nothing later
        on ``stream`` (saves, the blocks' next owner) runs ahead of its copies."""
        for load in self._loads:
            if load.fully_waited:
                continue
            try:
                load.wait_all(stream)
            except TransferFailed:  # logged where it failed; a forward that waited heard of it
                continue
            if not self._failed:
                logger.error("kvdepot: a layered load's layers were not all waited for by the forward "
                             "(wait_for_layer_load calls missing); loads are whole from now on")
            self._failed = True
        self._loads.clear()
