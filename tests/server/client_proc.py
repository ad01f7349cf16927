"""A client in its own process, for the multi-process tests.

    client_proc.py store URL DIR SEED MODEL   register a shared-file pool, store its prompt's chunks
    client_proc.py hit URL SEED MODEL         register a bytes pool, look up and load; check the bytes
    client_proc.py hold URL DIR SEED MODEL    store, then look up with a lease and sleep (to be killed)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from mp_helpers import CHUNK, DTYPE, POOL_SHAPE, TOKENS_PER_BLOCK, make_pool

from kvdepot.server.client import DepotClient
from kvdepot.server.remote import RemoteEngine

NUM_TOKENS = 5 * CHUNK
BLOCKS = NUM_TOKENS // TOKENS_PER_BLOCK


def prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(NUM_TOKENS)]


def engine(url: str, pool: torch.Tensor, model: str, mode: str) -> RemoteEngine:
    client = DepotClient(url, timeout_s=5.0, heartbeat_s=0.2, name=f"proc-{mode}")
    remote = RemoteEngine(client, pool, TOKENS_PER_BLOCK, model_id=model, mode=mode)
    if not remote.ready:
        sys.exit("not registered")
    return remote


def main(argv: list[str]) -> None:
    role, url = argv[0], argv[1]
    if role in ("store", "hold"):
        directory, seed, model = Path(argv[2]), int(argv[3]), argv[4]
        pool = make_pool("shm", directory, seed, name=f"pool-{seed}")
        remote = engine(url, pool, model, "shm")
        keys = remote.chunk_keys(prompt(seed))
        handle = remote.store(keys, list(range(BLOCKS)))
        handle.wait()
        print(f"stored {handle.chunks}", flush=True)
        if role == "hold":
            print(f"matched {remote.lookup(keys, lease=7)}", flush=True)
            print("holding", flush=True)
            time.sleep(120)
        remote.client.close()
        return
    seed, model = int(argv[2]), argv[3]
    pool = torch.zeros(POOL_SHAPE, dtype=DTYPE)
    remote = engine(url, pool, model, "bytes")
    keys = remote.chunk_keys(prompt(seed))
    matched = remote.lookup(keys, lease=1)
    dst = list(range(BLOCKS, 2 * BLOCKS))
    end = remote.retrieve(keys, dst, lease=1)
    expected = make_pool("bytes", Path("/tmp"), seed)[:BLOCKS]
    print(f"matched {matched} end {end} exact {torch.equal(pool[dst], expected)}", flush=True)
    remote.client.close()


if __name__ == "__main__":
    main(sys.argv[1:])
