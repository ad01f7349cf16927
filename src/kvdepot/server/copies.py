"""What ``RemoteEngine`` hands back and sends: a copy in flight, and a lease on the wire.

    CopyHandle(future, finish=, fallback=)   done() / wait() / result() / chunks; .layered
    wire_lease(lease, own_session) -> (session, request id, token)
    on_stream(stream, device)                the caller's CUDA stream for copies on ``device``
    gather_rows(views, ids, stream) / scatter_rows(views, ids, payload, stream)   a bytes pool's blocks

A handle never raises: a refused or failed copy is logged and reads as its fallback (nothing
stored, nothing loaded beyond ``skip_blocks``), which the engine's callers treat as a miss.
A mapped-pool copy carries its ``copy_fence`` ticket: a copy given up on without a reply is not
done until the server has let go of its blocks (``done`` polls for that, ``wait`` waits).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from kvdepot.engine_api import Lease
from kvdepot.errors import KVDepotError
from kvdepot.server.calls import ServerError
from kvdepot.server.copy_fence import Ticket
from kvdepot.server.ipc import frame_tensor
from kvdepot.transfer.layered import LayerWaits

logger = logging.getLogger("kvdepot")

AnyLease = Lease | int | tuple[int, int] | tuple[int, int, bytes]  # the older forms go once the connectors pass ``Lease``


class CopyHandle:
    """A copy in flight: ``done()`` once the server answered (or the call failed)."""

    def __init__(self, future: Future | None, finish: Callable[[Any], int] | None = None, fallback: int = 0,
                 ticket: Ticket | None = None) -> None:
        self._future, self._finish, self._value = future, finish, fallback
        self._settled = future is None
        self.ticket = ticket
        self.layered: LayerWaits | None = None  # a load the server answered by layer: wait on it per layer

    def done(self) -> bool:
        if self._settled:
            return True
        assert self._future is not None
        if not self._future.done():
            return False
        unanswered = self._unanswered()
        if unanswered and self.ticket is not None and not self.ticket.abandon(wait=False):
            return False  # the server is still inside the copy
        self._settled = True
        try:
            result = self._future.result()
            self._value = self._finish(result) if self._finish else self._value
        except ServerError as exc:
            logger.warning("kvdepot: server refused a copy: %s", exc)
        except KVDepotError:
            pass  # unavailable: logged once by the client
        except (IndexError, ValueError, RuntimeError, TypeError) as exc:  # a reply that does not fit
            logger.warning("kvdepot: copy reply could not be applied: %s", exc)
        if not unanswered and self.ticket is not None:
            self.ticket.settle()  # a reply comes after the server let go of the blocks
        return True

    def wait(self) -> None:
        if self._future is not None:
            with contextlib.suppress(KVDepotError):
                self._future.result()
            if self.ticket is not None and not self._settled and self._unanswered():
                self.ticket.abandon(wait=True)
        self.done()

    def keep_ticket(self) -> Ticket | None:
        """Hand the ticket to whoever follows the copy past its reply (a load answered early)."""
        ticket, self.ticket = self.ticket, None
        return ticket

    def _unanswered(self) -> bool:
        """The call ended without the server's answer (timed out, or the server went away)."""
        assert self._future is not None
        error = self._future.exception()
        return error is not None and not isinstance(error, ServerError)

    def result(self) -> int:
        self.wait()
        return self._value

    @property
    def chunks(self) -> int:
        return self._value if self.done() else 0



def wire_lease(lease: AnyLease, own_session: int) -> tuple[int, int, bytes]:
    """(session, request id, token) on the wire; a ``Lease`` of session 0 and a bare rid are the
    caller's own (no token needed); another session's lease travels with that session's token."""
    if isinstance(lease, Lease):
        return lease.session or own_session, int(lease.request_id), lease.token
    if isinstance(lease, tuple):  # the older (session, rid[, token]) form, sent as given
        return int(lease[0]), int(lease[1]), bytes(lease[2]) if len(lease) > 2 else b""
    return own_session, int(lease), b""


def on_stream(stream: Any, device: torch.device) -> Any:
    """The caller's CUDA stream (else the current one) for copies on ``device``; nothing on CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(stream or torch.cuda.current_stream(device))


def gather_rows(views: Sequence[torch.Tensor], ids: list[int], stream: Any) -> memoryview:
    """Blocks ``ids`` of per-layer block ``views`` as one buffer: per block, every view's row in order."""
    device = views[0].device
    index = torch.as_tensor(ids, dtype=torch.long, device=device)
    with on_stream(stream, device):
        parts = [view.index_select(0, index) for view in views]
        rows = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).cpu()
    return memoryview(rows.reshape(-1).numpy())


def scatter_rows(views: Sequence[torch.Tensor], ids: list[int], payload: Any, stream: Any) -> None:
    """The inverse of ``gather_rows``: ``payload``'s rows into blocks ``ids`` of ``views``."""
    device = views[0].device
    rows = frame_tensor(payload).view(len(ids), -1)
    index = torch.as_tensor(ids, dtype=torch.long, device=device)
    with on_stream(stream, device):
        rows = rows.to(device)
        offset = 0
        for view in views:
            width = view.shape[1]
            view.index_copy_(0, index, rows[:, offset : offset + width])
            offset += width
