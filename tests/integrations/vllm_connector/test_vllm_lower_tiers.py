"""First-request hits from disk and Redis through the vLLM connector (``lower_tier_hits: load``),
driven like test_vllm_connector.py: the request that finds a prefix only on disk or in Redis is
promised it with ``load_kv_async``, vLLM parks it, the worker loads once the probe's promotion is
in host memory and reports it in ``finished_recving``. Failures injected between the lookup and
the load (the promotion is held meanwhile) end with exactly the failed chunk's blocks and every
later one in ``get_block_ids_with_load_errors``, the blocks before them bit-exact, no lease left.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_helpers import SKIP_REASON, VLLM_MISSING
from vllm_rig import CHUNK, B, Rig, blocks, empty_step, engine, new_step, request, serve_miss

from kvdepot.bench.vllm import random_prompt
from kvdepot.engine_api import Lease
from kvdepot.integrations.vllm.providers import destroy_engine

pytestmark = [pytest.mark.skipif(VLLM_MISSING, reason=SKIP_REASON), pytest.mark.timeout(120)]

PROMPT = random_prompt(1800, seed=7)  # 56 full chunks of 32 tokens (1792), 113 blocks
NUM_BLOCKS = 120
BPC = CHUNK // B
HIT = 1792
IDS_A = list(range(113))
IDS_B = [NUM_BLOCKS - 1 - i for i in range(113)]  # other blocks, reversed: nothing lines up by chance
FAILED_CHUNK = 20


@pytest.fixture(scope="module", autouse=True)
def vllm_imported() -> None:
    import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
    import vllm.v1.kv_cache_interface  # noqa: F401


def stored_by_another_engine(tmp_path: Path, **tiers: Any) -> Rig:
    """Engine A computes and stores PROMPT, then closes (write-behind drained to disk/Redis)."""
    (tmp_path / "a").mkdir()
    first = Rig(tmp_path / "a", num_blocks=NUM_BLOCKS, seed=1, write_queue_depth=64, **tiers)  # 56 chunks at once
    serve_miss(first, "a", PROMPT, IDS_A)
    destroy_engine()  # like a process exit: the next engine starts with an empty host tier
    return first


def fresh(tmp_path: Path, **tiers: Any) -> Rig:
    (tmp_path / "b").mkdir()
    return Rig(tmp_path / "b", num_blocks=NUM_BLOCKS, seed=2, policy="recompute", **tiers)


def hold_promotions(eng: Any = None) -> threading.Event:
    """Promotions of ``eng`` (default: the process's engine) wait for the returned event: the
    window between lookup and load, held open for a test to inject a failure in."""
    lower = (eng or engine()).lower
    original, gate = lower._promote, threading.Event()

    def held(*args):  # type: ignore[no-untyped-def]
        gate.wait(30)
        return original(*args)

    lower._promote = held
    return gate


def ask(rig: Rig, rid: str = "r") -> Any:
    """get_num_new_matched_tokens and update_state_after_alloc as vLLM's scheduler calls them for
    an async hit, then one step in which vLLM schedules nothing (the request is parked)."""
    req = request(rid, PROMPT)
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (HIT, True)
    rig.sched.update_state_after_alloc(req, blocks(IDS_B), HIT)
    meta = rig.step(empty_step())
    [item] = meta.requests
    assert item.load_async and (item.load_skip_blocks, item.load_num_blocks) == (0, HIT // B)
    return req


def wait_loaded(rig: Rig, rid: str = "r") -> set[int]:
    """get_finished until vLLM hears of the load (finished_recving), then that pass's load errors."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sent, recving = rig.worker.get_finished(set())
        errors = rig.worker.get_block_ids_with_load_errors()
        if recving:
            assert recving == {rid} and sent is None
            assert rig.worker.get_finished(set()) == (None, None)  # reported once
            return errors
        assert not errors  # never before the pass that reports the request
        time.sleep(0.005)
    raise AssertionError("the async load was never reported")


def assert_blocks_equal(got: Rig, want: Rig, n: int) -> None:
    for name, t in got.caches.items():
        for i in range(n):
            assert torch.equal(t[IDS_B[i]], want.caches[name][IDS_A[i]]), (name, i)


def finish(rig: Rig, req: Any, computed: int) -> None:
    """vLLM schedules the request from ``computed`` (what it kept), computes the rest and finishes."""
    rest = IDS_B[computed // B :]
    rig.step(new_step(req.request_id, IDS_B, computed, len(PROMPT) - computed), computed_blocks=rest)
    rig.sched.request_finished(req, IDS_B)
    rig.worker.get_finished({req.request_id})
    assert_nothing_pinned()


def assert_nothing_pinned() -> None:
    engine().lower.flush()  # write-behind pins a chunk while the tiers write it
    stats = engine().stats()
    assert stats.live_leases == 0 and stats.pinned_chunks == 0


def test_fresh_engine_first_request_hits_through_redis(tmp_path, redis_server) -> None:
    a = stored_by_another_engine(tmp_path, remote_url=redis_server.url)
    b = fresh(tmp_path, remote_url=redis_server.url)
    req = ask(b)
    assert wait_loaded(b) == set()
    assert_blocks_equal(b, a, HIT // B)
    assert [(e["host"], e["new_matched"], e["load_async"]) for e in b.events("lookup")] == [(0, HIT, True)]
    finish(b, req, HIT)
    assert not [e for e in b.events("store") if e["first_chunk"] < HIT // CHUNK]  # loaded chunks: cached already
    assert engine().stats().lower[0].hits >= HIT // CHUNK


def test_restarted_engine_first_request_hits_from_disk(tmp_path) -> None:
    disk = str(tmp_path / "depot")
    a = stored_by_another_engine(tmp_path, disk_path=disk)
    b = fresh(tmp_path, disk_path=disk)
    req = ask(b)
    assert wait_loaded(b) == set()
    assert_blocks_equal(b, a, HIT // B)
    finish(b, req, HIT)


def test_prefetch_keeps_the_lower_tier_part_for_later_requests(tmp_path) -> None:
    disk = str(tmp_path / "depot")
    stored_by_another_engine(tmp_path, disk_path=disk)
    b = fresh(tmp_path, disk_path=disk, lower_tier_hits="prefetch")
    req = request("r", PROMPT)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    engine().wait_promotions(timeout=30)
    assert b.sched.get_num_new_matched_tokens(request("s", PROMPT), 0) == (HIT, False)  # from host memory now


def ask_until_promoted(rig: Rig, req: Any) -> int:
    """get_num_new_matched_tokens as vLLM's scheduler calls it each step while it answers None."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        matched, load_async = rig.sched.get_num_new_matched_tokens(req, 0)
        if matched is not None:
            assert not load_async  # promised only from host memory
            return matched
        time.sleep(0.005)
    raise AssertionError("the lookup never settled")


def load_promoted_hit(b: Rig, a: Rig, req: Any) -> None:
    """Under ``fail``: ask until the promotion is done, then load the whole hit like a host hit
    (bit-exact against ``a``, no load errors) and finish the request."""
    assert ask_until_promoted(b, req) == HIT
    b.sched.update_state_after_alloc(req, blocks(IDS_B), HIT)
    b.step(new_step("r", IDS_B, HIT, len(PROMPT) - HIT), computed_blocks=IDS_B[HIT // B :])
    assert b.worker.get_block_ids_with_load_errors() == set()
    assert_blocks_equal(b, a, HIT // B)
    b.sched.request_finished(req, IDS_B)
    b.worker.get_finished({"r"})


def test_vllms_default_fail_policy_waits_for_the_promotion_then_loads_from_host(tmp_path) -> None:
    disk = str(tmp_path / "depot")
    a = stored_by_another_engine(tmp_path, disk_path=disk)
    (tmp_path / "b").mkdir()
    b = Rig(tmp_path / "b", num_blocks=NUM_BLOCKS, disk_path=disk)  # kv_load_failure_policy: fail
    gate = hold_promotions()
    req = request("r", PROMPT)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (None, False)  # vLLM asks again next step
    assert b.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    gate.set()
    load_promoted_hit(b, a, req)
    assert_nothing_pinned()


def test_under_the_fail_policy_a_chunk_lost_before_its_promotion_is_a_shorter_hit(tmp_path) -> None:
    disk = str(tmp_path / "depot")
    a = stored_by_another_engine(tmp_path, disk_path=disk)
    (tmp_path / "b").mkdir()
    b = Rig(tmp_path / "b", num_blocks=NUM_BLOCKS, disk_path=disk)
    gate = hold_promotions()
    req = request("r", PROMPT)
    assert b.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    corrupt(disk_file(FAILED_CHUNK))
    gate.set()
    hit = FAILED_CHUNK * CHUNK
    assert ask_until_promoted(b, req) == hit  # never promised: no load error, nothing for vLLM to fail
    b.sched.update_state_after_alloc(req, blocks(IDS_B), hit)
    b.step(new_step("r", IDS_B, hit, len(PROMPT) - hit), computed_blocks=IDS_B[hit // B :])
    assert b.worker.get_block_ids_with_load_errors() == set()
    assert_blocks_equal(b, a, hit // B)
    b.sched.request_finished(req, IDS_B)
    b.worker.get_finished({"r"})
    engine().wait_promotions(timeout=30)
    assert_nothing_pinned()


# ---- failures between the lookup and the load ----------------------------------------------------
def chunk_key(index: int) -> bytes:
    return engine().chunk_keys(PROMPT)[index]


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


def disk_file(index: int) -> Path:
    return Path(engine().lower.disk._path(chunk_key(index)))


def redis_corrupt(redis_server: Any, name: bytes) -> None:
    """Flip one payload byte of a stored value: its checksum no longer matches."""
    client = redis_server.client()
    value = bytearray(client.get(name))
    value[-100] ^= 0xFF
    client.set(name, bytes(value))


FAILURES = {  # (tier, injection, whether the chunk is lost to the load)
    # The probe opened the disk object (DiskTier.hold): a file removed after it is still read, verified.
    "disk file removed": ("disk", lambda srv: disk_file(FAILED_CHUNK).unlink(), False),
    "disk file corrupted": ("disk", lambda srv: corrupt(disk_file(FAILED_CHUNK)), True),
    "redis value deleted": ("redis", lambda srv: srv.client().delete(engine().lower.remote.redis_key(chunk_key(FAILED_CHUNK))), True),
    "redis value corrupted": ("redis", lambda srv: redis_corrupt(srv, engine().lower.remote.redis_key(chunk_key(FAILED_CHUNK))), True),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_chunk_lost_before_its_promotion_is_recomputed_from_there(tmp_path, redis_server, failure) -> None:
    tier, inject, lost = FAILURES[failure]
    tiers = {"disk_path": str(tmp_path / "depot")} if tier == "disk" else {"remote_url": redis_server.url}
    a = stored_by_another_engine(tmp_path, **tiers)
    b = fresh(tmp_path, **tiers)
    gate = hold_promotions()
    req = ask(b)
    inject(redis_server)
    gate.set()
    errors = wait_loaded(b)
    good = FAILED_CHUNK * BPC if lost else HIT // B
    assert errors == set(IDS_B[good : HIT // B])  # the failed chunk's blocks and every later one
    assert_blocks_equal(b, a, good)  # the rest bit-exact
    finish(b, req, good * B)  # vLLM (recompute) truncates at the first failed block


def test_redis_killed_before_the_promotion_loads_nothing(tmp_path, redis_server) -> None:
    tiers = {"remote_url": redis_server.url, "remote_timeout_s": 0.2}
    stored_by_another_engine(tmp_path, **tiers)
    b = fresh(tmp_path, **tiers)
    gate = hold_promotions()
    req = ask(b)
    redis_server.stop()
    gate.set()
    assert wait_loaded(b) == set(IDS_B[: HIT // B])
    finish(b, req, 0)


def test_a_promoted_chunk_evicted_before_the_load_is_recomputed_from_there(tmp_path, redis_server) -> None:
    tiers = {"remote_url": redis_server.url}
    a = stored_by_another_engine(tmp_path, **tiers)
    b = fresh(tmp_path, **tiers)
    gate = hold_promotions()
    req = ask(b)
    eng = engine()
    gate.set()
    eng.wait_promotions(timeout=30)
    eng.release(Lease("r"))  # as if the lease had expired ...
    assert eng.host.delete(chunk_key(FAILED_CHUNK))  # ... and the chunk was evicted before the load
    assert wait_loaded(b) == set(IDS_B[FAILED_CHUNK * BPC : HIT // B])
    assert_blocks_equal(b, a, FAILED_CHUNK * BPC)
    finish(b, req, FAILED_CHUNK * CHUNK)


def test_a_request_aborted_while_its_load_waits_is_reported_once(tmp_path, redis_server) -> None:
    """vLLM keeps an aborted parked request's blocks until finished_recving names it: it must, once."""
    tiers = {"remote_url": redis_server.url}
    stored_by_another_engine(tmp_path, **tiers)
    b = fresh(tmp_path, **tiers)
    gate = hold_promotions()
    req = ask(b)
    assert b.sched.request_finished(req, IDS_B) == (False, None)  # nothing saved: only the load holds the blocks
    gate.set()
    wait_loaded(b)  # the lease is gone: whatever the load could not fill is reported, never used
    engine().wait_promotions(timeout=30)
    assert_nothing_pinned()
