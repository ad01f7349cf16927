"""``kvdepot.transfer.inflight`` on the CPU: the engine's GPU paths (a store handed to the issuer
thread, its head enqueued by the caller while the issuer wakes, the rest enqueued by a thread that
waits for it before the issuer could, a load on a side stream) run on
``ImmediateStreams`` with the batch mover's driver played by ``pools.HostDriver``, so every byte a
store or load moves is checked, and every lease, pin and transfer comes back to zero."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pools import HostDriver, random_bytes

from kvdepot.config import load_config
from kvdepot.engine import CacheEngine
from kvdepot.layout import PoolLayout
from kvdepot.transfer import BatchBlockMover
from kvdepot.transfer.streams import ImmediateEvent, ImmediateStream, ImmediateStreams

TPB, BPC, BLOCKS = 4, 2, 24
ISSUER = "kvdepot-store-issuer"


def _engine(driver: HostDriver, head_blocks: float = 64, seed: int = 0, streams: ImmediateStreams | None = None):
    """An engine over a CPU pool of random bytes whose batch mover's windows are one block's
    bytes doubling to four, and whose caller may enqueue ``head_blocks`` blocks' worth of a store."""
    gen = torch.Generator().manual_seed(seed)
    pool = random_bytes((BLOCKS, 2, 2, 32), gen).view(torch.float16)
    per_block = pool[0].numel() * pool.element_size()
    layout = PoolLayout.from_pool(pool, TPB, TPB * BPC)
    config = load_config(chunk_size=TPB * BPC, host_capacity_gb=64 * BPC * per_block / 1e9, pin_host_memory="false",
                         store_head_mib=head_blocks * per_block / 2**20)
    mover = BatchBlockMover(window_bytes=4 * per_block, first_window_bytes=per_block, early_bytes=0, driver=driver)
    engine = CacheEngine(layout, config, mover=mover, streams=streams or ImmediateStreams())
    engine.register_pool(pool)
    return engine, pool.view(torch.uint8).view(BLOCKS, -1)


class _Failing(HostDriver):
    """Driver call number ``fail_call`` copies, then raises (an error after part of a store went)."""

    def __init__(self, fail_call: int) -> None:
        super().__init__()
        self.fail_call = fail_call

    def copy(self, copies, lo, hi, stream):
        super().copy(copies, lo, hi, stream)
        if len(self.calls) == self.fail_call:
            raise ValueError("no copy today")


def _both_load_back(engine: CacheEngine, rows, first, second) -> None:
    """The two stores of blocks [3, 9, 4, 17] and [11, 0, 20, 6] load back into a zeroed pool as
    stored; then nothing is left in flight, and the engine closes."""
    expected = rows[[3, 9, 4, 17, 11, 0, 20, 6]].clone()
    rows.zero_()
    assert engine.retrieve(first, [3, 9, 4, 17]) == 16 and engine.retrieve(second, [11, 0, 20, 6]) == 16
    assert torch.equal(rows[[3, 9, 4, 17, 11, 0, 20, 6]], expected)
    _idle(engine)
    engine.close()


def _done(*handles) -> None:
    """Wait for stores without ``wait``, which would enqueue what the issuer has not: the issuer's
    own path, as in an engine whose step loop never waits for a store."""
    deadline = time.monotonic() + 30
    while not all(h.done() for h in handles):
        assert time.monotonic() < deadline, "a store nobody waited for was never issued"
        time.sleep(0.001)


def _wait_within(handle, seconds: float = 30) -> None:
    """``handle.wait()`` that fails the test instead of hanging it."""
    waiter = threading.Thread(target=handle.wait, name="waiter", daemon=True)
    waiter.start()
    waiter.join(seconds)
    assert not waiter.is_alive(), "wait() never returned: nobody enqueued the store"


def _idle(engine: CacheEngine) -> None:
    engine.wait_all()
    stats = engine.stats()
    assert (stats.live_leases, stats.pinned_chunks, stats.inflight_transfers) == (0, 0, 0)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), head_blocks=st.sampled_from([0, 1, 3, 64]), waited=st.booleans())
def test_stores_through_the_issuer_and_loads_on_a_side_stream_are_bit_exact(seed, head_blocks, waited):
    """Random requests stored (the issuer, maybe the caller's head first, or with ``waited`` whoever
    waits first), then loaded back into a poisoned pool, whole or from a random first block:
    exactly the stored bytes, nowhere else."""
    driver = HostDriver()
    engine, rows = _engine(driver, head_blocks, seed)
    rng = random.Random(seed)
    original = rows.clone()
    requests = []
    for _ in range(3):
        ids = rng.sample(range(BLOCKS), 2 * BPC)
        tokens = [rng.randrange(1000) for _ in range(len(ids) * TPB)]
        requests.append((engine.chunk_keys(tokens), ids, engine.store(engine.chunk_keys(tokens), ids)))
    for _keys, _ids, handle in requests:
        handle.wait() if waited else _done(handle)
    assert engine.stats().refused_batches == 0
    for keys, ids, _handle in requests:
        poison = random_bytes(rows.shape, torch.Generator().manual_seed(seed + 1))
        rows.copy_(poison)
        skip = rng.randrange(len(ids))
        assert engine.retrieve(keys, ids, skip_blocks=skip) == len(ids) * TPB
        expect = poison.clone()
        expect[ids[skip:]] = original[ids[skip:]]
        assert torch.equal(rows, expect)
    _idle(engine)
    threads = {c["thread"] for c in driver.calls}
    assert threads <= {"MainThread", ISSUER}
    assert waited or ISSUER in threads or head_blocks >= 2 * BPC  # a head this large may take a whole store
    engine.close()


def test_an_idle_issuer_gets_the_store_after_the_callers_head_and_a_busy_one_gets_it_whole():
    """The caller enqueues a store's first window itself only when the issuer has nothing queued
    (its wake-up is then what the copy engines would wait for); behind a store still being issued
    the caller enqueues nothing and the issuer takes the whole store, in order."""
    driver = HostDriver(gate_call=2)  # the issuer's first window of the first store waits in the driver
    engine, rows = _engine(driver, head_blocks=1)  # a head of one window
    first, second = engine.chunk_keys(list(range(16))), engine.chunk_keys(list(range(100, 116)))
    handle = engine.store(first, [3, 9, 4, 17])
    assert driver.entered.wait(30)
    assert [c["thread"] for c in driver.calls] == ["MainThread", ISSUER]
    other = engine.store(second, [11, 0, 20, 6])  # the issuer is busy: nothing enqueued here
    assert len(driver.calls) == 2 and not handle.done() and not other.done()
    driver.gate.set()
    _done(handle, other)
    assert [c["thread"] for c in driver.calls[2:]] == [ISSUER] * (len(driver.calls) - 2)
    _both_load_back(engine, rows, first, second)


class _LateEvent(ImmediateEvent):
    """An event whose copies are still running until someone synchronizes on it; counts the
    queries made after that."""

    def __init__(self) -> None:
        self.synchronized, self.queries_after = False, 0

    def query(self) -> bool:
        self.queries_after += self.synchronized
        return self.synchronized

    def synchronize(self) -> None:
        self.synchronized = True


class _LateStreams(ImmediateStreams):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[_LateEvent] = []

    def streams(self, device, count):
        kit = self

        class Stream(ImmediateStream):
            def record_event(self, event=None):
                kit.events.append(_LateEvent())
                return kit.events[-1]

        return tuple(Stream(device) for _ in range(count))


def test_a_waited_store_commits_once_its_event_passed_without_asking_the_driver_again():
    """Between a store's last copy and its waiter's return stands only the commit (issue 19):
    the poll after the wait's synchronize does not query the event again; the chunks are READY."""
    kit = _LateStreams()
    engine, _rows = _engine(HostDriver(), streams=kit)
    keys = engine.chunk_keys(list(range(16)))
    handle = engine.store(keys, [3, 9, 4, 17])
    assert not handle.done()  # its event has not passed: nobody synchronized on it yet
    handle.wait()
    assert kit.events and kit.events[-1].synchronized
    assert sum(e.queries_after for e in kit.events) == 0
    assert engine.lookup(keys) == 16
    _idle(engine)
    engine.close()


def test_without_a_head_the_issuer_enqueues_every_copy_of_a_store():
    driver = HostDriver()
    engine, _rows = _engine(driver, head_blocks=0)  # config store_head_mib 0
    _done(engine.store(engine.chunk_keys(list(range(16))), [3, 9, 4, 17]))
    assert driver.calls and {c["thread"] for c in driver.calls} == {ISSUER}
    _idle(engine)
    engine.close()


@pytest.mark.parametrize("fail_call", [1, 3])
def test_a_store_that_cannot_be_enqueued_is_dropped_and_leaks_nothing(fail_call, caplog):
    """An error in a driver call (the first: usually the caller's head; the third: the issuer's)
    drops the store: nothing raised to the engine's step loop, the chunks never visible, every
    slot back, and the next store fine."""

    driver = _Failing(fail_call)
    engine, _rows = _engine(driver, head_blocks=1)
    keys = engine.chunk_keys(list(range(16)))
    with caplog.at_level("ERROR", logger="kvdepot"):
        handle = engine.store(keys, [3, 9, 4, 17])
        handle.wait()
    assert "could not be enqueued" in caplog.text and "no copy today" in caplog.text
    assert handle.done() and engine.lookup(keys) == 0 and engine.stats().host_chunks == 0
    _idle(engine)
    engine.store(keys, [3, 9, 4, 17]).wait()  # calls past the failing one go through
    assert engine.lookup(keys) == 16
    _idle(engine)
    engine.close()


def _no_issuer(monkeypatch) -> None:
    """An issuer that never wakes: only a waiter can enqueue what the caller handed over."""
    monkeypatch.setattr("kvdepot.transfer.inflight.InflightTransfers._start_issuer", lambda self: None)


@pytest.mark.parametrize("head_blocks", [0, 1])
def test_a_waiter_enqueues_the_stores_the_issuer_has_not_started_oldest_first(monkeypatch, head_blocks):
    """Waiting for the second of two stores enqueues both, in order, on the waiting thread (the
    server waits for every store: a wake-up of the issuer would only idle the copy engines)."""
    _no_issuer(monkeypatch)
    driver = HostDriver()
    engine, rows = _engine(driver, head_blocks=head_blocks)
    first, second = engine.chunk_keys(list(range(16))), engine.chunk_keys(list(range(100, 116)))
    one = engine.store(first, [3, 9, 4, 17])
    two = engine.store(second, [11, 0, 20, 6])
    before = len(driver.calls)  # the first store's head, if any (the second's issuer was busy: none)
    assert before == head_blocks and not one.done() and not two.done()
    _wait_within(two)
    assert one.done() and [c["thread"] for c in driver.calls[before:]] == ["waiter"] * (len(driver.calls) - before)
    pool_start = rows.data_ptr()
    order = dict.fromkeys((src - pool_start) // rows.shape[1] for c in driver.calls for src in c["src"])
    assert list(order) == [3, 9, 4, 17, 11, 0, 20, 6]  # one store, then the other
    _both_load_back(engine, rows, first, second)


def test_a_store_that_fails_on_its_waiter_is_dropped_and_the_waiter_carries_on(monkeypatch, caplog):
    """The waiter's driver call fails: the store is dropped and logged as the issuer's would be,
    ``wait`` returns (the step loop is not the place for a store's error), and nothing leaks."""
    _no_issuer(monkeypatch)
    driver = _Failing(2)  # the first call is the caller's head, the second the waiter's
    engine, _rows = _engine(driver, head_blocks=1)
    keys = engine.chunk_keys(list(range(16)))
    with caplog.at_level("ERROR", logger="kvdepot"):
        handle = engine.store(keys, [3, 9, 4, 17])
        _wait_within(handle)
    assert "could not be enqueued" in caplog.text and "no copy today" in caplog.text
    assert [c["thread"] for c in driver.calls] == ["MainThread", "waiter"]
    assert engine.lookup(keys) == 0 and engine.stats().host_chunks == 0
    _idle(engine)
    engine.close()


def test_a_waiter_holding_the_engines_lock_enqueues_behind_a_busy_issuer():
    """Re-registering the pool waits for every copy under the engine's lock. With the issuer
    in the middle of one store and another handed over, the waiter must get the second once the
    issuer is through, not deadlock on it: the issuer takes no lock of the engine's."""
    driver = HostDriver(gate_call=2)  # the issuer's first call waits for the gate
    engine, rows = _engine(driver, head_blocks=1)
    first, second = engine.chunk_keys(list(range(16))), engine.chunk_keys(list(range(100, 116)))
    engine.store(first, [3, 9, 4, 17])
    assert driver.entered.wait(30)
    engine.store(second, [11, 0, 20, 6])
    pool = rows.view(torch.float16).view(BLOCKS, 2, 2, 16)
    worker = threading.Thread(target=engine.register_pool, args=(pool,), daemon=True)
    worker.start()
    worker.join(0.2)
    assert worker.is_alive()  # waiting, under the lock, for the issuer's store
    driver.gate.set()
    worker.join(30)
    assert not worker.is_alive(), "re-registering deadlocked on a store handed to the issuer"
    assert engine.lookup(first) == 16 and engine.lookup(second) == 16
    _idle(engine)
    engine.close()


def test_stores_from_several_threads_each_waited_for_are_each_enqueued_once():
    """Threads store and wait at once, while the issuer takes what it can: every store's copies
    are enqueued exactly once (the bytes moved add up to the stores' bytes, no more), every chunk
    lands, and nothing is left in flight."""

    class Slow(HostDriver):  # calls that take a while: two threads would both see a store not yet taken
        def copy(self, copies, lo, hi, stream):
            time.sleep(0.002)
            super().copy(copies, lo, hi, stream)

    driver = Slow()
    engine, rows = _engine(driver, head_blocks=1)
    per_block, rounds = rows.shape[1], 10
    blocks = random.Random(7).sample(range(BLOCKS), BLOCKS)
    mine = [blocks[t * 8 : (t + 1) * 8] for t in range(3)]  # each thread's blocks: disjoint

    def request(t: int, r: int, s: int) -> tuple[list[int], list[int]]:
        """Thread ``t``'s store ``s`` of round ``r``: fresh tokens each time, so each one copies."""
        first = 10_000 * t + 100 * (2 * r + s)
        return list(range(first, first + 16)), mine[t][4 * s : 4 * s + 4]

    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def run(t: int) -> None:
        try:
            start.wait()
            for r in range(rounds):
                handles = [engine.store(engine.chunk_keys(tokens), ids) for tokens, ids in (request(t, r, 0), request(t, r, 1))]
                handles[-1].wait()  # the older one too: transfers complete in order
                assert all(h.done() and h.chunks == 2 for h in handles)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert driver.bytes_moved() == 3 * rounds * 2 * 4 * per_block  # each store's blocks copied once
    assert {c["thread"] for c in driver.calls} <= {ISSUER, *(t.name for t in threads)}
    expected = rows.clone()
    rows.zero_()
    for t in range(3):
        for s in range(2):
            tokens, ids = request(t, rounds - 1, s)
            assert engine.retrieve(engine.chunk_keys(tokens), ids) == 16
    assert torch.equal(rows, expected)
    _idle(engine)
    engine.close()
