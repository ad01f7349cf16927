"""The copy fence (``server/copy_fence``): a client that gave up on a copy gets its blocks back only
once the server is past the copy or will refuse it, whatever the order, and a dead server lets go."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvdepot.server import copy_fence
from kvdepot.server.copy_fence import FenceError, FenceFile, ServedFence
from kvdepot.server.protocol import ErrorCode, ProtocolError

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not copy_fence.SUPPORTED, reason="needs open-file-description locks (Linux)")]


@pytest.fixture
def fences():
    client = FenceFile.create()
    server = ServedFence.open(client.path, client.epoch)
    client.unlink()
    yield client, server
    server.close()
    client.close()


def _refused(server: ServedFence, number: int, deadline_ns: int = 0) -> str:
    with pytest.raises(ProtocolError) as raised:
        server.admit(number, deadline_ns).enter()
    return f"{raised.value.code.name}: {raised.value.message}"


def test_a_copy_in_progress_keeps_its_blocks_until_it_leaves(fences):
    client, server = fences
    ticket = client.ticket()
    admission = server.admit(ticket.number)
    admission.enter()
    assert not ticket.abandon(wait=False)  # the server is inside the copy
    admission.leave()
    assert ticket.abandon(wait=False) and client.unsettled == 0
    admission.leave()  # idempotent


def test_an_abandoned_copy_is_refused_and_others_go_on(fences):
    client, server = fences
    first, second = client.ticket(), client.ticket()
    assert first.abandon(wait=False)
    assert _refused(server, first.number) == "DEADLINE_EXCEEDED: the client abandoned this copy"
    admission = server.admit(second.number)
    admission.enter()  # another slot: unaffected
    admission.leave()
    second.settle()
    assert client.unsettled == 0


def test_abandon_waits_for_a_copy_in_progress(fences):
    client, server = fences
    ticket = client.ticket()
    admission = server.admit(ticket.number)
    admission.enter()
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (ticket.abandon(wait=True), done.set()))
    waiter.start()
    assert not done.wait(0.3)
    admission.leave()
    assert done.wait(2.0)
    waiter.join()


def test_what_the_server_refuses(fences):
    client, server = fences
    ticket = client.ticket()
    assert "deadline passed" in _refused(server, ticket.number, time.monotonic_ns() - 1)
    assert "not of this registration" in _refused(server, (client.epoch + 1) << 32 | 1)
    assert "not of this registration" in _refused(server, client.epoch << 32)  # sequence 0
    held = server.admit(ticket.number)
    held.enter()
    assert "in use" in _refused(server, ticket.number)  # the same slot twice (a client bug)
    held.leave()
    copy_fence.Admission(None, 0, 0).enter()  # no fence, no deadline: a bytes pool's copy
    server.admit(0).enter()  # no ticket (an older client): the deadline alone
    server.close()
    assert _refused(server, ticket.number).startswith(ErrorCode.NOT_REGISTERED.name)


def test_tickets_skip_unsettled_slots_and_run_out_loudly(fences, monkeypatch, caplog):
    client, _server = fences
    monkeypatch.setattr(copy_fence, "SLOTS", 4)
    tickets = [client.ticket() for _ in range(4)]
    assert len({t.number % 4 for t in tickets}) == 4
    with caplog.at_level(logging.WARNING, logger="kvdepot"):
        assert client.ticket() is None
    assert "unsettled at once" in caplog.text
    tickets[2].settle()
    again = client.ticket()
    assert again.number % 4 == tickets[2].number % 4 and again.number != tickets[2].number
    tickets[2].settle()  # a stale settle leaves the slot's new owner alone
    assert client.unsettled == 4


def test_the_server_opens_only_a_fresh_fence_file(tmp_path):
    client = FenceFile.create()
    try:
        with pytest.raises(FenceError, match="epoch"):
            ServedFence.open(client.path, 0)
        link = tmp_path / f"{copy_fence.PREFIX}link"
        link.symlink_to(client.path)
        with pytest.raises(FenceError, match="cannot open"):
            ServedFence.open(str(link), client.epoch)
        short = tmp_path / f"{copy_fence.PREFIX}short"
        short.write_bytes(b"\0" * 8)
        with pytest.raises(FenceError, match=f"{copy_fence.FILE_BYTES} bytes"):
            ServedFence.open(str(short), client.epoch)
        with pytest.raises(FenceError, match="not named"):
            ServedFence.open(str(tmp_path / "other"), client.epoch)
        used = tmp_path / f"{copy_fence.PREFIX}used"
        used.write_bytes(b"\1" + b"\0" * (copy_fence.FILE_BYTES - 1))
        with pytest.raises(FenceError, match="not fresh"):
            ServedFence.open(str(used), client.epoch)
    finally:
        client.unlink()
        client.close()


def _fence_fds() -> int:
    """Descriptors of this process open on a fence file (the name stays in the link once unlinked)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += copy_fence.PREFIX in os.readlink(f"/proc/self/fd/{fd}")
    return count


def test_nothing_is_left_open():
    gc.collect()  # fences of earlier tests' engines left to the collector
    before = _fence_fds()
    for close in (True, False):
        client = FenceFile.create()
        server = ServedFence.open(client.path, client.epoch)
        client.unlink()
        ticket = client.ticket()
        admission = server.admit(ticket.number)
        admission.enter()
        server.close()  # its locks go with its descriptor
        assert ticket.abandon(wait=False)
        if close:
            client.close()
        del client, ticket
    gc.collect()
    assert _fence_fds() == before


_HOLDER = """
import sys, time
from kvdepot.server.copy_fence import ServedFence
server = ServedFence.open(sys.argv[1], int(sys.argv[2]))
server.admit(int(sys.argv[3])).enter()
print("held", flush=True)
time.sleep(60)
"""


def test_a_server_killed_inside_a_copy_lets_go():
    client = FenceFile.create()
    ticket = client.ticket()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, client.path, str(client.epoch), str(ticket.number)],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "held"
        client.unlink()
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (ticket.abandon(wait=True), done.set()))
        waiter.start()
        assert not done.wait(0.5)  # another process is inside the copy
        proc.send_signal(signal.SIGKILL)
        assert done.wait(5.0)  # its locks went with it
        waiter.join()
    finally:
        proc.kill()
        proc.wait()
        client.close()


def test_no_copy_runs_after_its_abandon_returned_whatever_the_interleaving(fences):
    """Servers enter and leave copies while the client abandons them at random moments; every
    abandon that returned must find no copy of its ticket in progress, then or later."""
    client, server = fences
    rng = random.Random(7)
    log_lock = threading.Lock()
    inside: set[int] = set()  # tickets whose copy is in progress
    returned: set[int] = set()  # tickets whose abandon has returned
    violations: list[str] = []

    def copy(number: int, delay: float, length: float) -> None:
        time.sleep(delay)
        admission = server.admit(number)
        try:
            admission.enter()
        except ProtocolError:
            return
        with log_lock:
            if number in returned:
                violations.append(f"{number:#x} entered after its abandon returned")
            inside.add(number)
        time.sleep(length)
        with log_lock:
            inside.discard(number)
        admission.leave()

    def abandon(ticket: copy_fence.Ticket, delay: float) -> None:
        time.sleep(delay)
        ticket.abandon(wait=True)
        with log_lock:
            if ticket.number in inside:
                violations.append(f"{ticket.number:#x} abandoned while its copy ran")
            returned.add(ticket.number)

    threads = []
    for _ in range(200):
        ticket = client.ticket()
        threads.append(threading.Thread(target=copy, args=(ticket.number, rng.random() * 0.02, rng.random() * 0.005)))
        threads.append(threading.Thread(target=abandon, args=(ticket, rng.random() * 0.02)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert violations == []
    assert client.unsettled == 0


def test_a_layered_load_that_loses_its_server_lets_go_of_it_before_it_fails(fences, monkeypatch):
    """A load answered early whose progress can no longer be learnt (LAYERS timed out): the wait
    abandons the load — returning only once the server's issuer is out of it — and then waits on
    the last layer's event, so the failure is a fenced one; a load that ends well settles."""
    from kvdepot.server.ipc import ServerLayeredLoad
    from kvdepot.server.layer_follow import FencedFailure
    from kvdepot.transfer.layered import TransferFailed

    client, server = fences
    waited: list[int] = []
    monkeypatch.setattr(ServerLayeredLoad, "_wait_event", lambda self, layer, stream: waited.append(layer))

    def lost(layer: int) -> None:
        if layer >= 2:
            raise TransferFailed("kvdepot: the server's layered load failed after 2 layers: ServerUnavailable")

    ticket = client.ticket()
    issuing = server.admit(ticket.number)
    issuing.enter()  # the server's issuer is still enqueueing layers
    load = ServerLayeredLoad([None] * 4, torch.device("cpu"), lost, 2, ticket)
    load.wait_layer(1, None)
    threading.Timer(0.3, issuing.leave).start()
    started = time.monotonic()
    with pytest.raises(FencedFailure, match="let go"):
        load.wait_layer(2, None)
    assert time.monotonic() - started >= 0.25  # held until the issuer was out of the load
    assert waited == [1, 3] and client.unsettled == 0
    assert _refused(server, ticket.number).endswith("abandoned this copy")

    fine = client.ticket()
    load = ServerLayeredLoad([None] * 4, torch.device("cpu"), lambda layer: None, 1, fine)
    for layer in range(4):
        load.wait_layer(layer, None)
    assert client.unsettled == 0
