"""What a ``DepotClient`` call is while it runs, and how it fails.

    ServerUnavailable   no (timely) answer: callers treat it as a miss
    ServerError         the server answered with an error reply (``code``, ``message``)
    Reply               a call's future; ``result()``/``done()`` read the socket in the asking thread
    Call                a call's book-keeping: its future, the reply type expected, its deadline
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from kvdepot.errors import KVDepotError, TierUnavailable
from kvdepot.server import protocol as p

if TYPE_CHECKING:
    from kvdepot.server.client import DepotClient


class ServerUnavailable(TierUnavailable):
    """No (timely) answer from the server; the caller treats it as a miss."""


class ServerError(KVDepotError):
    """The server answered with an error reply."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{p.ErrorCode(code).name if code in p.ErrorCode._value2member_map_ else code}: {message}")
        self.code, self.message = code, message


class Reply(Future):
    """A call's future whose ``result()`` and ``done()`` read the socket in the asking thread."""

    def __init__(self, client: DepotClient, req_id: int) -> None:
        super().__init__()
        self._client, self._req_id = client, req_id
        self._waker: tuple[int, int] | None = None  # (thread id, wake-up pipe) of its waiting thread

    def done(self) -> bool:
        if not super().done():
            self._client._drain_now()
        return super().done()

    def result(self, timeout: float | None = None) -> Any:
        return super().result(self._client._wait(self, timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return super().exception(self._client._wait(self, timeout))


@dataclass
class Call:
    future: Reply
    reply: type[msgspec.Struct]
    deadline: float
    timeout: float


