"""A scripted RESP2 server on loopback: answers ``+OK`` to every command but HELLO (an error: redis-py
falls back to RESP2) and GET, and to each GET
the next scripted reply — raw bytes, optionally followed by a stop (close the connection, or stall
without answering the rest). Counts the connections it accepted, so a test can tell a connection
that went back to the pool (reused) from one that was closed (a new one is made)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass


@dataclass
class Reply:
    data: bytes  # sent as it is
    then: str = "serve"  # "serve": keep serving; "close": close the connection; "stall": send nothing more


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


class FakeResp:
    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.script: list[Reply] = []
        self.accepted = 0
        self.gets = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            self._conns.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            while not self._stop.is_set():
                command = _read_command(reader)
                if command is None:
                    return
                verb = command[0].upper()
                if verb == b"HELLO":  # a RESP2-only server: redis-py falls back to RESP2
                    conn.sendall(b"-ERR unknown command 'HELLO'\r\n")
                    continue
                if verb != b"GET":
                    conn.sendall(b"+OK\r\n")
                    continue
                self.gets += 1
                reply = self.script.pop(0)
                conn.sendall(reply.data)
                if reply.then == "close":
                    return
                if reply.then == "stall":
                    self._stop.wait()
                    return
        except OSError:
            return
        finally:
            reader.close()
            conn.close()

    def close(self) -> None:
        self._stop.set()
        for conn in [self._listener, *self._conns]:  # shutdown wakes a blocked accept/recv, close does not
            with suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in [self._thread, *self._threads]:
            thread.join(timeout=5)
        self._listener.close()


def _read_command(reader: object) -> list[bytes] | None:
    line = reader.readline()  # type: ignore[attr-defined]
    if not line:
        return None
    assert line.startswith(b"*"), line
    parts = []
    for _ in range(int(line[1:])):
        size = int(reader.readline()[1:])  # type: ignore[attr-defined]
        parts.append(reader.read(size + 2)[:size])  # type: ignore[attr-defined]
    return parts


@contextmanager
def fake_resp() -> Iterator[FakeResp]:
    server = FakeResp()
    try:
        yield server
    finally:
        server.close()
