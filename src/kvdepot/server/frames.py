"""Non-blocking framing on a ZMQ socket shared by threads (the client's DEALER, the server's ROUTER).

    readable(sock) -> bool                    ZMQ_EVENTS shows a message to read
    send_frames(sock, frames, small)          one message, never blocking (``zmq.Again`` if refused)
    recv_frames(sock, small) -> frames        one whole message, never blocking

See ``client.py`` for the rule these serve: every holder of a shared socket's lock drains until
``readable`` is False before it lets go.
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq

from kvdepot.server import protocol as p

# Plain ints: pyzmq's enum flags cost microseconds per operation on the hot path.
_NOBLOCK, _SNDMORE, _RCVMORE, _EVENTS, _POLLIN = (int(c) for c in (zmq.NOBLOCK, zmq.SNDMORE, zmq.RCVMORE,
                                                                   zmq.EVENTS, zmq.POLLIN))


def readable(sock: zmq.Socket) -> bool:
    """ZMQ_EVENTS has POLLIN; reading the option processes pending commands (the fd's signal)."""
    return bool(sock.getsockopt(_EVENTS) & _POLLIN)


def send_frames(sock: zmq.Socket, frames: Sequence[p.Buffer], small: int) -> None:
    """Send one message without blocking; a message of at most ``small`` frames (no payloads) is
    copied, cheaper than zero-copy frames for a few bytes. ``zmq.Again`` if ZMQ cannot take it."""
    copy, last = len(frames) <= small, len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, _NOBLOCK | (_SNDMORE if i < last else 0), copy=copy)


def recv_frames(sock: zmq.Socket, small: int) -> list[p.Buffer]:
    """One whole message, received without blocking (ZMQ delivers all parts at once): its first
    ``small`` frames as bytes, the rest (payloads) zero-copy."""
    frames: list[p.Buffer] = [sock.recv(_NOBLOCK)]
    while sock.getsockopt(_RCVMORE):
        frames.append(sock.recv(_NOBLOCK) if len(frames) < small else sock.recv(_NOBLOCK, copy=False).buffer)
    return frames


