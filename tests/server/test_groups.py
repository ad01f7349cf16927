"""Model groups on the server: one host budget for all, idle groups freed, REGISTER leaves no
orphan, shared pool files mapped through the descriptor checked and removed after a killed client."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest
import torch

from kvdepot.config import load_config
from kvdepot.server import ipc
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.ipc import shared_cpu_pool
from kvdepot.server.service import DepotService

pytestmark = pytest.mark.timeout(60)

TPB, CHUNK, BLOCKS, ELEMS = 8, 16, 8, 1 << 16  # a block of 512 KiB (bf16): a chunk of 1 MiB
BPB = 2 * 2 * ELEMS * 2
CHUNK_BYTES = 2 * BPB
HOST_GB = 0.01  # 9 chunks in all


class Peer:
    """One client of an in-process service: calls by frames, replies decoded."""

    def __init__(self, service: DepotService, name: bytes, pid: int = 0) -> None:
        self.service, self.name = service, name
        assert self.call(p.Hello(p.PROTOCOL_VERSION, name.decode(), pid))[0] == 0

    def call(self, msg: msgspec.Struct, payloads=()) -> tuple[int, msgspec.Struct]:  # noqa: ANN001
        op = p.OP_OF[type(msg)]
        frames = self.service.handle(self.name, w.request_frames(op, 1, msg, payloads))
        status = w.parse_reply_header(frames[0]).status
        return status, w.decode(frames[1], p.ErrorReply if status else p.OPS[op].reply)

    def register(self, model: str, pool: p.PoolDesc | None = None, dtype: str = "bfloat16") -> tuple[int, msgspec.Struct]:
        kind = getattr(torch, dtype, None)
        bpb = 2 * 2 * ELEMS * (kind.itemsize if isinstance(kind, torch.dtype) else 2)  # the geometry holds
        return self.call(p.Register(model, 0, 1, TPB, BLOCKS, 2, 2, ELEMS, dtype, bpb, pool or p.BytesPool()))

    def store(self, seed: int) -> int:
        keys = torch.Generator().manual_seed(seed)
        blob = torch.randint(0, 256, (16 * BLOCKS // 2,), dtype=torch.uint8, generator=keys).numpy().tobytes()
        status, reply = self.call(p.Store(blob, list(range(BLOCKS))), [bytes(BLOCKS * BPB)])
        assert status == 0, reply
        return reply.stored_chunks


@pytest.fixture
def service(workdir):
    service = DepotService(load_config(chunk_size=CHUNK, host_capacity_gb=HOST_GB), url=f"ipc://{workdir}/g.sock",
                           session_timeout_s=0.2)
    yield service
    service.close()


def _host_bytes(service: DepotService) -> int:
    return sum(s.engine.host.allocated_slots * s.engine.host.slot_bytes
               for g in service.registry.groups() for s in g.shards.values())


def _slots(service: DepotService) -> list[int]:
    """Host slots each shard holds, in registration order."""
    return [s.engine.host.allocated_slots for g in service.registry.groups() for s in g.shards.values()]


def test_every_model_group_draws_on_one_host_budget_and_gets_its_share(service):
    budget = int(HOST_GB * 1e9)
    peers = [Peer(service, f"engine-{i}".encode()) for i in range(6)]
    for i, peer in enumerate(peers):
        assert peer.register(f"model-{i}")[0] == 0
    rounds = []
    for round_ in range(3):  # each model alone could fill the whole budget
        for i, peer in enumerate(peers):
            peer.store(100 * round_ + i)
        rounds.append(_slots(service))
    held = _host_bytes(service)
    assert 0 < held <= budget, (held, budget)
    assert service.registry.budget.used == held
    share = budget // len(peers)  # 1.67 chunks: each holds one or two (a whole segment of one chunk)
    assert all(share // CHUNK_BYTES <= n and n * CHUNK_BYTES < share + CHUNK_BYTES for n in rounds[-1]), rounds
    assert rounds[1] == rounds[2]  # shared once, memory stays put: no ping-pong between models
    assert peers[0].store(999) == rounds[-1][0]  # at its share a model evicts its own coldest chunks


def test_a_model_registering_after_another_filled_the_budget_gets_its_share(service):
    """The first model alone may use the whole budget; a second one takes its share back from it
    (the first one's coldest chunks go) rather than never storing at all."""
    first, second = Peer(service, b"first"), Peer(service, b"second")
    assert first.register("a")[0] == 0
    for seed in range(4):  # 16 chunks into a budget of 9
        first.store(seed)
    assert _slots(service) == [int(HOST_GB * 1e9) // CHUNK_BYTES]
    assert second.register("b")[0] == 0
    assert second.store(100) == BLOCKS // 2  # 4 chunks: within its share of half the budget
    a, b = _slots(service)
    assert b * CHUNK_BYTES <= int(HOST_GB * 1e9) // 2 <= a * CHUNK_BYTES + CHUNK_BYTES
    assert service.registry.budget.used == _host_bytes(service) <= int(HOST_GB * 1e9)
    assert first.store(200) == BLOCKS // 2  # the first model still stores (growing into what is left)
    assert _slots(service)[1] == b and service.registry.budget.used <= int(HOST_GB * 1e9)


def test_an_idle_group_keeps_its_chunks_until_another_model_registers(service):
    first = Peer(service, b"first")
    assert first.register("a")[0] == 0
    assert first.store(1) == BLOCKS // 2
    assert first.call(p.EndSession())[0] == 0
    again = Peer(service, b"restarted")  # the same model's engine, restarted: its cache is there
    assert again.register("a")[0] == 0
    assert again.call(p.Release(0))[0] == 0
    assert again.call(p.EndSession())[0] == 0
    assert [g.name for g in service.registry.groups()] == ["a"] and _host_bytes(service) > 0
    live = Peer(service, b"live")
    assert live.register("b")[0] == 0  # a new model: the idle group "a" is freed, its memory returned
    assert [g.name for g in service.registry.groups()] == ["b"]
    assert service.registry.budget.used == _host_bytes(service) == 0
    live.store(2)
    other = Peer(service, b"other")
    assert other.register("c")[0] == 0  # "b" has a session: it stays
    assert sorted(g.name for g in service.registry.groups()) == ["b", "c"]
    assert service.registry.budget.used == _host_bytes(service) > 0


@pytest.mark.parametrize("dtype", ["qint8", "quint8", "bits8", "int64", "bool", "complex64", "Tensor"])
def test_an_unsupported_dtype_is_a_bad_request_and_leaves_no_group(service, dtype):
    peer = Peer(service, b"q")
    status, error = peer.register("quantized", dtype=dtype)
    assert status == p.ErrorCode.BAD_REQUEST, error
    assert repr(dtype) in error.message and "int8 or uint8" in error.message
    assert service.registry.groups() == []


def test_a_failed_first_register_leaves_no_group(service, workdir):
    peer = Peer(service, b"missing")
    status, _ = peer.register("nofile", p.ShmPool(str(workdir / "absent")))
    assert status == p.ErrorCode.UNSUPPORTED
    assert service.registry.groups() == [] and service.registry.budget.used == 0


def _shm_desc(path) -> tuple[torch.Tensor, p.ShmPool]:  # noqa: ANN001
    pool = shared_cpu_pool(str(path), (BLOCKS, 2, 2, ELEMS), torch.bfloat16)
    return pool, p.ShmPool(str(path))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_reaped_session_of_a_gone_process_loses_its_shared_file(workdir):
    service = DepotService(load_config(chunk_size=CHUNK, host_capacity_gb=HOST_GB), url=f"ipc://{workdir}/g.sock",
                           session_timeout_s=0.0)  # every session is silent at the next reap
    _pool, desc = _shm_desc(workdir / "dead.pool")
    _pool2, desc2 = _shm_desc(workdir / "alive.pool")
    dead = Peer(service, b"dead", pid=_dead_pid())
    alive = Peer(service, b"alive", pid=os.getpid())  # silent too, but its process lives (SIGSTOP)
    try:
        assert dead.register("shm", desc)[0] == 0 and alive.register("shm", desc2)[0] == 0
        service.reap()
        assert service.snapshot().sessions == 0
        assert not os.path.exists(desc.path)  # the killed client's file: removed with its session
        assert os.path.exists(desc2.path)  # a live process may come back for its pool
    finally:
        service.close()


def test_the_shared_file_checked_is_the_file_mapped(service, workdir, monkeypatch):
    """The path is swapped for another file right after the check: the server maps the one it
    checked (through the same descriptor), never the newcomer."""
    pool, desc = _shm_desc(workdir / "pool")
    pool.fill_(1.0)
    decoy, _ = _shm_desc(workdir / "decoy")
    decoy.fill_(-7.0)
    real_fstat = ipc.os.fstat

    def fstat_then_swap(fd):  # noqa: ANN001, ANN202
        info = real_fstat(fd)
        os.replace(workdir / "decoy", desc.path)
        return info

    monkeypatch.setattr(ipc.os, "fstat", fstat_then_swap)
    mapped = ipc.open_pool(desc, (BLOCKS, 2, 2, ELEMS), torch.bfloat16, allow_shm=True)
    monkeypatch.undo()
    try:
        assert torch.equal(mapped.tensor, pool)
        assert not mapped.remove_file()  # the path names the decoy now: it is not ours to remove
        assert os.path.exists(desc.path)
    finally:
        mapped.close()
