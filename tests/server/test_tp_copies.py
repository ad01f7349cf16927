"""One copy per chunk for KV that is the same on every TP rank (MLA's latent), on an in-process service.

A one-copy group has one shard for both ranks: a chunk stored by both is stored once, loaded into
each rank's pool, and the lookup's pins hold it until every rank has loaded it. ``tp_kv_copies``
decides (the worker declares, a per-rank server refuses); a bad value is a one-line error.
"""

from __future__ import annotations

import functools
import secrets
import threading

import msgspec
import pytest
import torch
from mp_helpers import wait_for

from kvdepot import engine as engine_module
from kvdepot.config import load_config
from kvdepot.errors import ConfigError
from kvdepot.layout import PoolLayout
from kvdepot.server import protocol as p
from kvdepot.server import wire as w
from kvdepot.server.remote import one_copy
from kvdepot.server.service import DepotService
from kvdepot.server.shard import Group
from kvdepot.storage.budget import HostBudget
from kvdepot.storage.pinner import ArenaPinner

pytestmark = pytest.mark.timeout(60)

TPB, CHUNK, BLOCKS, ELEMS = 8, 16, 8, 1 << 16  # kv_factor 1: a block of 256 KiB (bf16), a chunk of 512 KiB
BPB = 2 * 1 * ELEMS * 2
HOST_GB = 0.01  # about 19 chunks


class Rank:
    """One rank's session on the service, with a bytes pool (blocks travel as payloads)."""

    def __init__(self, service: DepotService, rank: int) -> None:
        self.service, self.peer, self.rank = service, f"rank{rank}-{secrets.token_hex(4)}".encode(), rank
        assert self.call(p.Hello(p.PROTOCOL_VERSION, "rank", 0))[0] == 0

    def call(self, msg: msgspec.Struct, payloads=()) -> tuple[int, msgspec.Struct, list]:  # noqa: ANN001
        op = p.OP_OF[type(msg)]
        frames = self.service.handle(self.peer, w.request_frames(op, 1, msg, payloads))
        status = w.parse_reply_header(frames[0]).status
        return status, w.decode(frames[1], p.ErrorReply if status else p.OPS[op].reply), frames[2:]

    def register(self, declared: bool, model: str = "mla") -> tuple[int, msgspec.Struct, list]:
        return self.call(p.Register(model, self.rank, 2, TPB, BLOCKS, 2, 1, ELEMS, "bfloat16", BPB, p.BytesPool(),
                                    one_copy=declared))


def _blocks(seed: int) -> bytes:
    return torch.randint(0, 256, (BLOCKS * BPB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()


KEYS = b"".join(bytes([i]) * 16 for i in range(1, BLOCKS // 2 + 1))  # 4 chunks of 2 blocks


@pytest.fixture
def service(workdir):
    service = DepotService(load_config(chunk_size=CHUNK, host_capacity_gb=HOST_GB), url=f"ipc://{workdir}/t.sock")
    yield service
    service.close()


def _shards(service: DepotService) -> list[tuple[int, float]]:
    return [(s.rank, s.figures["bytes_stored"]) for s in service.snapshot().shards]


def test_one_copy_is_stored_once_and_loaded_into_every_rank(service):
    r0, r1 = Rank(service, 0), Rank(service, 1)
    assert r0.register(True)[0] == 0
    data = _blocks(1)
    assert r0.call(p.Store(KEYS, list(range(BLOCKS))), [data])[1].stored_chunks == 4
    assert r0.call(p.Lookup(7, KEYS))[1].matched_tokens == 0  # rank 1 has not registered: no rank may load
    assert r1.register(True)[0] == 0
    assert r1.call(p.Store(KEYS, list(range(BLOCKS))), [data])[1].stored_chunks == 0  # the same chunks: stored already
    assert _shards(service) == [(0, 4 * 2 * BPB)]  # one shard, one copy of each chunk
    assert r0.call(p.Lookup(7, KEYS))[1].matched_tokens == 4 * CHUNK
    for rank in (r0, r1):
        status, reply, payloads = rank.call(p.Retrieve(KEYS, list(range(BLOCKS))))
        assert status == 0 and reply.end_tokens == 4 * CHUNK and bytes(payloads[0]) == data


def test_per_rank_copies_are_kept_apart(service):
    r0, r1 = Rank(service, 0), Rank(service, 1)
    assert r0.register(False)[0] == r1.register(False)[0] == 0
    assert r0.call(p.Store(KEYS, list(range(BLOCKS))), [_blocks(1)])[1].stored_chunks == 4
    assert r0.call(p.Lookup(7, KEYS))[1].matched_tokens == 0  # rank 1 holds none of it
    assert r1.call(p.Store(KEYS, list(range(BLOCKS))), [_blocks(2)])[1].stored_chunks == 4
    assert _shards(service) == [(0, 4 * 2 * BPB), (1, 4 * 2 * BPB)]
    assert r0.call(p.Lookup(7, KEYS))[1].matched_tokens == 4 * CHUNK
    assert bytes(r1.call(p.Retrieve(KEYS, list(range(BLOCKS))))[2][0]) == _blocks(2)  # rank 1's own bytes


def test_the_shared_copy_stays_pinned_until_the_last_rank_has_loaded(service):
    """Rank 0 loads, then the shard is flooded past its capacity, then rank 1 loads under the same
    lease: the first load must not have released the pins the second one needs."""
    r0, r1 = Rank(service, 0), Rank(service, 1)
    assert r0.register(True)[0] == r1.register(True)[0] == 0
    data = _blocks(1)
    r0.call(p.Store(KEYS, list(range(BLOCKS))), [data])
    status = r0.call(p.Lookup(9, KEYS))[1]
    assert status.matched_tokens == 4 * CHUNK
    lease = dict(lease_session=1, request_id=9, lease_token=status.lease_token)
    assert bytes(r0.call(p.Retrieve(KEYS, list(range(BLOCKS)), **lease))[2][0]) == data
    for i in range(12):  # 48 other chunks into ~19 slots: every unpinned chunk is evicted
        r1.call(p.Store(secrets.token_bytes(16 * 4), list(range(BLOCKS))), [_blocks(100 + i)])
    figures = service.snapshot().shards[0].figures
    assert figures["evictions"] > 0
    status, reply, payloads = r1.call(p.Retrieve(KEYS, list(range(BLOCKS)), **lease))
    assert status == 0 and reply.end_tokens == 4 * CHUNK and bytes(payloads[0]) == data
    r0.call(p.Release(9))
    assert service.snapshot().shards[0].figures["live_leases"] == 0
    assert service.registry.groups()[0].shards[0]._loads == {}  # no count outlives its lease


@pytest.mark.parametrize("pinning", ["ahead-on-cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_group_registered_after_one_that_pinned_the_budget_still_stores(monkeypatch, workdir, pinning):
    """``kvdepot bench tp`` on the H200: every shard's arena pinned ahead (on CPU ``ahead=True``
    runs the CUDA pinner over plain memory), the one-copy group registered first and pinned the
    whole budget, and the per-rank group's stores were all dropped. Now each group gets its half."""
    if pinning == "ahead-on-cpu":
        monkeypatch.setattr(engine_module, "ArenaPinner", functools.partial(ArenaPinner, ahead=True))
    service = DepotService(load_config(chunk_size=CHUNK, host_capacity_gb=HOST_GB), url=f"ipc://{workdir}/p.sock")
    try:
        def pinned() -> bool:
            return all(s.figures["host_pending_chunks"] == 0 for s in service.snapshot().shards)

        one = [Rank(service, r) for r in range(2)]
        assert [r.register(True, model="one")[0] for r in one] == [0, 0]
        assert wait_for(pinned) and service.registry.budget.used > 0.9 * HOST_GB * 1e9  # alone: all of it
        per_rank = [Rank(service, r) for r in range(2)]
        assert [r.register(False, model="per-rank")[0] for r in per_rank] == [0, 0]
        assert wait_for(pinned)
        data = _blocks(1)
        assert [r.call(p.Store(KEYS, list(range(BLOCKS))), [data])[1].stored_chunks for r in per_rank] == [4, 4]
        assert one[0].call(p.Store(KEYS, list(range(BLOCKS))), [data])[1].stored_chunks == 4
        for rank in (one[0], per_rank[0]):
            assert rank.call(p.Lookup(3, KEYS))[1].matched_tokens == 4 * CHUNK
            assert rank.call(p.Release(3))[0] == 0
        assert service.registry.budget.used <= HOST_GB * 1e9
    finally:
        service.close()


def test_the_ranks_load_the_one_copy_at_once(monkeypatch):
    """Each rank's load goes into its own pool under that pool's lock, not the shard's: both
    copies are under way together. A mover that lets a copy start only once the other rank's has
    started proves it (loads taken in turn would break its barrier)."""
    config = load_config(chunk_size=CHUNK, host_capacity_gb=HOST_GB)
    layout = PoolLayout(2 * BLOCKS, 2, 1, ELEMS, torch.bfloat16, TPB, CHUNK)
    register = p.Register("mla", 0, 2, TPB, 2 * BLOCKS, 2, 1, ELEMS, "bfloat16", BPB, p.BytesPool(), one_copy=True)
    group = Group(register, layout, config, HostBudget(int(HOST_GB * 1e9)))
    shard = group.shard(0, layout)
    assert group.shard(1, layout) is shard
    pools = [torch.zeros(2 * BLOCKS, 2, 1, ELEMS, dtype=torch.bfloat16) for _ in range(2)]
    pools[0][:BLOCKS] = torch.randn(BLOCKS, 2, 1, ELEMS)
    keys = [bytes([i]) * 16 for i in range(1, BLOCKS // 2 + 1)]
    shard.store(pools[0], keys, list(range(BLOCKS))).wait()
    assert group.probe(keys, 0, "req") == (4 * CHUNK, 4 * CHUNK)
    both = threading.Barrier(2, timeout=10)
    scatter = shard.engine.mover.scatter_many

    def scatter_together(copies, views):  # noqa: ANN001, ANN202
        both.wait()
        scatter(copies, views)

    monkeypatch.setattr(shard.engine.mover, "scatter_many", scatter_together)
    ends: dict[int, int] = {}

    def load(rank: int) -> None:
        ends[rank] = shard.retrieve(pools[rank], keys, list(range(BLOCKS, 2 * BLOCKS)), 0, None, "req")

    threads = [threading.Thread(target=load, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ends == {0: 4 * CHUNK, 1: 4 * CHUNK}
    for pool in pools:
        assert torch.equal(pool[BLOCKS:].view(torch.uint8), pools[0][:BLOCKS].view(torch.uint8))
    stats = shard.engine.stats()
    assert (stats.live_leases, stats.pinned_chunks, shard._loads) == (0, 0, {})  # the last load released the lease
    for pool in pools:
        shard.detach(pool)
    assert shard.engine.stats().inflight_transfers == 0 and shard._pools == {}
    group.close()


def test_workers_must_agree_and_a_per_rank_server_keeps_copies_apart(service, workdir):
    r0, r1 = Rank(service, 0), Rank(service, 1)
    assert r0.register(True)[0] == 0
    status, reply, _ = r1.register(False)
    assert status == p.ErrorCode.GEOMETRY_MISMATCH and "one_copy" in reply.message
    strict = DepotService(load_config(chunk_size=CHUNK, host_capacity_gb=HOST_GB, tp_kv_copies="per-rank"),
                          url=f"ipc://{workdir}/u.sock")
    try:
        a, b = Rank(strict, 0), Rank(strict, 1)
        assert a.register(True)[0] == b.register(True)[0] == 0
        a.call(p.Store(KEYS, list(range(BLOCKS))), [_blocks(1)])
        b.call(p.Store(KEYS, list(range(BLOCKS))), [_blocks(1)])
        assert [rank for rank, _ in _shards(strict)] == [0, 1]
    finally:
        strict.close()


def test_which_pools_get_one_copy():
    assert one_copy("auto", 1, 2) and one_copy("one", 2, 2)
    assert not one_copy("auto", 2, 2) and not one_copy("per-rank", 1, 2) and not one_copy("one", 1, 1)


def test_a_bad_tp_kv_copies_is_a_one_line_error(monkeypatch):
    with pytest.raises(ConfigError) as err:
        load_config(tp_kv_copies="shared")
    message = str(err.value)
    assert "\n" not in message and "tp_kv_copies" in message
    assert all(v in message for v in ("auto", "per-rank", "one"))
    monkeypatch.setenv("KVDEPOT_TP_KV_COPIES", "2")
    with pytest.raises(ConfigError, match="tp_kv_copies"):
        load_config()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bench_tp_measures_one_copy_against_per_rank_copies(capsys, device):
    import argparse

    from kvdepot.bench import tp

    parser = argparse.ArgumentParser()
    tp.add_arguments(parser)
    rows = tp.run(parser.parse_args(["--device", device, "--layers", "2", "--latent", "64", "--chunks", "2", "--reps", "1",
                                     "--chunk-size", "64", "--tokens-per-block", "32"]))
    one, per_rank = (next(r for r in rows if r["mode"] == m) for m in ("one", "per-rank"))
    chunk_bytes = 2 * 2 * 64 * 64  # layers x latent x tokens x bf16
    assert one["bytes stored per chunk"] == chunk_bytes and per_rank["bytes stored per chunk"] == 2 * chunk_bytes
    assert float(one["load ms (both ranks)"]) > 0 and "memcpy ms" in capsys.readouterr().out
