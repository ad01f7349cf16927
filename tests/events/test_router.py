"""``PrefixRouter`` scores prompts from events alone; ``EventFeed`` fills a gap by replay."""

from __future__ import annotations

import pytest

from kvdepot.events.base import EventSpace, Medium
from kvdepot.events.hashes import BlockHasher
from kvdepot.events.publisher import KVEventPublisher
from kvdepot.events.router import EventFeed, PrefixRouter, Score
from kvdepot.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

B = 4
HASHER = BlockHasher("m")
PROMPT = list(range(1000, 1032))  # eight blocks
HASHES = HASHER.hashes(PROMPT, B)


def stored(hashes: list[int], medium: str = "CPU", locality: str = "LOCAL", ownership: str | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=B, lora_id=None,
                       medium=medium, lora_name=None, locality=locality, ownership=ownership)


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(0.0, list(events), 0)  # type: ignore[arg-type]


def test_scores_are_the_longest_held_prefix_by_medium() -> None:
    router = PrefixRouter("m", B)
    router.apply("a", batch(stored(HASHES[:2])))  # host memory: 2 blocks
    router.apply("b", batch(stored(HASHES[:6], "STORAGE", "LOCAL", "disk"), stored(HASHES[:1])))
    router.apply("c", batch(stored(HASHES[1:8])))  # no first block: no prefix at all
    assert router.score("a", PROMPT) == Score(reachable=2, host=2)
    assert router.score("b", PROMPT) == Score(reachable=6, host=1)
    assert router.score("c", PROMPT) == Score(0, 0)
    assert router.route(PROMPT, ["a", "b", "c"]) == "b"
    assert router.score("a", PROMPT[:5]) == Score(1, 1)  # a partial block has no hash
    assert router.blocks("b") == {("STORAGE", "LOCAL", "disk"): 6, ("CPU", "LOCAL", None): 1}


def test_the_shared_tier_counts_for_every_node_and_removals_and_clears_apply() -> None:
    router = PrefixRouter("m", B)
    router.apply("a", batch(stored(HASHES[:4], "STORAGE", "REMOTE", "redis"), stored(HASHES[:4])))
    router.apply("b", batch(stored(HASHES[:1])))
    assert router.score("b", PROMPT) == Score(reachable=4, host=1)  # a's Redis blocks reach b too
    assert router.route(PROMPT, ["a", "b"]) == "a"  # more of it in host memory
    router.apply("a", batch(BlockRemoved(block_hashes=HASHES[2:4], medium="CPU", locality="LOCAL")))
    assert router.score("a", PROMPT) == Score(4, 2)
    router.apply("a", batch(AllBlocksCleared()))
    assert router.score("a", PROMPT) == Score(0, 0) and router.score("b", PROMPT) == Score(1, 1)


def test_ties_go_round_robin_and_no_nodes_is_an_error() -> None:
    router = PrefixRouter("m", B)
    assert [router.route(PROMPT, ["a", "b", "c"]) for _ in range(6)] == ["a", "b", "c"] * 2
    with pytest.raises(ValueError, match="at least one node"):
        router.route(PROMPT, [])


def test_feed_from_publishers_recovers_missed_batches_by_replay(ipc_dir: str) -> None:
    space = EventSpace("m", "", chunk_size=8, tokens_per_block=B)
    pub = KVEventPublisher(f"ipc://{ipc_dir}/n0", replay_endpoint="tcp://127.0.0.1:0")
    router = PrefixRouter("m", B)
    feed = EventFeed(router)
    try:
        keys = [bytes([i]) * 16 for i in range(4)]
        pub.describe(keys, PROMPT, space)
        pub.stored(Medium.HOST, keys[:2])  # sent before the feed subscribed: dropped by PUB
        assert pub.flush()
        feed.add("n0", pub.endpoint, pub.replay_endpoint)
        seen, tag = 0, 0
        while seen == 0 and tag < 50:  # until the subscription is live; each arrival after a gap replays
            pub.stored(Medium.DISK, keys[tag % 4 : tag % 4 + 1])
            pub.removed(Medium.DISK, keys[tag % 4 : tag % 4 + 1])
            assert pub.flush()
            seen = feed.poll(200)
            tag += 1
        assert seen and feed.gaps == 0
        assert router.score("n0", PROMPT) == Score(reachable=4, host=4)  # the first batch, by replay
    finally:
        feed.close()
        pub.close()
