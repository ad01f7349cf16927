"""Server mode: one publisher for every engine of the server. TP ranks share keys, so a prefix is
announced once and removed only when no rank holds it; a lookup by keys carries the prompt's
tokens when the server asks for them (RegisterReply.wants_tokens)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from event_helpers import all_events, fold

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))

from mp_helpers import CHUNK, POOL_SHAPE, TOKENS_PER_BLOCK, make_pool, short_dir  # noqa: E402

from kvdepot.config import load_config  # noqa: E402
from kvdepot.events.hashes import BlockHasher  # noqa: E402
from kvdepot.server.client import DepotClient  # noqa: E402
from kvdepot.server.remote import RemoteEngine  # noqa: E402
from kvdepot.server.server import DepotServer  # noqa: E402

pytestmark = pytest.mark.timeout(120)
CHUNKS = 3
BLOCKS = CHUNKS * CHUNK // TOKENS_PER_BLOCK


def test_one_publisher_for_all_ranks_with_tokens_from_the_client(ctx):
    workdir = short_dir()
    chunk_bytes = (CHUNK // TOKENS_PER_BLOCK) * 2 * 2 * POOL_SHAPE[3] * 2
    config = load_config(chunk_size=CHUNK, host_capacity_gb=2 * (CHUNKS * chunk_bytes + 64) / 1e9,
                         kv_events_endpoint=f"ipc://{workdir}/ev", kv_events_replay_endpoint="tcp://127.0.0.1:0")
    tokens = [(i * 31) % 50000 for i in range(CHUNKS * CHUNK)]
    other = [(i * 17 + 5) % 50000 for i in range(CHUNKS * CHUNK)]
    hashes = BlockHasher("tp-events").hashes(tokens, TOKENS_PER_BLOCK)
    with DepotServer(f"ipc://{workdir}/s.sock", config) as server:
        publisher = server.service.events
        clients = [DepotClient(server.url, timeout_s=5.0) for _ in range(2)]
        try:
            pools = [make_pool("shm", workdir, seed=r, name=f"tp{r}") for r in range(2)]
            ranks = [RemoteEngine(clients[r], pools[r], TOKENS_PER_BLOCK, model_id="tp-events", mode="shm",
                                  tp_rank=r, tp_size=2) for r in range(2)]
            assert all(rank.granted.wants_tokens for rank in ranks)
            keys = ranks[0].chunk_keys(tokens)  # the edge remembers the tokens...
            ranks[0].lookup(keys=keys, lease=1)  # ...and the lookup by keys carries them
            for rank in ranks:
                rank.store(None, list(range(BLOCKS)), keys=keys).wait()
            events = all_events(ctx, publisher)
            assert fold(events) == {("BlockStored", "CPU", "LOCAL", None): (hashes, tokens)}  # two ranks, once
            assert {e.block_size for e in events} == {TOKENS_PER_BLOCK}
            # Rank 0's arena (three chunks) fills with another prompt: rank 1 still holds the first.
            later = ranks[0].chunk_keys(other)
            ranks[0].lookup(keys=later, lease=2)
            ranks[0].store(None, list(range(BLOCKS, 2 * BLOCKS)), keys=later).wait()
            kinds = [type(e).__name__ for e in all_events(ctx, publisher)]
            assert "BlockRemoved" not in kinds, kinds
            ranks[1].store(None, list(range(BLOCKS, 2 * BLOCKS)), keys=later).wait()  # now rank 1 evicts too
            removed = [e for e in all_events(ctx, publisher) if type(e).__name__ == "BlockRemoved"]
            assert sorted(h for e in removed for h in e.block_hashes) == sorted(hashes)
        finally:
            for c in clients:
                c.close()
