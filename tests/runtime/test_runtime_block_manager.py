"""Scripted scenarios for the V1-style block manager: prefix reuse, LRU eviction, ref counts."""

from __future__ import annotations

import pytest

from kvdepot.runtime.block_manager import BlockManager, OutOfBlocks

B = 4


def _run(bm: BlockManager, rid: int, prompt: list[int], generated: int = 0) -> list[int]:
    """Allocate, compute the prompt (and ``generated`` decode tokens), free; returns the blocks."""
    alloc = bm.allocate(rid, prompt)
    tokens = list(prompt)
    bm.commit(rid, tokens, len(tokens))
    for g in range(generated):
        tokens.append(1000 + g)
        bm.grow(rid, len(tokens))
        bm.commit(rid, tokens, len(tokens) - 1)
    ids = bm.block_ids(rid)
    assert ids[: len(alloc.block_ids)] == alloc.block_ids
    bm.free(rid)
    return ids


def verify_all_free(bm: BlockManager) -> None:
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
    assert bm.num_available() == bm.num_blocks


def test_shared_prefix_is_reused_block_aligned():
    bm = BlockManager(16, B)
    first = _run(bm, 1, list(range(10)))  # blocks: [0..3] [4..7] partial [8, 9]
    alloc = bm.allocate(2, list(range(8)) + [50, 51, 52])
    assert alloc.num_reused_tokens == 8 and alloc.block_ids[:2] == first[:2]
    assert alloc.block_ids[2] not in first[:2] and len(alloc.block_ids) == 3
    bm.free(2)
    verify_all_free(bm)


def test_reuse_leaves_one_prompt_token_to_compute():
    bm = BlockManager(16, B)
    _run(bm, 1, list(range(8)), generated=2)
    assert bm.allocate(2, list(range(8))).num_reused_tokens == 4  # not 8: prompt[:-1] only
    assert bm.allocate(3, list(range(9))).num_reused_tokens == 8


def test_divergent_block_is_not_reused_and_chain_includes_parent():
    bm = BlockManager(16, B)
    _run(bm, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.allocate(2, [1, 2, 3, 0, 5, 6, 7, 8, 9]).num_reused_tokens == 0
    # Same second block's tokens under another parent do not match either.
    assert bm.allocate(3, [0, 0, 0, 0, 5, 6, 7, 8, 9]).num_reused_tokens == 0


def test_running_request_shares_computed_blocks_with_ref_counts():
    bm = BlockManager(16, B)
    prompt = list(range(12))
    a = bm.allocate(1, prompt)
    assert bm.allocate(2, prompt).num_reused_tokens == 0  # nothing computed yet
    bm.commit(1, prompt, 12)
    c = bm.allocate(3, prompt)
    assert c.num_reused_tokens == 8 and c.block_ids[:2] == a.block_ids[:2]
    assert [bm.ref_count(b) for b in a.block_ids] == [2, 2, 1]
    for rid in (1, 2, 3):
        bm.free(rid)
    verify_all_free(bm)


def test_lru_evicts_least_recently_released_first():
    bm = BlockManager(6, B)
    _run(bm, 1, list(range(0, 9)))  # 3 blocks, 2 full ones cached
    _run(bm, 2, list(range(100, 109)))  # 3 blocks, 2 full ones cached
    # Plain free blocks go first: 2 of them (the partial tails); the third evicts request 1's
    # newest-released block, i.e. its tail block [4..7]; its head [0..3] survives one more.
    bm.allocate(3, list(range(200, 212)))
    assert len(bm.match(list(range(0, 9)))[0]) == 1
    assert len(bm.match(list(range(100, 109)))[0]) == 2
    bm.free(3)
    bm.allocate(4, list(range(300, 320)))  # 5 blocks: evicts the LRU ones
    assert bm.match(list(range(0, 9)))[0] == []
    bm.free(4)
    verify_all_free(bm)


def test_reuse_refreshes_lru_position():
    bm = BlockManager(4, B)
    _run(bm, 1, list(range(0, 5)))  # caches block [0..3]
    _run(bm, 2, list(range(100, 105)))  # caches block [100..103]
    _run(bm, 3, list(range(0, 5)))  # reuses and re-releases [0..3]: now most recent
    bm.allocate(4, list(range(200, 212)))  # 3 blocks: 2 plain free + 1 eviction
    bm.free(4)
    assert bm.allocate(5, list(range(0, 5))).num_reused_tokens == 4
    assert bm.match(list(range(100, 105)))[0] == []


def test_out_of_blocks_changes_nothing():
    bm = BlockManager(4, B)
    _run(bm, 1, list(range(9)))
    bm.allocate(2, list(range(50, 55)))
    before = (bm.num_available(), [bm.ref_count(b) for b in range(4)])
    with pytest.raises(OutOfBlocks):
        bm.allocate(3, list(range(9)) + list(range(70, 80)))
    assert (bm.num_available(), [bm.ref_count(b) for b in range(4)]) == before
    with pytest.raises(ValueError):
        bm.allocate(2, [1])


def test_decode_grows_one_block_at_boundaries():
    bm = BlockManager(8, B)
    bm.allocate(1, list(range(6)))
    assert bm.grow(1, 7) == [] and bm.grow(1, 8) == []
    assert len(bm.grow(1, 9)) == 1 and len(bm.block_ids(1)) == 3
    bm.free(1)
    verify_all_free(bm)


def test_reuse_disabled_never_matches():
    bm = BlockManager(8, B, enable_reuse=False)
    _run(bm, 1, list(range(9)))
    assert bm.allocate(2, list(range(9))).num_reused_tokens == 0
