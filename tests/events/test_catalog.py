"""``Catalog``: sink calls in, wire events out — scripted scenarios, no sockets."""

from __future__ import annotations

from kvdepot.events.base import EventSpace, Medium
from kvdepot.events.catalog import Catalog
from kvdepot.events.hashes import BlockHasher
from kvdepot.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvdepot.keys import token_bytes

SPACE = EventSpace("model", "salt", chunk_size=8, tokens_per_block=4)
TOKENS = list(range(100, 132))  # four chunks of eight
KEYS = [bytes([i]) * 16 for i in range(4)]
HASHES = BlockHasher("model", "salt").hashes(TOKENS, 4)


def described(loose_limit: int = 1 << 16) -> Catalog:
    catalog = Catalog(loose_limit)
    catalog.describe(KEYS, token_bytes(TOKENS), SPACE)
    return catalog


def verify_stored(event: object, first_chunk: int, chunks: int, medium: str = "CPU") -> None:
    assert isinstance(event, BlockStored)
    assert event.block_hashes == HASHES[first_chunk * 2 : (first_chunk + chunks) * 2]
    assert event.parent_block_hash == (HASHES[first_chunk * 2 - 1] if first_chunk else None)
    assert event.token_ids == TOKENS[first_chunk * 8 : (first_chunk + chunks) * 8]
    assert (event.block_size, event.medium) == (4, medium)


def test_chained_chunks_merge_into_one_event_and_gaps_split_them() -> None:
    catalog = described()
    (event,) = catalog.stored("e", Medium.HOST, KEYS[:2])
    verify_stored(event, 0, 2)
    first, second = described().stored("e", Medium.HOST, [KEYS[0], KEYS[2], KEYS[3]])
    verify_stored(first, 0, 1)
    verify_stored(second, 2, 2)  # its parent is chunk 1's last block, though chunk 1 is not held


def test_hashes_chain_from_the_prompt_start_whatever_the_describe_calls() -> None:
    catalog = Catalog()
    catalog.describe(KEYS[:1], token_bytes(TOKENS[:8]), SPACE)
    catalog.describe(KEYS, token_bytes(TOKENS + [1, 2, 3]), SPACE)  # grown, with a partial chunk
    verify_stored(catalog.stored("e", Medium.DISK, KEYS)[0], 0, 4, medium="STORAGE")
    other = BlockHasher("model", "other salt").hashes(TOKENS, 4)
    assert not set(other) & set(HASHES)  # salts never share a prefix


def test_unknown_repeated_and_unheld_reports_are_filtered() -> None:
    catalog = described()
    assert catalog.stored("e", Medium.HOST, [b"\xff" * 16]) == []
    assert catalog.stats.unknown == 1
    assert len(catalog.stored("e", Medium.HOST, KEYS[:1])) == 1
    assert catalog.stored("e", Medium.HOST, KEYS[:1]) == []  # told twice: announced once
    assert catalog.removed("e", Medium.DISK, KEYS[:1]) == []  # not on disk
    assert catalog.removed("other", Medium.HOST, KEYS[:1]) == []  # another holder never had it
    (removed,) = catalog.removed("e", Medium.HOST, KEYS[:1])
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == HASHES[:2]
    assert catalog.removed("e", Medium.HOST, KEYS[:1]) == []
    assert catalog.held_chunks == 0


def test_a_prefix_stays_announced_while_any_holder_has_it() -> None:
    catalog = described()
    assert len(catalog.stored("rank0", Medium.HOST, KEYS[:2])) == 1
    assert catalog.stored("rank1", Medium.HOST, KEYS[:2]) == []
    assert catalog.removed("rank0", Medium.HOST, KEYS[:2]) == []
    (removed,) = catalog.removed("rank1", Medium.HOST, KEYS[:2])
    assert removed.block_hashes == HASHES[:4]


def test_each_medium_is_its_own_holding_and_clear_forgets_all() -> None:
    catalog = described()
    stored = [catalog.stored("e", medium, KEYS[:1])[0] for medium in Medium]
    assert [(e.medium, e.locality, e.ownership) for e in stored] == [
        ("CPU", "LOCAL", None), ("STORAGE", "LOCAL", "disk"), ("STORAGE", "REMOTE", "redis")]
    (removed,) = catalog.removed("e", Medium.REDIS, KEYS[:1])
    assert (removed.medium, removed.locality, removed.ownership) == ("STORAGE", "REMOTE", "redis")
    assert isinstance(catalog.cleared()[0], AllBlocksCleared)
    assert catalog.held_chunks == 0
    assert catalog.removed("e", Medium.HOST, KEYS[:1]) == []
    assert len(catalog.stored("e", Medium.HOST, KEYS[:1])) == 1  # descriptions survive a clear


def test_loose_descriptions_are_bounded_but_held_ones_stay() -> None:
    catalog = described(loose_limit=2)  # chunks 0 and 1 are forgotten at once
    assert catalog.stats.forgotten == 2
    assert catalog.stored("e", Medium.HOST, KEYS[:1]) == []
    assert len(catalog.stored("e", Medium.HOST, KEYS[2:3])) == 1
    catalog.describe([bytes([9]) * 16, bytes([8]) * 16], token_bytes(list(range(16))), EventSpace("x", "", 8, 4))
    (removed,) = catalog.removed("e", Medium.HOST, KEYS[2:3])  # held: never forgotten
    assert removed.block_hashes == HASHES[4:6]
