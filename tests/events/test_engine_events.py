"""What a ``CacheEngine`` publishes as its tiers change: host stores and evictions, disk and Redis
stores, promotions into host memory, Redis keys found gone. Every event is decoded by vLLM."""

from __future__ import annotations

import threading

import redis
from event_helpers import CHUNK, TPB, all_events, fold, where

from kvdepot.events.base import NULL_SINK
from kvdepot.events.hashes import BlockHasher
from kvdepot.events.publisher import KVEventPublisher

HASHER = BlockHasher("m")


def prompt(tag: int, chunks: int) -> list[int]:
    return [tag * 10_000 + i for i in range(chunks * CHUNK)]


HOST = ("BlockStored", "CPU", "LOCAL", None)
DISK = ("BlockStored", "STORAGE", "LOCAL", "disk")
REDIS = ("BlockStored", "STORAGE", "REMOTE", "redis")


def test_host_store_then_eviction(make_engine, ctx):
    engine = make_engine(capacity_chunks=2)
    first, second = prompt(1, 2), prompt(2, 2)
    assert engine.store(first, list(range(4))).chunks == 2
    engine.wait_all()
    assert engine.store(second, list(range(4, 8))).chunks == 2  # evicts both chunks of the first
    engine.wait_all()
    events = all_events(ctx, engine.events)
    stored = [e for e in events if where(e) == HOST]
    assert stored[0].parent_block_hash is None and stored[0].block_size == TPB
    assert fold(events) == {
        HOST: (HASHER.hashes(first, TPB) + HASHER.hashes(second, TPB), first + second),
        ("BlockRemoved", "CPU", "LOCAL", None): (HASHER.hashes(first, TPB), []),
    }


def test_keys_only_stores_are_announced_once_the_edge_described_them(make_engine, ctx):
    engine = make_engine()
    tokens = prompt(3, 2)
    keys = engine.hasher.chunk_keys(tokens)  # a hasher of the caller's own: nothing described
    engine.store(None, list(range(2)), keys=keys[:1])
    engine.wait_all()
    engine.describe(keys, tokens)  # e.g. the vLLM scheduler, which hashes per request salt
    engine.store(None, list(range(4)), keys=keys)  # chunk 0 is cached: only chunk 1 is new
    engine.wait_all()
    (stored,) = all_events(ctx, engine.events)
    assert stored.token_ids == tokens[CHUNK:]
    assert stored.parent_block_hash == HASHER.hashes(tokens, TPB)[1]  # chained to chunk 0's last block
    assert engine.events.stats().unknown == 1


def test_disk_store_promotion_and_removal(make_engine, ctx, tmp_path):
    disk = dict(disk_path=str(tmp_path / "disk"))
    tokens = prompt(4, 2)
    hashes = HASHER.hashes(tokens, TPB)
    writer = make_engine(**disk)
    writer.store(tokens, list(range(4)))
    writer.wait_all()
    writer.lower.flush()
    assert fold(all_events(ctx, writer.events)) == {HOST: (hashes, tokens), DISK: (hashes, tokens)}
    writer.close()

    reader = make_engine(name="r", **disk)  # a restarted process: the disk has the chunks, host memory not
    keys = reader.chunk_keys(tokens)  # the edge: where tokens become keys
    assert reader.probe(keys=keys, lease="req").tokens == len(tokens)
    reader.wait_promotions(timeout=10)
    reader.release("req")
    assert fold(all_events(ctx, reader.events)) == {HOST: (hashes, tokens)}  # promoted: announced
    # The reader found the chunks on disk at start (no tokens then, so not announced): removing
    # one says nothing; a chunk the reader stored itself is announced both ways.
    assert reader.lower.disk.delete(keys[1])
    more = prompt(5, 1)
    reader.store(more, list(range(4, 6)))
    reader.wait_all()
    reader.lower.flush()
    assert reader.lower.disk.delete(reader.chunk_keys(more)[0])
    folded = fold(all_events(ctx, reader.events))
    assert folded[DISK] == (HASHER.hashes(more, TPB), more)
    assert folded[("BlockRemoved", "STORAGE", "LOCAL", "disk")] == (HASHER.hashes(more, TPB), [])


def test_disk_eviction_is_announced(make_engine, ctx, tmp_path):
    engine = make_engine(disk_path=str(tmp_path / "d"))
    size = engine.layout.chunk_bytes + 4096  # an object: header block + payload
    engine.lower.disk.capacity_bytes = 2 * size  # room for two chunks
    old, new = prompt(5, 2), prompt(6, 2)
    for tokens, ids in ((old, range(4)), (new, range(4, 8))):
        engine.store(tokens, list(ids))
        engine.wait_all()
        engine.lower.flush()
    folded = fold(all_events(ctx, engine.events))
    assert folded[DISK][0] == HASHER.hashes(old, TPB) + HASHER.hashes(new, TPB)
    assert folded[("BlockRemoved", "STORAGE", "LOCAL", "disk")][0] == HASHER.hashes(old, TPB)


def test_redis_store_and_keys_found_gone(make_engine, ctx, redis_server):
    engine = make_engine(remote_url=redis_server.url)
    tokens = prompt(7, 2)
    engine.store(tokens, list(range(4)))
    engine.wait_all()
    engine.lower.flush()
    assert fold(all_events(ctx, engine.events))[REDIS] == (HASHER.hashes(tokens, TPB), tokens)
    redis.Redis.from_url(redis_server.url).flushall()  # the server drops keys without telling anyone
    keys = engine.chunk_keys(tokens)
    engine.lower.find(keys)  # a lookup below host memory finds them gone
    folded = fold(all_events(ctx, engine.events))
    assert folded[("BlockRemoved", "STORAGE", "REMOTE", "redis")] == (HASHER.hashes(tokens, TPB), [])
    assert ("BlockRemoved", "CPU", "LOCAL", None) not in folded  # host memory still has them


def test_events_off_by_default_start_nothing(tmp_path):
    import torch

    from kvdepot.config import DepotConfig
    from kvdepot.engine import CacheEngine

    before = threading.active_count()
    pool = torch.zeros(8, 2, 2, TPB * 2, dtype=torch.float16)
    engine = CacheEngine.for_pool(pool, TPB, config=DepotConfig(chunk_size=CHUNK, host_capacity_gb=0.001))
    assert engine.events is NULL_SINK and not isinstance(engine.events, KVEventPublisher)
    assert not [t for t in threading.enumerate() if t.name.startswith("kvdepot-kv-events")]
    engine.close()
    assert threading.active_count() <= before + 1  # (the arena pinner may linger as a finished thread)
