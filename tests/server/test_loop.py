"""The server's loop thread: what it decodes, what it survives, and how its death is reported."""

from __future__ import annotations

import threading

import pytest
import zmq
from mp_helpers import CHUNK

from kvdepot.config import load_config
from kvdepot.server import __main__ as cli
from kvdepot.server import protocol as p
from kvdepot.server import server as srv
from kvdepot.server import wire as w
from kvdepot.server.server import DepotServer, ServerFailed

pytestmark = pytest.mark.timeout(60)


def _config():
    return load_config(chunk_size=CHUNK, host_capacity_gb=0.01)


def _call(sock: zmq.Socket, op: int, msg, req_id: int = 1) -> tuple[p.ReplyHeader, list[bytes]]:
    sock.send_multipart(w.request_frames(op, req_id, msg))
    assert sock.poll(5000), "no reply"
    frames = sock.recv_multipart()
    return w.parse_reply_header(frames[0]), frames


@pytest.fixture
def served(workdir):
    with DepotServer(f"ipc://{workdir}/l.sock", _config()) as server:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.url)
        assert _call(sock, p.Op.HELLO, p.Hello(p.PROTOCOL_VERSION, "loop"))[0].status == 0
        yield server, sock
        sock.close(0)
        ctx.term()


def test_large_bodies_are_decoded_on_the_pool_small_ones_inline(served, monkeypatch):
    server, sock = served
    threads: dict[int, str] = {}
    real = w.decode_body

    def spy(header, spec, frame):  # noqa: ANN001, ANN202
        threads[header.req_id] = threading.current_thread().name
        return real(header, spec, frame)

    monkeypatch.setattr(w, "decode_body", spy)
    keys = bytes(16 * (p.INLINE_KEYS + 8))  # past inline_body (a bound in bytes, with headroom)
    for req_id, msg in ((1, p.Ping()), (2, p.Lookup(5, keys[:16 * 4])), (3, p.Lookup(6, keys)), (4, p.Release(5)),
                        (5, p.Lookup(7, b"", list(range(p.INLINE_KEYS * 16)))), (6, p.GetStats())):
        header, _ = _call(sock, p.OP_OF[type(msg)], msg, req_id)
        assert header.status == p.ErrorCode.NOT_REGISTERED or header.status == 0, (req_id, header)
    assert threads[1] == threads[2] == threads[4] == "kvdepot-server"
    for req_id in (3, 5, 6):  # over LOOKUP's inline_body, or a POOL op: never decoded on the loop
        assert threads[req_id].startswith("kvdepot-handler"), threads


def test_a_memory_error_on_the_loop_is_an_error_reply_and_serving_goes_on(served, monkeypatch):
    _server, sock = served
    real = w.decode_body

    def starved(header, spec, frame):  # noqa: ANN001, ANN202
        if spec.op == p.Op.QUERY_PREFETCH_STATUS:
            raise MemoryError
        return real(header, spec, frame)

    monkeypatch.setattr(w, "decode_body", starved)
    header, frames = _call(sock, p.Op.QUERY_PREFETCH_STATUS, p.QueryPrefetch(1), 11)
    assert header.status == p.ErrorCode.INTERNAL
    assert "MemoryError" in w.decode(frames[1], p.ErrorReply).message
    assert _call(sock, p.Op.PING, p.Ping(), 12)[0] == p.ReplyHeader(12, 0)  # the loop lives on


def test_a_dead_loop_makes_the_server_process_exit_non_zero(workdir, monkeypatch, capsys):
    def broken(self) -> None:  # noqa: ANN001
        raise RuntimeError("loop bug")

    monkeypatch.setattr(srv.DepotServer, "_serve", broken)
    with pytest.raises(ServerFailed, match="RuntimeError: loop bug"):
        DepotServer(f"ipc://{workdir}/d.sock", _config()).serve_forever()
    status = cli.main(["--url", f"ipc://{workdir}/d2.sock", "--chunk-size", str(CHUNK), "--host-capacity-gb", "0.01",
                       "--log-level", "ERROR"])
    assert status != 0
    assert "loop thread died" in capsys.readouterr().err
