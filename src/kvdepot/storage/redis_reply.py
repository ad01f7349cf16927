"""One GET reply read off a redis-py connection's socket, its value straight into caller memory.

Why this exists: redis-py (and hiredis under it) parses a bulk reply into a new ``bytes`` object;
it has no way to read a value into a buffer the caller already has. For a 32 MiB chunk that is a
fresh 32 MiB allocation, its first-touch page faults, and then one more copy into the host slot:
redis-py's GET reads ~0.35-0.6 GB/s where ``recv_into`` of the same reply into already-touched
memory reads ~1.0-1.4 GB/s (issue 16's probe). So the Redis tier lets redis-py do what it does
well — the connection pool, AUTH, TLS, ``unix://``, the database, which cluster node owns a key —
sends the GET on one of its connections, and reads the reply here.

    reply = BulkReply(sock)
    reply.head(n) -> (length, first bytes) | None   the value's length and its first min(n, length)
                                                    bytes; None for a nil reply (no such key)
    reply.rest_into(out)                            the value's next ``out.nbytes`` bytes, written
                                                    into ``out`` (``recv_into``, no copy), then the
                                                    reply's closing CRLF
    reply.skip_rest()                               the value's remaining bytes, read and dropped

Failures raise redis-py's exceptions, so the tier treats them as it treats redis-py's own: a
timeout ``redis.TimeoutError``, a closed or failing socket (a server killed mid-reply: a short
read) ``redis.ConnectionError`` — outages; an error reply ``ResponseError`` (``MovedError`` /
``AskError`` for a cluster's redirections) and anything that is not RESP ``InvalidResponse`` —
misses. After an error reply the connection's stream is in step (the whole line was read);
after any other failure, or a reply not read to its end, its position is unknown: the caller must
close the connection, never hand it back to the pool.

Reads never go past the reply: the status line and the first bytes come through a small buffer,
each ``recv`` bounded by what the reply has left once its length is known; the value's bulk is
read with ``recv_into`` into the caller's buffer.
"""

from __future__ import annotations

import socket

import redis
from redis.exceptions import AskError, InvalidResponse, MovedError, ResponseError

_SMALL = 512  # the status line ("$<length>\r\n": at most 22 bytes) and the codec header, with room
_CRLF = b"\r\n"


def _error(line: str) -> ResponseError:
    """The exception redis-py would raise for an error reply (``-MOVED 3999 host:port`` …)."""
    kind, _, rest = line.partition(" ")
    if kind == "MOVED":
        return MovedError(rest)
    if kind == "ASK":
        return AskError(rest)
    return ResponseError(line)


class BulkReply:
    """The reply to one GET, read in order: ``head``, then ``rest_into`` / ``skip_rest``."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(_SMALL)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # unread bytes: _buf[_start:_end]
        self._left: int | None = None  # bytes of the reply not yet received (known after the line)
        self._value_left = 0  # bytes of the value not yet handed out

    def head(self, n: int) -> tuple[int, bytes] | None:
        """The status line, then the value's first ``min(n, length)`` bytes."""
        line = self._line()
        kind, text = line[:1], bytes(line[1:])
        if kind in (b"-", b"_") or text == b"-1":  # a whole reply: nothing may follow it
            if self._start != self._end:
                raise InvalidResponse("bytes after the reply")
            if kind == b"-":
                raise _error(text.decode(errors="replace"))
            if kind == b"_" and not text or kind == b"$":  # RESP3's nil, RESP2's
                return None
        if kind != b"$" or not text.isdigit():
            raise InvalidResponse(f"unexpected reply to GET: {bytes(line[:40])!r}")
        length = int(text)
        self._left = length + 2 - (self._end - self._start)  # value and CRLF, less what is buffered
        if self._left < 0:
            raise InvalidResponse("bytes after the reply")  # nothing else may be in flight
        self._value_left = length
        first = min(n, length)
        self._fill(first)
        taken = bytes(self._view[self._start : self._start + first])
        self._start += first
        self._value_left -= first
        return length, taken

    def rest_into(self, out: memoryview) -> None:
        """The value's next ``out.nbytes`` bytes into ``out``; when they end the value, its CRLF too."""
        want = out.nbytes
        if want > self._value_left:
            raise ValueError(f"{want} bytes asked, {self._value_left} left in the value")
        buffered = min(want, self._end - self._start)
        out[:buffered] = self._view[self._start : self._start + buffered]
        self._start += buffered
        done = buffered
        while done < want:
            done += self._recv_into(out[done:], want - done)
        self._value_left -= want
        if not self._value_left:
            self._closing_crlf()

    def skip_rest(self) -> None:
        """Read and drop what is left of the value (a short value the caller does not want)."""
        buffered = min(self._value_left, self._end - self._start)
        self._start += buffered
        self._value_left -= buffered
        while self._value_left:
            self._start = self._end = 0
            self._value_left -= self._recv_into(self._view, min(self._value_left, _SMALL))
        self._closing_crlf()

    # ---- buffered part ---------------------------------------------------------------------
    def _line(self) -> memoryview:
        """The status line (without CRLF); only an error line may be long, and not past the buffer."""
        while True:
            found = self._buf.find(_CRLF, self._start, self._end)
            if found >= 0:
                line = self._view[self._start : found]
                self._start = found + 2
                return line
            if self._end == _SMALL:
                raise InvalidResponse(f"a reply line longer than {_SMALL - 2} bytes")
            self._end += self._recv_into(self._view[self._end :], _SMALL - self._end)

    def _fill(self, n: int) -> None:
        """Until ``n`` unread bytes are buffered (``n`` fits: the caller asks for a header)."""
        if self._start + n > _SMALL:  # move the unread bytes to the front
            unread = self._end - self._start
            self._view[:unread] = self._view[self._start : self._end]
            self._start, self._end = 0, unread
        while self._end - self._start < n:
            self._end += self._recv_into(self._view[self._end :], _SMALL - self._end)

    def _closing_crlf(self) -> None:
        self._fill(2)
        if self._view[self._start : self._start + 2] != _CRLF:
            raise InvalidResponse("a bulk value not followed by CRLF")
        self._start += 2
        if self._start != self._end:
            raise InvalidResponse("bytes after the reply")

    def _recv_into(self, target: memoryview, n: int) -> int:
        """One ``recv_into`` of at most ``n`` bytes, never past the reply's end once that is known."""
        if self._left is not None:
            n = min(n, self._left)
            if n <= 0:
                raise InvalidResponse("the reply is shorter than its own length")
        try:
            got = self._sock.recv_into(target, n)
        except TimeoutError as exc:  # socket.timeout
            raise redis.TimeoutError(f"timeout reading a GET reply: {exc}") from None
        except OSError as exc:
            raise redis.ConnectionError(f"error reading a GET reply: {exc}") from None
        if got == 0:
            raise redis.ConnectionError("the server closed the connection mid-reply")
        if self._left is not None:
            self._left -= got
        return got
