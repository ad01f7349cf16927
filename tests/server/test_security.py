"""Who may reach what on a server: lease ownership, CURVE over TCP, lock and socket files."""

from __future__ import annotations

import os
import socket
import stat

import pytest
import torch
from client_proc import BLOCKS, prompt
from mp_helpers import CHUNK, TOKENS_PER_BLOCK, make_pool, stats, totals

from kvdepot.errors import ConfigError, KVDepotError
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.client import DepotClient, ServerError
from kvdepot.server.paths import check_socket, open_private
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
        owner.store(None, list(range(BLOCKS)), keys=keys).wait()
        assert owner.lookup(keys=keys, lease=7) == 5 * CHUNK
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
        assert intruder.retrieve(None, dst, keys=keys, lease=owner.handover(7)) == 5 * CHUNK
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
