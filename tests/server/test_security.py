"""Who may reach what on a server: lease ownership, CURVE over TCP, lock and socket files."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
from pathlib import Path

import pytest
import torch
import zmq
from client_proc import BLOCKS, prompt
from mp_helpers import CHUNK, TOKENS_PER_BLOCK, make_pool, stats, totals

from kvdepot.config import load_config
from kvdepot.errors import ConfigError, KVDepotError
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.__main__ import main as server_main
from kvdepot.server.auth import write_keys
from kvdepot.server.client import DepotClient, ServerError, ServerUnavailable
from kvdepot.server.paths import check_socket, open_private, tcp_url
from kvdepot.server.remote import RemoteEngine
from kvdepot.server.server import DepotServer

pytestmark = pytest.mark.timeout(60)


def _engine(url: str, pool: torch.Tensor, mode: str, name: str) -> RemoteEngine:
    client = DepotClient(url, timeout_s=5.0, heartbeat_s=0.2, name=name)
    engine = RemoteEngine(client, pool, TOKENS_PER_BLOCK, model_id="owned", mode=mode)
    assert engine.ready
    return engine


# ---- leases belong to the session that took them (or to whoever holds its token) ----------------
def test_another_session_cannot_use_or_drop_a_lease_without_its_token(server_url, workdir):
    owner = _engine(server_url, make_pool("shm", workdir, seed=3, name="owner"), "shm", "owner")
    intruder = _engine(server_url, make_pool("bytes", workdir), "bytes", "intruder")  # same model group
    try:
        keys = owner.chunk_keys(prompt(3))
        owner.store(keys, list(range(BLOCKS))).wait()
        assert owner.lookup(keys, lease=7) == 5 * CHUNK
        assert totals(stats(owner.client))["live_leases"] == 1
        sid = owner.client.session_id
        dst = list(range(16, 16 + BLOCKS))
        # Naming the lease by its (sequential, guessable) session id alone: refused, nothing changes.
        for guess in range(1, sid + 3):
            if guess != intruder.client.session_id:
                with pytest.raises(ServerError):
                    intruder.client.call(p.Retrieve(w.join_keys(keys), dst, 0, None, guess, 7))
        assert totals(stats(owner.client))["live_leases"] == 1
        # ... and so with a wrong token.
        for token in (b"", b"\0" * 16, owner.lease_token[:-1] + bytes([owner.lease_token[-1] ^ 1])):
            msg = p.Retrieve(w.join_keys(keys), dst, 0, None, sid, 7, lease_token=token)
            with pytest.raises(ServerError) as info:
                intruder.client.call(msg)
            assert info.value.code == p.ErrorCode.BAD_REQUEST and "token" in info.value.message
            assert totals(stats(owner.client))["live_leases"] == 1  # changed nothing
        # The token the owner's LOOKUP returned is the hand-over (vLLM's scheduler -> worker).
        expected = owner.pool[:BLOCKS].clone()
        assert intruder.retrieve(keys, dst, lease=owner.handover(7)) == 5 * CHUNK
        assert torch.equal(intruder.pool[dst], expected)
        assert totals(stats(owner.client))["live_leases"] == 0  # the load consumed the lease
    finally:
        for engine in (owner, intruder):
            engine.close()
            engine.client.close()


# ---- the lock file and the socket: never through a symlink, 0600, ours ---------------------------
def test_a_planted_lock_symlink_clobbers_nothing(workdir):
    victim = workdir / "victim.txt"
    victim.write_text("precious")
    url = f"ipc://{workdir}/s.sock"
    (workdir / "s.sock.lock").symlink_to(victim)
    with pytest.raises(KVDepotError, match="symlink"):
        DepotServer(url).start()
    assert victim.read_text() == "precious"
    assert not (workdir / "s.sock").exists()


def test_lock_file_is_private_and_holds_the_pid(workdir):
    lock = workdir / "s.sock.lock"
    lock.write_text("12345678")
    os.chmod(lock, 0o644)
    with DepotServer(f"ipc://{workdir}/s.sock"):
        assert lock.read_text() == str(os.getpid())
        assert stat.S_IMODE(os.lstat(lock).st_mode) == 0o600
        assert stat.S_IMODE(os.lstat(workdir / "s.sock").st_mode) == 0o600


def test_open_private_and_check_socket_refuse_what_is_not_ours(workdir):
    target = workdir / "elsewhere"
    target.write_text("x")
    (workdir / "link").symlink_to(target)
    with pytest.raises(ConfigError, match="symlink"):
        open_private(workdir / "link")
    (workdir / "dir").mkdir()
    with pytest.raises(ConfigError, match="directory"):
        os.close(open_private(workdir / "dir"))
    with socket.socket(socket.AF_UNIX) as sock:
        old = os.umask(0o177)
        try:
            sock.bind(str(workdir / "real.sock"))
        finally:
            os.umask(old)
        check_socket(workdir / "real.sock")  # ours and private: fine
        (workdir / "swapped.sock").symlink_to(workdir / "real.sock")
        with pytest.raises(ConfigError, match="not a private socket"):
            check_socket(workdir / "swapped.sock")
        os.chmod(workdir / "real.sock", 0o666)
        with pytest.raises(ConfigError, match="not a private socket"):
            check_socket(workdir / "real.sock")


# ---- TCP: CURVE keys, or an explicit --insecure -------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Tap:
    """A TCP relay that keeps every byte it forwards: what someone on the wire would see."""

    def __init__(self, upstream: int) -> None:
        self.seen = bytearray()
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port = self._listen.getsockname()[1]
        self._upstream = upstream
        self._socks: list[socket.socket] = [self._listen]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with self._listen:
            try:
                while True:
                    near, _ = self._listen.accept()
                    far = socket.create_connection(("127.0.0.1", self._upstream))
                    self._socks += [near, far]
                    for a, b in ((near, far), (far, near)):
                        threading.Thread(target=self._pump, args=(a, b), daemon=True).start()
            except OSError:
                return

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                self.seen += data
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _store_and_load(url: str, curve_dir: Path | None, workdir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Store a prompt's blocks through ``url``, load them back; (stored, loaded) block bytes."""
    client = DepotClient(url, timeout_s=5.0, heartbeat_s=0.2, name="curve", curve_dir=curve_dir and str(curve_dir))
    try:
        engine = RemoteEngine(client, make_pool("bytes", workdir, seed=21), TOKENS_PER_BLOCK, model_id="tcp", mode="bytes")
        assert engine.ready
        keys = engine.chunk_keys(prompt(21))
        engine.store(keys, list(range(BLOCKS))).wait()
        dst = list(range(16, 16 + BLOCKS))
        assert engine.retrieve(keys, dst) == 5 * CHUNK
        return engine.pool[:BLOCKS].clone(), engine.pool[dst].clone()
    finally:
        client.close()


def test_keys_are_written_private_and_never_overwritten(tmp_path):
    files = write_keys(tmp_path / "keys")
    names = {str(f.relative_to(tmp_path / "keys")) for f in files}
    assert names == {"server.key", "server.key_secret", "client.key", "client.key_secret", "authorized_clients/client.key"}
    assert stat.S_IMODE(os.stat(tmp_path / "keys").st_mode) == 0o700
    for name in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE(os.stat(tmp_path / "keys" / name).st_mode) == 0o600
    with pytest.raises(ConfigError, match="already holds kvdepot keys"):
        write_keys(tmp_path / "keys")


def test_tcp_without_keys_refuses_to_start_unless_insecure(capsys):
    port = _free_port()
    with pytest.raises(ConfigError, match="kvdepot keys DIR.*--insecure"):
        DepotServer(tcp_url(port), load_config())
    assert server_main(["--tcp", str(port)]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--insecure" in err and "server_curve_dir" in err
    with socket.socket() as probe:  # nothing listens
        assert probe.connect_ex(("127.0.0.1", port)) != 0


def test_curve_keeps_out_clients_without_the_keys_and_hides_kv_on_the_wire(tmp_path, workdir):
    keys, strangers = tmp_path / "keys", tmp_path / "strangers"
    write_keys(keys)
    write_keys(strangers)  # a well-formed key pair the server never admitted
    port = _free_port()
    config = load_config(chunk_size=CHUNK, host_capacity_gb=0.01, server_curve_dir=str(keys))
    with DepotServer(tcp_url(port), config) as server:
        tap = _Tap(port)
        try:
            stored, loaded = _store_and_load(f"tcp://127.0.0.1:{tap.port}", keys, workdir)
            assert torch.equal(loaded, stored)
            assert stored.view(torch.uint8).numpy().tobytes()[:4096] not in bytes(tap.seen)  # encrypted
        finally:
            tap.close()
        for curve_dir in (strangers, None):  # another client key pair; plain ZMQ
            other = DepotClient(server.url, timeout_s=1.0, name="stranger", connect=False, log_outages=False,
                                curve_dir=curve_dir and str(curve_dir))
            try:
                assert not other.connect()
                with pytest.raises(ServerUnavailable):  # no LOOKUP, no RETRIEVE: nothing of the KV
                    other.call(p.Lookup(1, b"\0" * 16), handshake=True)
            finally:
                other.close()
        raw = zmq.Context.instance().socket(zmq.DEALER)  # a hand-made client: not even an error reply
        try:
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(server.url)
            raw.send_multipart(w.request_frames(p.Op.HELLO, 1, p.Hello(p.PROTOCOL_VERSION)))
            assert not raw.poll(1000)
        finally:
            raw.close(0)
        assert server.service.snapshot().sessions == 0  # only the keyed client ever had one (closed)
    assert not [t for t in threading.enumerate() if "Authentication" in type(t).__name__]  # ZAP thread joined


def test_insecure_tcp_really_is_plain_text(workdir):
    """The contrast that shows the tap above can see KV: without CURVE the bytes cross in clear."""
    port = _free_port()
    with DepotServer(tcp_url(port), load_config(chunk_size=CHUNK, host_capacity_gb=0.01), insecure=True):
        tap = _Tap(port)
        try:
            stored, loaded = _store_and_load(f"tcp://127.0.0.1:{tap.port}", None, workdir)
            assert torch.equal(loaded, stored)
            assert stored.view(torch.uint8).numpy().tobytes()[:4096] in bytes(tap.seen)
        finally:
            tap.close()
